"""The contract layer: what makes a JSON document a Kiln document, below every artifact.

``jsonio``       strict JSON in (bounded, UTF-8, no duplicate keys, no NaN), canonical JSON out
``digests``      every digest of the contract, defined once
``validation``   the bundled schemas compiled with jsonschema-rs; errors -> (code, pointer, message)
``numbers``      the canonical form of a number at its schema position (``3.0`` is the integer ``3``)
``rules``        the registry of semantic rules by schema definition
``pipeline``     load = parse -> schema -> canonical numbers -> rules -> generated model; write = the reverse, atomic
``epoch_order``  the portable SplitMix64 Fisher-Yates epoch order a checkpoint pins
``batch_plan``   the SFT batch plan (rows per step, steps per epoch, length-grouped windows) a checkpoint pins

Layered inside (``pyproject.toml``): ``pipeline`` over ``validation | numbers | rules`` over the rest. Its public
entry for everyone else is ``kiln.contracts``; the artifact modules (``kiln.artifacts``) register their rules here.
"""

from __future__ import annotations

__all__ = ["batch_plan", "digests", "epoch_order", "jsonio", "numbers", "pipeline", "rules", "validation"]
