"""Kiln: train LoRA adapters for local language models and make every result provable.

Architecture map (data flows one way; lower layers never import higher ones)::

    schemas/*.schema.json          the source of truth (hand-written JSON Schemas)
        │  python -m codegen
        ▼
    kiln_contracts (generated/)    pydantic models, bundled validator schemas, OpenAPI
        │
        ▼
    kiln.errors, kiln.host.fs      one exception tree with stable codes; crash-atomic writes
    kiln.documents                 the contract layer: strict and canonical JSON (jsonio), every digest
                                   (digests), schema validation (validation), canonical numbers by schema
                                   position (numbers), semantic rules (rules), load/write (pipeline)
        │
        ▼
    kiln.artifacts.*               one module per artifact: load_* (strict), write_* (atomic), verify_*
        │
        ▼
    kiln.cli                       the `kiln` command (no torch on the path of validate/--help)

Between the artifacts and the CLI sit the checkpoint engine, the configuration
(``kiln.host.config``), the kernels (the loss routes, the invariant operations), the model and data layers
(the invariant forward, the one batched decoder, the portable draws), the adapter lifecycle,
the shared training components, the rollouts Kiln samples and scores itself (``kiln.rollouts``), the trainers, the job runner (``kiln.jobs.worker``) and the
HTTP server (``kiln.server``); ARCHITECTURE.md draws the full stack. The generated models are
what travels between them: requests, configs, settings and worker specs, never raw dicts.
"""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["__version__"]
