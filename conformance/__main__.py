"""``python -m conformance PATH [--json]``: validate every Kiln JSON document under PATH.

Each ``*.json`` file is typed by its type tag (files without a known tag are listed as
skipped) and run through Kiln's strict loader. Exit status 1 if any document is invalid.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from kiln import contracts
from kiln.documents.jsonio import read_json_file
from kiln.errors import KilnError


def scan(root: Path) -> list[dict]:
    files = [root] if root.is_file() else sorted(p for p in root.rglob("*.json") if p.is_file())
    results = []
    for path in files:
        try:
            value = read_json_file(path)
            doc_type = contracts.detect_type(value)
        except KilnError as exc:
            if exc.code == "unknown_document_type":
                results.append({"path": str(path), "status": "skipped", "type": None, "errors": []})
            else:
                results.append(
                    {
                        "path": str(path),
                        "status": "invalid",
                        "type": None,
                        "errors": [p.as_dict() for p in exc.problems],
                    }
                )
            continue
        problems = contracts.problems(doc_type, value)
        results.append(
            {
                "path": str(path),
                "status": "invalid" if problems else "valid",
                "type": doc_type,
                "errors": [p.as_dict() for p in problems],
            }
        )
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m conformance", description=__doc__.splitlines()[0])
    parser.add_argument("path", type=Path)
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    args = parser.parse_args(argv)
    if not args.path.exists():
        print(f"conformance: {args.path} does not exist", file=sys.stderr)
        return 2
    results = scan(args.path)
    counts = {s: sum(1 for r in results if r["status"] == s) for s in ("valid", "invalid", "skipped")}
    if args.json:
        print(json.dumps({"results": results, "counts": counts}, indent=2))
    else:
        for r in results:
            mark = {"valid": "ok  ", "invalid": "FAIL", "skipped": "skip"}[r["status"]]
            print(f"{mark} {r['path']}" + (f" ({r['type']})" if r["type"] else ""))
            for e in r["errors"]:
                print(f"       {e['code']} at {e['pointer'] or '/'}: {e['message']}")
        print(f"{counts['valid']} valid, {counts['invalid']} invalid, {counts['skipped']} skipped")
    return 1 if counts["invalid"] else 0


if __name__ == "__main__":
    sys.exit(main())
