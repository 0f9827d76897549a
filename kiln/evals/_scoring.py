"""The scorers of ``EvalScorerKind``: one output against one expected answer, 1 or 0.

``exact_match``             identical text
``normalized_exact_match``  equal after ``normalize``
``contains``                ``normalize(expected)`` occurs in ``normalize(output)``
``regex``                   ``re.search(pattern, output)`` finds a match (``expected`` is not used)
``json_field``              the output parses as strict JSON and the value at the dotted ``field``
                            path equals ``expected`` as its canonical JSON text, or, for a string
                            value, as the string itself; a list is indexed by a decimal segment
                            (``items.0.name``); a missing path or an unparsable output scores 0

``normalize``: Unicode NFKC, case folding, whitespace runs collapsed to one space, then
leading whitespace and trailing whitespace and punctuation (Unicode category ``P*``) dropped.
"""

from __future__ import annotations

import re
import unicodedata
from functools import lru_cache
from typing import Any

from kiln.artifacts.evals import scorer_regex
from kiln.documents.jsonio import canonical_json, parse_json
from kiln.errors import ContractError

__all__ = ["normalize", "score"]

_MISSING = object()


def normalize(text: str) -> str:
    """NFKC, casefold, collapse whitespace, trim, drop trailing punctuation."""
    folded = " ".join(unicodedata.normalize("NFKC", text).casefold().split())
    end = len(folded)
    while end and (folded[end - 1].isspace() or unicodedata.category(folded[end - 1]).startswith("P")):
        end -= 1
    return folded[:end]


@lru_cache(maxsize=256)
def _compiled(pattern: str) -> re.Pattern[str]:
    return scorer_regex(pattern)


def _at_path(value: Any, field: str) -> Any:
    for segment in field.split("."):
        if isinstance(value, dict) and segment in value:
            value = value[segment]
        elif isinstance(value, list) and segment.isdecimal() and int(segment) < len(value):
            value = value[int(segment)]
        else:
            return _MISSING
    return value


def _json_field(field: str, output: str, expected: str) -> bool:
    try:
        document = parse_json(output)
    except ContractError:
        return False
    value = _at_path(document, field)
    if value is _MISSING:
        return False
    if isinstance(value, str) and value == expected:
        return True
    return canonical_json(value).decode("utf-8") == expected


def score(scorer: dict[str, Any], output: str, expected: str) -> int:
    """1 when ``scorer`` (an ``EvalScorer``) accepts ``output`` for ``expected``, else 0."""
    kind = scorer["kind"]
    if kind == "exact_match":
        ok = output == expected
    elif kind == "normalized_exact_match":
        ok = normalize(output) == normalize(expected)
    elif kind == "contains":
        ok = normalize(expected) in normalize(output)
    elif kind == "regex":
        ok = _compiled(scorer["pattern"]).search(output) is not None
    elif kind == "json_field":
        ok = _json_field(scorer["field"], output, expected)
    else:
        raise ValueError(f"unknown scorer kind {kind!r} (EvalScorerKind is a closed set)")
    return int(ok)
