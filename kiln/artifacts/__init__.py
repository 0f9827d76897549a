"""One module per artifact: strict ``load_*``, canonical atomic ``write_*``, ``verify_*``.

Importing this package registers every semantic rule of the schemas.
"""

from __future__ import annotations

from kiln.artifacts import base_weights, provenance, server_bodies, sft_ingestion

__all__ = ["base_weights", "provenance", "server_bodies", "sft_ingestion"]
