"""The HTTP control plane: ``kiln serve`` (FastAPI + uvicorn).

Layers, top to bottom: ``_app`` (routes, error envelope, auth, body bounds) →
``_jobs`` (SQLite job store, FIFO queue, the one training worker) → the trainers;
``_generation`` (completions, adapter load/unload, serving canary) beside it, with
``_openai`` (the OpenAI-compatible request/response translation) over it and ``_batching``
(the scheduler every decoding sequence steps through) under it; ``_serving`` releases the served
copy while a job trains on its device and loads it back after (``training.serving_copy``).
"""

from __future__ import annotations

from typing import Any

__all__ = ["build_server", "create_app", "serve"]


def __getattr__(name: str) -> Any:  # FastAPI and the model load on first use, not on `import kiln`
    if name in __all__:
        from kiln.server import _app

        return getattr(_app, name)
    raise AttributeError(name)
