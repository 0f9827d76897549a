"""``kiln validate`` (the strict loader on one document or checkpoint directory) and ``kiln types``.

This is the path that must stay light: argparse and the standard library at import time, ``kiln.contracts``
(jsonschema-rs, the bundled schemas) when the command runs, never torch.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any


def add_validate_parsers(sub: Any) -> None:
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
    p.set_defaults(func=cmd_validate)

    p = sub.add_parser("types", help="list the document types `kiln validate` knows")
    p.set_defaults(func=cmd_types)


def cmd_validate(args: argparse.Namespace) -> int:
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


def cmd_types(args: argparse.Namespace) -> int:
    from kiln import contracts

    for name, entry in contracts.document_types().items():
        tag = entry.get("type_tag")
        tag_text = f"{tag['field']}={tag['value']}" if tag else "(use --type)"
        print(f"{name:32} {entry['schema_file']:36} {tag_text}")
    return 0
