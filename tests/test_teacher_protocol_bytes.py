"""The teacher protocol's answers are pinned byte for byte (tests/golden/teacher_protocol.json).

``POST /v1/completions`` also serves OpenAI-style generation; the exact request a ``remote``
teacher scorer sends (``{model, prompt: [ids], max_tokens: 1, prompt_logprobs: k}``) must keep
its answer unchanged. The golden holds the raw response bytes captured from the server; the
test compares them after replacing only the two values that change per call (``id`` and
``created``) with fixed placeholders. Floats are compared by their JSON spelling too, except
that a last-bit difference (another CPU's kernels) is tolerated at 1e-6 relative.

Regenerate only for a deliberate protocol change (and call it out):
``KILN_UPDATE_GOLDEN=1 python -m pytest tests/test_teacher_protocol_bytes.py``.
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path

import pytest

GOLDEN_PATH = Path(__file__).parent / "golden" / "teacher_protocol.json"
REQUESTS = [
    {"model": "kiln-tiny", "prompt": [1, 52, 3, 90, 91, 92], "max_tokens": 1, "prompt_logprobs": 3},
    {"model": "kiln-tiny", "prompt": [7, 8, 9, 10], "max_tokens": 1, "prompt_logprobs": 0},
    {"model": "kiln-tiny", "prompt": [5, 6, 7], "max_tokens": 0, "prompt_logprobs": 2},
]
_VOLATILE = (
    (re.compile(rb'"id":"cmpl-[0-9a-f]{24}"'), b'"id":"cmpl-ID"'),
    (re.compile(rb'"created":[0-9]+'), b'"created":0'),
)
_NUMBER = re.compile(rb"-?[0-9]+(?:\.[0-9]+)?(?:[eE][-+]?[0-9]+)?")


@pytest.fixture(scope="module")
def http(tmp_path_factory, tiny_model_dir):
    from fastapi.testclient import TestClient

    from kiln.host.config import resolve_settings
    from kiln.server._app import build_server, create_app

    home = tmp_path_factory.mktemp("serve") / "home"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KILN_HOME", str(home))
        settings = resolve_settings({"paths.home": str(home), "model.path": str(tiny_model_dir)})
        settings.registry.mkdir(parents=True)
        with TestClient(create_app(build_server(settings))) as client:
            yield client


def _normalised(raw: bytes) -> bytes:
    for pattern, replacement in _VOLATILE:
        raw, count = pattern.subn(replacement, raw)
        assert count == 1, raw[:200]
    return raw


def _same_bytes(got: bytes, want: bytes) -> None:
    if got == want:
        return
    skeleton = lambda raw: _NUMBER.sub(b"N", raw)  # noqa: E731
    assert skeleton(got) == skeleton(want)  # every key, string, separator and null in place
    for a, b in zip(_NUMBER.findall(got), _NUMBER.findall(want), strict=True):
        if a != b:
            assert b"." in a, (a, b)  # integers (ids, ranks, counts) are exact
            assert math.isclose(float(a), float(b), rel_tol=1e-6), (a, b)


def test_teacher_scoring_requests_answer_the_pinned_bytes(http):
    answers = []
    for body in REQUESTS:
        answer = http.post("/v1/completions", json=body)
        assert answer.status_code == 200, answer.text
        assert answer.headers["content-type"] == "application/json"
        answers.append(_normalised(answer.content).decode("utf-8"))
    if os.environ.get("KILN_UPDATE_GOLDEN") == "1":
        doc = {"requests": REQUESTS, "responses": answers}
        GOLDEN_PATH.write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
    golden = json.loads(GOLDEN_PATH.read_text(encoding="utf-8"))
    assert golden["requests"] == REQUESTS
    for got, want in zip(answers, golden["responses"], strict=True):
        _same_bytes(got.encode("utf-8"), want.encode("utf-8"))
