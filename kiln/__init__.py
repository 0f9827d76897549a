"""Kiln: train LoRA adapters for local language models and make every result provable.

Architecture map (data flows one way; lower layers never import higher ones)::

    schemas/*.schema.json          the source of truth (hand-written JSON Schemas)
        │  python -m codegen
        ▼
    kiln_contracts (generated/)    pydantic models, bundled validator schemas, OpenAPI
        │
        ▼
    kiln._jsonio                   strict JSON parsing, canonical JSON, atomic writes
    kiln.digests                   every digest of the contract, defined once
    kiln.errors                    one exception tree with stable codes
    kiln._contract, kiln._documents  schema validation (jsonschema-rs) + semantic rules + models
    kiln._numbers                  canonical numbers by schema position (3.0 at an integer position is 3)
        │
        ▼
    kiln.artifacts.*               one module per artifact: load_* (strict), write_* (atomic), verify_*
        │
        ▼
    kiln.cli                       the `kiln` command (no torch on the path of validate/--help)

Between the artifacts and the CLI sit the checkpoint engine, the model and data layers,
the loss kernels, the shared training components, the trainers, the adapter lifecycle and
the HTTP server (``kiln.server``); ARCHITECTURE.md draws the full stack.
"""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["__version__"]
