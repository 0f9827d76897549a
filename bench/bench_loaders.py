"""Strict-load throughput of a realistic train receipt, adapter manifest and checkpoint manifest.

    python bench/bench_loaders.py [--seconds 2]

Compares, side by side in one process on one core, the validator choices for the schema
layer (pure-Python jsonschema, fastjsonschema's generated code, compiled jsonschema-rs)
and Kiln's whole strict load (strict JSON parse + jsonschema-rs + semantic rules with
recomputed digests + canonical numbers + typed pydantic model). Numbers go to bench/README.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
import warnings
from pathlib import Path

import fastjsonschema
import jsonschema
import jsonschema_rs

from kiln import contracts
from kiln.documents import validation

CASES = Path(__file__).resolve().parent.parent / "conformance" / "cases" / "examples.json"


def rate(fn, seconds: float) -> float:
    fn()
    n, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < seconds:
        for _ in range(20):
            fn()
        n += 20
    return n / elapsed


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=2.0)
    args = parser.parse_args()
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})
    examples = json.loads(CASES.read_text(encoding="utf-8"))
    print(f"python {platform.python_version()}, {platform.machine()}, one core")
    print(f"{'document':16} {'route':44} {'loads/s':>10}")
    for doc_type in ("TrainReceipt", "AdapterManifest", "TrainingCheckpointManifest"):
        instance = next(c["instance"] for c in examples if c["type"] == doc_type)
        raw = json.dumps(instance).encode()
        schema = validation.entry_schema(doc_type, reader=doc_type == "TrainReceipt")
        py = jsonschema.Draft202012Validator(schema, format_checker=jsonschema.FormatChecker())
        rs = jsonschema_rs.validator_for(schema, validate_formats=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            draft7 = {**schema, "$schema": "http://json-schema.org/draft-07/schema#"}
            fast = fastjsonschema.compile(draft7)
        routes = {
            "jsonschema (pure Python), validate only": lambda py=py, i=instance: py.validate(i),
            "fastjsonschema (generated code), validate only": lambda fast=fast, i=instance: fast(i),
            "jsonschema-rs (compiled), validate only": lambda rs=rs, i=instance: rs.validate(i),
            "kiln strict load (bytes -> typed model)": lambda t=doc_type, r=raw: contracts.load(t, r),
        }
        for name, fn in routes.items():
            print(f"{doc_type:16} {name:44} {rate(fn, args.seconds):>10,.0f}")
        print(f"{doc_type:16} {'document size':44} {len(raw):>10,} B")


if __name__ == "__main__":
    main()
