"""The ``kiln`` command. Keep imports lazy: ``kiln --help`` and ``kiln validate`` must not import torch."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from kiln import __version__


def _cmd_validate(args: argparse.Namespace) -> int:
    from kiln import contracts
    from kiln.errors import KilnError

    try:
        report = contracts.validate_path(Path(args.file), doc_type=args.type)
    except KilnError as exc:
        report = contracts.ValidationReport(
            valid=False, type=args.type, errors=getattr(exc, "problems", None) or [], path=args.file
        )
        if not report.errors:
            from kiln.errors import Problem

            report.errors.append(Problem(exc.code, exc.pointer or "", exc.message))
    if args.json:
        print(json.dumps(report.as_dict(), ensure_ascii=False, indent=2))
    elif report.valid:
        print(f"✓ {args.file}: valid {report.type}")
    else:
        print(f"✗ {args.file}: invalid {report.type or 'document'}", file=sys.stderr)
        for problem in report.errors:
            print(f"  {problem.code} at {problem.pointer or '/'}: {problem.message}", file=sys.stderr)
    return 0 if report.valid else 1


def _cmd_types(args: argparse.Namespace) -> int:
    from kiln import contracts

    for name, entry in contracts.document_types().items():
        tag = entry.get("type_tag")
        tag_text = f"{tag['field']}={tag['value']}" if tag else "(use --type)"
        print(f"{name:32} {entry['schema_file']:36} {tag_text}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kiln",
        description="Train LoRA adapters for local language models; every result comes with a receipt, "
        "a content-bound manifest and exact-resume checkpoints.",
    )
    parser.add_argument("--version", action="version", version=f"kiln {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser(
        "validate",
        help="strictly validate a Kiln JSON document or checkpoint directory",
        description="Detect the document type from its type tag (or --type), run the strict loader and "
        "report every problem with its code and JSON pointer. A checkpoint directory (or the "
        "checkpoint_manifest.json inside one) gets the full checkpoint load of `kiln checkpoints verify`. "
        "Exit 0 if valid, 1 if not.",
    )
    p.add_argument("file", help="path of the JSON document or checkpoint directory")
    p.add_argument("--type", help="document type (see `kiln types`); required for untagged documents such as requests")
    p.add_argument(
        "--json", action="store_true", help='print {"valid", "type", "errors": [{"code", "pointer", "message"}]}'
    )
    p.set_defaults(func=_cmd_validate)

    p = sub.add_parser("types", help="list the document types `kiln validate` knows")
    p.set_defaults(func=_cmd_types)

    from kiln._cli_adapters import add_adapters_parser
    from kiln._cli_checkpoints import add_checkpoints_parser
    from kiln._cli_evals import add_eval_parser
    from kiln._cli_server import add_health_parser, add_serve_parser
    from kiln._cli_teachers import add_teachers_parser
    from kiln._cli_train import add_models_parser, add_train_parser  # argparse only; torch loads on use

    add_train_parser(sub)
    add_checkpoints_parser(sub)
    add_adapters_parser(sub)
    add_models_parser(sub)
    add_serve_parser(sub)
    add_health_parser(sub)
    add_teachers_parser(sub)
    add_eval_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        code = int(args.func(args))
        sys.stdout.flush()
    except BrokenPipeError:
        # The reader went away (`kiln types | head`): stop quietly with the status SIGPIPE would give, and point
        # stdout at /dev/null so the interpreter's final flush has nowhere to fail.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 128 + 13
    return code


if __name__ == "__main__":
    sys.exit(main())
