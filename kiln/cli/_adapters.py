"""``kiln adapters list|load|unload|delete|restore|verify``: adapters as content-bound file sets.

``list``, ``load``, ``unload`` and ``delete`` talk to the server (``--url``); ``list`` and ``delete``
read and prune the registry on this machine instead with ``--local`` (implied by ``--adapter-dir``,
and for ``delete`` by ``--dry-run``). ``restore`` and ``verify`` are local; ``verify --url`` adds the
server checks.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from kiln.cli._client import add_client_options, body, print_json, run, server_url
from kiln.errors import KilnError


def add_adapters_parser(sub: Any) -> None:
    ad = sub.add_parser(
        "adapters",
        help="list, load, unload, delete, restore and verify adapters",
        description="Adapters are directories of the adapter registry: a PEFT config and weights file, with a "
        "train receipt and an adapter manifest binding them when Kiln trained them (docs/adapters.md). "
        "list, load, unload and delete talk to the server (--url); --local lists or deletes in the registry "
        "on this machine.",
    )
    verbs = ad.add_subparsers(dest="adapters_verb", metavar="VERB")

    p = verbs.add_parser("list", help="every adapter directory with its config facts, manifest and status")
    p.add_argument("--local", action="store_true", help="list the registry on this machine instead of the server's")
    p.add_argument("--adapter-dir", help="registry directory to list locally (implies --local)")
    add_client_options(p, json_help="print the GET /v1/adapters body")
    p.set_defaults(func=cmd_list)

    p = verbs.add_parser(
        "load",
        help="serve an adapter on the server (it becomes the active adapter)",
        description="The server reads the adapter once, checks its manifest hashes, config and tensors (and its "
        "canary) and makes it the adapter chat completions use by default.",
    )
    p.add_argument("name", help="adapter name in the server's registry")
    p.add_argument("--allow-quarantined", action="store_true", help="load even though its canary quarantined it")
    p.add_argument("--reload", action="store_true", help="re-read the files even if this adapter is already loaded")
    add_client_options(p, json_help="print the server's LoadAdapterResponse")
    p.set_defaults(func=cmd_load)

    p = verbs.add_parser("unload", help="serve the base model again")
    add_client_options(p, json_help="print the server's UnloadAdapterResponse")
    p.set_defaults(func=cmd_unload)

    p = verbs.add_parser(
        "restore",
        help="copy an adapter into the registry from its manifest, verifying every hash",
        description="Read and validate MANIFEST (an adapter manifest), copy the files it names from beside it "
        "into a hidden temporary directory of the registry, hash the copies against the manifest, check the "
        "layout and rename into place. Prints the JSON restore receipt. Nothing is left behind on failure. "
        "Restore never contacts a server and does not prove the destination has the recorded base weights.",
    )
    p.add_argument("manifest", help="path of the adapter manifest to restore from")
    p.add_argument("--adapter-dir", help="destination registry (default: $KILN_HOME/adapters)")
    p.add_argument("--name", help="destination adapter name (default: the manifest's adapter_name)")
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace an existing adapter of that name: DELETES the existing directory once the new copy "
        "is verified (its files are gone for good)",
    )
    p.add_argument(
        "--public-key",
        metavar="PEM",
        help="the source is signed: verify its model.sig with this public key (a signed source's signature is "
        "always carried across and checked against the restored files)",
    )
    p.set_defaults(func=cmd_restore)

    p = verbs.add_parser(
        "verify",
        help="offline checks of an adapter (layout, config, tensors, manifest hashes); exit 1 unless ok",
    )
    _add_target(p)
    p.add_argument(
        "--url",
        help="also check against a running Kiln server at this URL: it serves the adapter for a completion, lists "
        "it with the same manifest hashes, and generates with it and with the base model",
    )
    p.add_argument("--api-key", metavar="KEY", help="bearer key of that server (default: $KILN_API_KEY)")
    p.add_argument("--prompt", help="prompt for the server's base-versus-adapter generation check")
    p.add_argument(
        "--public-key",
        metavar="PEM",
        help="verify model.sig with this public key as well (without it a signed directory's signature is only "
        "checked against its files)",
    )
    _add_key_options(
        p, chain_help="verify a certificate-signed model.sig against this chain (repeat for each)", private=False
    )
    p.add_argument("--json", action="store_true", help="print the JSON check receipt")
    p.set_defaults(func=cmd_verify)

    p = verbs.add_parser(
        "sign",
        help="sign an adapter directory (OpenSSF model signing: model.sig beside its files)",
        description="Write model.sig in the adapter directory: a Sigstore bundle signing every file's SHA-256 "
        "(the model-signing library's format; needs the kiln[signing] extra). The upstream verifier checks it "
        "unchanged: model_signing verify key DIR --signature DIR/model.sig --public_key PUB.pem. Signing changes no "
        "byte the adapter manifest binds.",
    )
    _add_target(p)
    p.add_argument("--key", required=True, metavar="PEM", help="elliptic-curve private key (PEM)")
    p.add_argument("--certificate", metavar="PEM", help="sign with this signing certificate for the key")
    _add_key_options(p, chain_help="a certificate of the signing certificate's chain (repeat for each)", private=True)
    p.add_argument("--json", action="store_true", help="print the signature's facts as JSON")
    p.set_defaults(func=cmd_sign)

    p = verbs.add_parser(
        "attest",
        help="what produced an adapter: an in-toto Statement with the SLSA Provenance v1 predicate",
        description="Print (or write to --out, atomically) an in-toto Statement v1 whose subjects are the adapter's "
        "files and digests and whose SLSA Provenance v1 predicate is derived from its receipt: the effective "
        "config, the base-weight shards, tokenizer, template, training data, base adapter or OPD teacher, the loss "
        'route and precision, Kiln\'s version and commit (docs/adapters.md, "Attestation"). --key wraps it in a '
        "DSSE envelope signed with an elliptic-curve key.",
    )
    _add_target(p)
    p.add_argument("--out", metavar="FILE", help="write to this file instead of printing")
    p.add_argument("--key", metavar="PEM", help="sign the statement as a DSSE envelope with this private key")
    p.add_argument("--password-env", metavar="VAR", help="environment variable holding the key's password, if any")
    p.set_defaults(func=cmd_attest)

    p = verbs.add_parser(
        "export",
        help="a directory ready to upload to a model hub (files, receipt, signature, a model card)",
        description="Copy the adapter's serving files, manifest, receipt, request lineage and signature (if any) "
        "into OUT_DIR, every digest checked, with a generated README.md model card (library_name: peft, base_model, "
        "tags, the training data's digest). OUT_DIR must not exist; it appears complete or not at all.",
    )
    _add_target(p)
    p.add_argument("out_dir", metavar="OUT_DIR", help="the new directory to write")
    p.add_argument("--format", choices=("hf",), default="hf", help="the layout to write (hf: a Hugging Face repo)")
    p.add_argument(
        "--base-model",
        metavar="HUB_ID",
        help="the base model's hub id for the model card (default: the local path the adapter was trained from)",
    )
    p.set_defaults(func=cmd_export)

    p = verbs.add_parser(
        "delete",
        help="delete an adapter and every <name>-checkpoint-* directory beside it",
        description="Removes the adapter directory and all of its exact-resume checkpoints. There is no undo. "
        "The server refuses an adapter it serves or a job writes; --local deletes on this machine.",
    )
    p.add_argument("name", help="adapter name")
    p.add_argument("--yes", action="store_true", help="delete on the server without asking for confirmation")
    p.add_argument("--local", action="store_true", help="delete in the registry on this machine")
    p.add_argument("--adapter-dir", help="registry directory to delete in locally (implies --local)")
    p.add_argument("--dry-run", action="store_true", help="print what would be removed locally (implies --local)")
    add_client_options(p, json_help="print the server's DeleteAdapterResponse (locally: what was removed)")
    p.set_defaults(func=cmd_delete)


def _add_target(p: argparse.ArgumentParser) -> None:
    """The adapter a verb works on: a registry name or a directory, and the registry."""
    p.add_argument("adapter", help="adapter name in the registry, or a directory path")
    p.add_argument("--adapter-dir", help="adapter registry directory (default: $KILN_HOME/adapters)")


def _add_key_options(p: argparse.ArgumentParser, *, chain_help: str, private: bool) -> None:
    """``--certificate-chain`` (repeatable) and, for a private key, ``--password-env``."""
    p.add_argument("--certificate-chain", metavar="PEM", action="append", default=[], help=chain_help)
    if private:
        p.add_argument("--password-env", metavar="VAR", help="environment variable holding the key's password, if any")


def _registry(args: argparse.Namespace) -> Path:
    from kiln.host.config import configured_registry

    return configured_registry(args.adapter_dir)


def _error(exc: KilnError) -> int:
    print(f"error [{exc.code}]: {exc.message}", file=sys.stderr)
    if exc.hint:
        print(f"hint: {exc.hint}", file=sys.stderr)
    return 2 if exc.code in ("training_invalid_request", "config_invalid") else 1


def cmd_list(args: argparse.Namespace) -> int:
    if not (args.local or args.adapter_dir):
        return run(args, lambda client: _print_listing(args, body(client.list_adapters())))
    from kiln.adapters import list_adapters

    try:
        listing = list_adapters(_registry(args))
    except KilnError as exc:
        return _error(exc)
    return _print_listing(args, listing)


def _print_listing(args: argparse.Namespace, listing: dict[str, Any]) -> int:
    if args.json:
        print(json.dumps(listing, indent=2, ensure_ascii=False))
        return 0
    if not listing["available"]:
        print(f"no adapters in {listing['adapter_dir']}")
        return 0
    if listing["active_adapter"] is not None:
        print(f"active: {listing['active_adapter']}")
    print(f"{'NAME':28} {'STATUS':12} {'RANK':>4} {'ALPHA':>6} {'SIZE':>10}  {'WEIGHTS':21}  MANIFEST")
    for e in listing["available"]:
        rank = "-" if e["rank"] is None else str(e["rank"])
        alpha = "-" if e["alpha"] is None else f"{e['alpha']:g}"
        size = f"{e['size_bytes'] / 1e6:.1f} MB"
        weights = "sha256:" + e["adapter_model_sha256"][:12] + "…" if e["adapter_model_sha256"] else "-"
        if e["adapter_manifest"]:
            manifest = f"ok ({len(e['adapter_manifest']['files'])} files bound)"
        elif e["adapter_manifest_error"]:
            manifest = "INVALID: " + e["adapter_manifest_error"]
        else:
            manifest = "none"
        print(f"{e['name']:28} {e['status']:12} {rank:>4} {alpha:>6} {size:>10}  {weights:21}  {manifest}")
        if e["error"]:
            print(f"  {e['error']}")
    print(
        "\nListing is metadata only: no file is hashed, so `available` and a manifest marked ok do not mean the "
        "files match it; `kiln adapters verify NAME` hashes every file (a load on the server does too)."
    )
    return 0


def cmd_load(args: argparse.Namespace) -> int:
    def load(client: Any) -> int:
        request = {"name": args.name, "allow_quarantined": args.allow_quarantined, "reload": args.reload}
        answer = body(client.load_adapter(request))
        if args.json:
            print_json(answer)
        else:
            print(f"✓ loaded {answer['name']} (content revision {answer['content_revision'][:12]}…); now active")
        return 0

    return run(args, load)


def cmd_unload(args: argparse.Namespace) -> int:
    def unload(client: Any) -> int:
        answer = body(client.unload_adapter())
        if args.json:
            print_json(answer)
        else:
            print("✓ unloaded: the server serves the base model")
        return 0

    return run(args, unload)


def cmd_restore(args: argparse.Namespace) -> int:
    from kiln.adapters import restore_adapter

    try:
        receipt = restore_adapter(
            Path(args.manifest),
            _registry(args),
            name=args.name,
            overwrite=args.overwrite,
            public_key=args.public_key,
        )
    except KilnError as exc:
        return _error(exc)
    print(json.dumps(receipt, indent=2, ensure_ascii=False))
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    from kiln.adapters import verify_adapter

    try:
        receipt = verify_adapter(
            args.adapter,
            _registry(args),
            url=args.url,
            prompt=args.prompt,
            api_key=args.api_key or os.environ.get("KILN_API_KEY") or None,
            public_key=args.public_key,
            certificate_chain=tuple(args.certificate_chain),
        )
    except KilnError as exc:
        return _error(exc)
    if args.json:
        print(json.dumps(receipt, indent=2, ensure_ascii=False))
    else:
        for check in receipt["checks"]:
            mark = "✓" if check["pass"] else "✗"
            print(f"{mark} {check['name']:24} {check.get('message') or ''}")
        summary = receipt.get("tensor_summary") or {}
        if summary.get("lora_update_l2_upper_bound") is not None:
            print(f"  LoRA update bound sum |A||B| = {summary['lora_update_l2_upper_bound']:.6g}")
        print(f"{receipt['status']}: {receipt.get('adapter_path') or receipt.get('input')}")
    return 0 if receipt["status"] == "ok" else 1


def cmd_sign(args: argparse.Namespace) -> int:
    from kiln.adapters.signing import locate, sign_adapter

    password = os.environ.get(args.password_env) if args.password_env else None
    if args.password_env and password is None:
        print(f"error: the environment variable {args.password_env} (--password-env) is not set", file=sys.stderr)
        return 2
    try:
        where = locate(args.adapter, _registry(args))
        facts = sign_adapter(
            where,
            private_key=args.key,
            password=password,
            certificate=args.certificate,
            certificate_chain=tuple(args.certificate_chain),
        )
    except KilnError as exc:
        return _error(exc)
    if args.json:
        print(json.dumps(facts, indent=2, ensure_ascii=False))
    else:
        print(f"Signed {len(facts['signed_files'])} files: {where / facts['file']}")
        print(f"Key:      {facts['key_fingerprint']}")
    return 0


def cmd_attest(args: argparse.Namespace) -> int:
    from kiln.adapters.attest import attestation, dsse_envelope
    from kiln.adapters.signing import locate
    from kiln.host.fs import atomic_write_bytes

    password = os.environ.get(args.password_env) if args.password_env else None
    try:
        document = attestation(locate(args.adapter, _registry(args)))
        if args.key:
            document = dsse_envelope(document, args.key, password)
    except KilnError as exc:
        return _error(exc)
    text = json.dumps(document, indent=2, ensure_ascii=False, sort_keys=True) + "\n"
    if args.out:
        atomic_write_bytes(args.out, text.encode("utf-8"))
        print(f"Wrote {args.out}")
    else:
        sys.stdout.write(text)
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from kiln.adapters.attest import export_hf
    from kiln.adapters.signing import locate

    try:
        found = export_hf(locate(args.adapter, _registry(args)), args.out_dir, base_model=args.base_model)
    except KilnError as exc:
        return _error(exc)
    print(f"Exported {len(found['files'])} files to {found['directory']}: {', '.join(found['files'])}")
    return 0


def _confirmed(args: argparse.Namespace) -> bool:
    if args.yes:
        return True
    if not sys.stdin.isatty():
        print(
            f"error: deleting {args.name!r} on {server_url(args)} removes it and all of its checkpoints; "
            "pass --yes to confirm (there is no terminal to ask on)",
            file=sys.stderr,
        )
        return False
    answer = input(f"Delete adapter {args.name!r} and all of its checkpoints on {server_url(args)}? [y/N] ")
    if answer.strip().lower() in ("y", "yes"):
        return True
    print("nothing deleted", file=sys.stderr)
    return False


def cmd_delete(args: argparse.Namespace) -> int:
    if not (args.local or args.adapter_dir or args.dry_run):
        if not _confirmed(args):
            return 2

        def delete(client: Any) -> int:
            answer = body(client.delete_adapter(args.name))
            if args.json:
                print_json(answer)
            else:
                print(f"✓ deleted {answer['name']} and its checkpoints")
            return 0

        return run(args, delete)
    from kiln.adapters import delete_adapter

    try:
        removed = delete_adapter(_registry(args), args.name, dry_run=args.dry_run)
    except KilnError as exc:
        return _error(exc)
    if args.json:
        print(json.dumps({"name": args.name, "dry_run": args.dry_run, "removed": [str(p) for p in removed]}, indent=2))
        return 0
    verb = "would remove" if args.dry_run else "removed"
    for path in removed:
        print(f"{verb} {path}")
    return 0
