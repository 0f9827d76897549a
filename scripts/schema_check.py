"""Developer check for hand-written schemas (no project imports needed).

    python scripts/schema_check.py [--upstream DIR]

* every file in schemas/ is a valid Draft 2020-12 schema that keeps to the allowed
  keyword subset (see docs/schemas.md);
* every `$ref` resolves (local and cross-file);
* every instance under `x-kiln-examples` validates against its definition;
* for definitions that also exist in the upstream contracts (when DIR exists), our
  examples validate against the upstream definition and upstream examples validate
  against ours.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import jsonschema
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from codegen._bundle import FORBIDDEN_KEYWORDS  # noqa: E402 - after the path setup

FORBIDDEN = FORBIDDEN_KEYWORDS
COMPAT = [
    "AdapterManifest",
    "AdapterManifestFiles",
    "BaseWeightShardManifest",
    "ExecutionProvenanceV1",
    "TrainingCheckpointPrecision",
    "SftRequest",
    "SftConfig",
    "GrpoRequest",
    "GrpoConfig",
    "OpdRequest",
    "OpdConfig",
    "TrainingResponse",
    "TrainingStatus",
    "TrainingJobDetail",
    "TrainingCheckpointSummary",
    "QueueResponse",
    "CancelTrainingJobResponse",
    "AdaptersResponse",
    "AdapterDiskEntry",
    "LoadAdapterRequest",
    "LoadAdapterResponse",
    "UnloadAdapterResponse",
    "DeleteAdapterResponse",
    "RegisterTeacherRequest",
    "TeacherEntry",
    "TeacherIdentityV1",
]


def walk(node, path, problems, file):
    if isinstance(node, dict):
        for key, value in node.items():
            if key in FORBIDDEN:
                problems.append(f"{file}: {path}/{key}: keyword outside the allowed subset")
            if key == "pattern" and isinstance(value, str) and ("(?=" in value or "(?!" in value or "(?<" in value):
                problems.append(f"{file}: {path}: look-around in pattern")
            walk(value, f"{path}/{key}", problems, file)
    elif isinstance(node, list):
        for i, value in enumerate(node):
            walk(value, f"{path}/{i}", problems, file)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--upstream", default=str(ROOT.parent / "shared" / "upstream" / "contracts"))
    args = ap.parse_args()
    problems: list[str] = []
    docs = {}
    for path in sorted((ROOT / "schemas").glob("*.schema.json")):
        doc = json.loads(path.read_text())
        docs[path.name] = doc
        jsonschema.Draft202012Validator.check_schema(doc)
        walk(doc, "", problems, path.name)
    registry = Registry().with_resources(
        (doc["$id"], Resource.from_contents(doc, default_specification=DRAFT202012)) for doc in docs.values()
    )
    ours: dict[str, tuple[str, dict]] = {}
    for name, doc in docs.items():
        for defname in doc.get("$defs", {}):
            ours.setdefault(defname, (name, doc))
    upstream_dir = Path(args.upstream)
    up_docs = {}
    if upstream_dir.is_dir():
        for p in upstream_dir.glob("*.schema.json"):
            d = json.loads(p.read_text())
            up_docs[p.name] = d
        up_registry = Registry().with_resources(
            (d["$id"], Resource.from_contents(d, default_specification=DRAFT202012)) for d in up_docs.values()
        )

    def validator_for(doc, defname, reg):
        schema = {
            "$schema": doc["$schema"],
            "$id": doc["$id"] + "#entry-" + defname,
            "$ref": f"{doc['$id']}#/$defs/{defname}",
        }
        return jsonschema.Draft202012Validator(
            schema, registry=reg, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER
        )

    checked = 0
    for name, doc in docs.items():
        for defname in doc.get("x-kiln-entrypoints", []):
            if defname not in doc.get("$defs", {}):
                problems.append(f"{name}: entry point {defname} has no definition")
            elif not doc.get("x-kiln-examples", {}).get(defname):
                problems.append(f"{name}: entry point {defname} has no example")
        for defname, examples in doc.get("x-kiln-examples", {}).items():
            if defname not in doc.get("$defs", {}):
                problems.append(f"{name}: examples for unknown definition {defname}")
                continue
            try:
                v = validator_for(doc, defname, registry)
            except Exception as exc:  # noqa: BLE001 - developer script
                problems.append(f"{name}: {defname}: cannot build validator: {exc}")
                continue
            for i, ex in enumerate(examples):
                checked += 1
                for err in v.iter_errors(ex):
                    problems.append(f"{name}: example {defname}[{i}] invalid at {err.json_path}: {err.message[:200]}")
                if up_docs and defname in COMPAT:
                    for up_name, up_doc in up_docs.items():
                        if defname in up_doc.get("$defs", {}):
                            uv = validator_for(up_doc, defname, up_registry)
                            for err in uv.iter_errors(ex):
                                problems.append(
                                    f"{name}: example {defname}[{i}] fails UPSTREAM {up_name} at {err.json_path}: {err.message[:200]}"
                                )
                            break
    if up_docs:
        for defname in COMPAT:
            if defname not in ours:
                problems.append(f"compat object {defname} is not defined in schemas/ yet")
                continue
            name, doc = ours[defname]
            v = validator_for(doc, defname, registry)
            for up_name, up_doc in up_docs.items():
                for i, ex in enumerate(up_doc.get("x-kiln-examples", {}).get(defname, [])):
                    checked += 1
                    for err in v.iter_errors(ex):
                        problems.append(
                            f"upstream example {up_name}:{defname}[{i}] fails OURS at {err.json_path}: {err.message[:200]}"
                        )
    for p in problems:
        print(p)
    print(f"{len(docs)} schema files, {checked} example checks, {len(problems)} problems")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
