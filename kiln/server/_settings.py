"""The server's configuration: ``kiln.config`` resolves it once at startup (flags > environment > ``kiln.toml`` >
the schema's defaults) and ``Settings.response()`` is the body of ``GET /v1/config``; the server reads it from here.
"""

from __future__ import annotations

from kiln.config import REDACTED, Settings, resolve_settings

__all__ = ["REDACTED", "Settings", "resolve_settings"]
