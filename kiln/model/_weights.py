"""What a model directory's weights are, read from the safetensors headers alone (no tensor byte is read).

A safetensors file starts with an 8-byte little-endian header length and a JSON header naming every tensor's dtype
and shape. That is enough to know, before loading anything, how many parameters a model has, in which dtype its
checkpoint stores them (``precision: auto`` keeps it) and the shape of every projection LoRA would adapt (the memory
planner's input).
"""

from __future__ import annotations

import json
import math
import struct
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from kiln.errors import RequestError

__all__ = ["WeightsInfo", "read_weights_info"]

MAX_HEADER_BYTES = 100 * 2**20  # the safetensors format's own bound on a header
# safetensors dtype names -> Kiln's short dtype names (the receipt's) and bytes per element
_DTYPES = {
    "F64": ("f64", 8),
    "F32": ("f32", 4),
    "BF16": ("bf16", 2),
    "F16": ("f16", 2),
    "F8_E4M3": ("f8", 1),
    "F8_E5M2": ("f8", 1),
    "I64": ("i64", 8),
    "I32": ("i32", 4),
    "I16": ("i16", 2),
    "I8": ("i8", 1),
    "U8": ("u8", 1),
    "BOOL": ("bool", 1),
}
_FLOATS = ("f64", "f32", "bf16", "f16", "f8")
_WIDTHS = dict(_DTYPES.values())


@dataclass(frozen=True)
class WeightsInfo:
    """Every stored tensor's short dtype name and shape, by tensor name."""

    dtypes: dict[str, str]
    shapes: dict[str, tuple[int, ...]]

    def numel(self, name: str) -> int:
        return math.prod(self.shapes[name])

    @property
    def parameters(self) -> int:
        return sum(self.numel(name) for name in self.shapes)

    @property
    def stored_bytes(self) -> int:
        """The tensors' bytes in the files."""
        return sum(self.numel(name) * _WIDTHS[dtype] for name, dtype in self.dtypes.items())

    @property
    def stored_dtype(self) -> str:
        """The floating-point dtype holding most of the parameters (``f32``, ``bf16``, ``f16``...)."""
        counts: Counter[str] = Counter()
        for name, dtype in self.dtypes.items():
            if dtype in _FLOATS:
                counts[dtype] += self.numel(name)
        return counts.most_common(1)[0][0] if counts else "f32"


def _header(path: Path) -> dict[str, object]:
    with path.open("rb") as handle:
        head = handle.read(8)
        if len(head) != 8:
            raise ValueError("shorter than a safetensors header")
        (size,) = struct.unpack("<Q", head)
        if size > MAX_HEADER_BYTES:
            raise ValueError(f"declares a {size}-byte header")
        header = json.loads(handle.read(size))
    if not isinstance(header, dict):
        raise ValueError("its header is not a JSON object")
    return header


def read_weights_info(model_dir: Path) -> WeightsInfo:
    """The dtypes and shapes of every tensor in the ``*.safetensors`` files of ``model_dir``."""
    dtypes: dict[str, str] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        try:
            header = _header(path)
            for name, entry in header.items():
                if name == "__metadata__":
                    continue
                if not isinstance(entry, dict) or entry.get("dtype") not in _DTYPES:
                    raise ValueError(f"tensor {name!r} has no known dtype")
                dtypes[name] = _DTYPES[str(entry["dtype"])][0]
                shapes[name] = tuple(int(d) for d in entry["shape"])
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise RequestError(
                f"weight file {path} is not a readable safetensors file: {exc}",
                code="training_invalid_request",
                hint="restore the model's weight files from a complete copy",
            ) from None
    return WeightsInfo(dtypes=dtypes, shapes=shapes)
