"""``kiln teachers add|list|remove``: OPD teachers under immutable aliases.

Local by default: the registry under ``$KILN_HOME/teachers`` on this machine (like
``kiln adapters list --local``). With a Kiln server (``--url``/``KILN_URL`` for ``list`` and
``remove``; ``--server``/``KILN_URL`` for ``add``, whose ``--url`` is the remote teacher's)
the commands use ``GET/POST /v1/teachers`` and ``DELETE /v1/teachers/{alias}``; ``--local``
forces the local registry even when ``KILN_URL`` is set. Errors print ``error [<code>]:
<message>`` (and ``hint: …``) on stderr: exit 2 for a refused request, 1 otherwise (over
HTTP, 1 as every client command).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from kiln.cli._client import body, print_json, run
from kiln.errors import KilnError


def add_teachers_parser(sub: Any) -> None:
    te = sub.add_parser(
        "teachers",
        help="register, list and remove OPD teachers",
        description="A teacher is registered under an immutable alias and its identity (model and tokenizer "
        "digests, limits) is pinned; every distillation job re-probes it and fails if it changed. Kinds: local "
        "(a model directory on this machine, optionally with a registry adapter), remote (a vLLM-compatible "
        "endpoint that publishes Kiln's teacher_identity, such as another `kiln serve`) and fixture (pre-scored "
        "JSONL). Works on the registry under $KILN_HOME/teachers unless a server is given.",
    )
    verbs = te.add_subparsers(dest="teachers_verb", metavar="VERB")

    p = verbs.add_parser(
        "add",
        help="register a teacher under a new alias",
        description="--kind local --model PATH [--adapter NAME] | --kind fixture [--file F] [--model-id ID] | "
        "--kind remote --url URL --model-id ID [--credential-id C]. Over HTTP (--server or KILN_URL) the server "
        "registers it (and refuses a teacher whose vocabulary differs from its model); a fixture --file is local "
        "only, since the request body carries no file.",
    )
    p.add_argument("alias", help="the new alias (path-safe: no '/', '\\', '..', not starting with '.')")
    p.add_argument("--kind", required=True, choices=("local", "fixture", "remote"), help="where the scores come from")
    p.add_argument("--model", metavar="PATH", help="local: the teacher's model directory (made absolute)")
    p.add_argument("--adapter", metavar="NAME", help="local: an adapter of the adapter registry served on the model")
    p.add_argument("--file", metavar="F", help="fixture: the pre-scored JSONL file, read strictly and pinned")
    p.add_argument("--model-id", metavar="ID", help="remote: the served model id; fixture: the fixture id")
    p.add_argument("--url", metavar="URL", help="remote: the teacher's base URL (GET URL/v1/models must list it)")
    p.add_argument(
        "--credential-id",
        metavar="C",
        help="remote: credential name; its secret is read from KILN_CREDENTIAL_<C> where the probe runs, never stored",
    )
    p.add_argument("--notes", help="free-form notes")
    p.add_argument(
        "--adapter-dir", help="local registry: adapter registry for --adapter (default: $KILN_HOME/adapters)"
    )
    _server_options(p, flag="--server")
    p.set_defaults(func=cmd_add)

    p = verbs.add_parser("list", help="every registered teacher with its kind, status and identity revision")
    _server_options(p, flag="--url", json_help="print the TeachersListResponse body")
    p.set_defaults(func=cmd_list)

    p = verbs.add_parser("remove", help="remove an alias (receipts and checkpoints that recorded it are unchanged)")
    p.add_argument("alias", help="the alias to remove")
    _server_options(p, flag="--url", json_help="print the DeleteTeacherResponse body")
    p.set_defaults(func=cmd_remove)


def _server_options(parser: argparse.ArgumentParser, *, flag: str, json_help: str = "print the TeacherEntry") -> None:
    parser.add_argument(
        flag,
        dest="server",
        metavar="URL",
        help="Kiln server to register with (default: $KILN_URL; without either, the local registry)",
    )
    parser.add_argument("--api-key", metavar="KEY", help="bearer key of that server (default: $KILN_API_KEY)")
    parser.add_argument("--local", action="store_true", help="use the registry on this machine even if KILN_URL is set")
    parser.add_argument("--json", action="store_true", help=json_help)


def _remote_server(args: argparse.Namespace) -> str | None:
    if args.local:
        return None
    return args.server or os.environ.get("KILN_URL") or None


def _client_args(args: argparse.Namespace, url: str) -> argparse.Namespace:
    return argparse.Namespace(url=url, api_key=args.api_key, json=args.json)


def _error(exc: KilnError) -> int:
    where = f" (at {exc.pointer})" if exc.pointer else ""
    print(f"error [{exc.code}]: {exc.message}{where}", file=sys.stderr)
    if exc.hint:
        print(f"hint: {exc.hint}", file=sys.stderr)
    return 2 if exc.code in ("training_invalid_request", "config_invalid") else 1


def _usage(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 2


def _registry(adapter_dir: str | None = None) -> Any:
    from kiln.host.config import resolve_settings
    from kiln.teachers import TeacherRegistry, teachers_root

    settings = resolve_settings({"model.adapter_dir": adapter_dir})
    return TeacherRegistry(teachers_root(settings.home), adapter_registry=settings.registry)


def _request(args: argparse.Namespace) -> dict[str, Any] | str:
    """The ``RegisterTeacherRequest`` the flags describe, or a usage error."""
    allowed = {
        "local": {"model", "adapter"},
        "fixture": {"file", "model_id"},
        "remote": {"url", "model_id", "credential_id"},
    }[args.kind]
    given = {name for name in ("model", "adapter", "file", "model_id", "url", "credential_id") if getattr(args, name)}
    stray = sorted(given - allowed)
    if stray:
        flags = ", ".join("--" + name.replace("_", "-") for name in stray)
        return f"{flags} do(es) not apply to a {args.kind} teacher"
    request: dict[str, Any] = {"alias": args.alias, "kind": args.kind}
    if args.kind == "local":
        if not args.model:
            return "a local teacher needs --model PATH (its model directory)"
        request["model_id"] = str(Path(args.model).expanduser().resolve())
        if args.adapter:
            request["adapter"] = args.adapter
    elif args.kind == "remote":
        if not (args.url and args.model_id):
            return "a remote teacher needs --url URL and --model-id ID"
        request.update(provider="vllm", url=args.url, model_id=args.model_id)
        if args.credential_id:
            request["credential_id"] = args.credential_id
    else:
        if not (args.file or args.model_id):
            return "a fixture teacher needs --file F (the pre-scored JSONL) or --model-id ID"
        if args.model_id:
            request["model_id"] = args.model_id
    if args.notes is not None:
        request["notes"] = args.notes
    return request


def _print_entry(args: argparse.Namespace, entry: dict[str, Any]) -> None:
    if args.json:
        print_json(entry)
        return
    spec = entry["spec"]
    revision = entry.get("identity_revision")
    pinned = f"; identity {revision[:19]}…" if revision else ""
    print(f"✓ registered teacher {spec['alias']} ({spec['kind']}, {entry['status']}{pinned})")


def cmd_add(args: argparse.Namespace) -> int:
    request = _request(args)
    if isinstance(request, str):
        return _usage(request)
    url = _remote_server(args)
    if url is not None:
        if args.file:
            return _usage(
                "--file registers a pre-scored file on this machine; a server cannot receive it (the request body "
                "carries no file): register with --model-id ID over HTTP, or drop --server/KILN_URL (or pass --local)"
            )

        def add(client: Any) -> int:
            _print_entry(args, body(client.register_teacher(request)))
            return 0

        return run(_client_args(args, url), add)
    try:
        entry = _registry(args.adapter_dir).add(request, fixture_file=Path(args.file) if args.file else None)
    except KilnError as exc:
        return _error(exc)
    _print_entry(args, entry)
    return 0


def _print_listing(args: argparse.Namespace, teachers: list[dict[str, Any]], where: str) -> int:
    if args.json:
        print(json.dumps({"teachers": teachers}, indent=2, ensure_ascii=False))
        return 0
    if not teachers:
        print(f"no teachers registered ({where})")
        return 0
    print(f"{'ALIAS':24} {'KIND':8} {'STATUS':11} {'TOP-K':>5}  {'IDENTITY':22} MODEL")
    for entry in teachers:
        spec = entry["spec"]
        top_k = "-" if spec["max_top_k"] is None else str(spec["max_top_k"])
        revision = entry.get("identity_revision")
        identity = revision[:19] + "…" if revision else "-"
        model = spec["model_id"] + (f" @ {spec['url']}" if spec.get("url") else "")
        if spec.get("adapter"):
            model += f" + adapter {spec['adapter']}"
        print(f"{spec['alias']:24} {spec['kind']:8} {entry['status']:11} {top_k:>5}  {identity:22} {model}")
    return 0


def cmd_list(args: argparse.Namespace) -> int:
    url = _remote_server(args)
    if url is not None:
        return run(
            _client_args(args, url), lambda client: _print_listing(args, body(client.list_teachers())["teachers"], url)
        )
    try:
        registry = _registry()
        teachers = registry.list()
    except KilnError as exc:
        return _error(exc)
    return _print_listing(args, teachers, str(registry.root))


def cmd_remove(args: argparse.Namespace) -> int:
    def printed(answer: dict[str, Any]) -> int:
        if args.json:
            print_json(answer)
        else:
            print(f"✓ removed teacher {answer['alias']}")
        return 0

    url = _remote_server(args)
    if url is not None:
        return run(_client_args(args, url), lambda client: printed(body(client.delete_teacher(args.alias))))
    try:
        answer = _registry().remove(args.alias)
    except KilnError as exc:
        return _error(exc)
    return printed(answer)
