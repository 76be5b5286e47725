"""A GGUF file's metadata and tensor table, read in milliseconds.

Why not ``gguf.GGUFReader`` alone: it builds a numpy view for every part of every metadata
value, and the default model's vocabulary and merges are ~98k strings: 5.4 s of every start
(measured), to learn a dozen numbers and where the tensors lie. Here the header is walked with
``struct`` and long arrays are skipped over (kept as their length, as ``read_gguf_metadata``
always reported them). Tensor data are the same memory-mapped views GGUFReader hands out
(same dtype and shape rules, from gguf's own tables), untouched until a loader copies them.

Anything this walker does not read (a big-endian file, GGUF v1, nested arrays) raises
``UnsupportedHeader``, and the caller falls back to GGUFReader. ``test_gguf_header`` holds the
two equal on the default model and on the test files.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import quant_shape_to_byte_shape

LONG_ARRAY = 64  # arrays longer than this are kept as range(length), never decoded

# metadata value types (GGUF spec): fixed-width ones by struct format
_SCALAR = {
    0: "B",
    1: "b",
    2: "H",
    3: "h",
    4: "I",
    5: "i",
    6: "f",
    7: "?",
    10: "Q",
    11: "q",
    12: "d",
}
_STRING, _ARRAY = 8, 9
# ggml types GGUFReader exposes as typed values; every other type as uint8 blocks
_VALUE_DTYPES = {
    GGMLQuantizationType.F16: np.float16,
    GGMLQuantizationType.F32: np.float32,
    GGMLQuantizationType.F64: np.float64,
    GGMLQuantizationType.I8: np.int8,
    GGMLQuantizationType.I16: np.int16,
    GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}


class UnsupportedHeader(ValueError):
    """A valid GGUF this walker does not read; GGUFReader does."""


@dataclass(frozen=True, slots=True)
class GgufTensor:
    """One tensor as GGUFReader describes it: ``shape`` innermost dimension first (GGUF's
    order), ``data`` a read-only view of the mapped file."""

    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]
    data: np.ndarray


@dataclass(frozen=True, slots=True)
class GgufHeader:
    path: Path
    metadata: dict[str, Any]  # scalars and short arrays as values, long arrays as range(n)
    tensors: list[GgufTensor]


class _Cursor:
    def __init__(self, buf: memoryview) -> None:
        self.buf = buf
        self.pos = 0

    def take(self, fmt: str) -> Any:
        (value,) = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += struct.calcsize("<" + fmt)
        return value

    def string(self) -> str:
        n = self.take("Q")
        s = bytes(self.buf[self.pos : self.pos + n]).decode("utf-8")
        self.pos += n
        return s

    def skip_string(self) -> None:
        self.pos += 8 + self.take("Q")

    def value(self, vtype: int) -> Any:
        if vtype in _SCALAR:
            return self.take(_SCALAR[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype != _ARRAY:
            raise UnsupportedHeader(f"metadata value type {vtype}")
        etype, n = self.take("I"), self.take("Q")
        if etype == _ARRAY:
            raise UnsupportedHeader("nested metadata arrays")
        if n > LONG_ARRAY:
            if etype == _STRING:
                for _ in range(n):
                    self.skip_string()
            elif etype in _SCALAR:
                self.pos += n * struct.calcsize("<" + _SCALAR[etype])
            else:
                raise UnsupportedHeader(f"metadata array of type {etype}")
            return range(n)
        return [self.value(etype) for _ in range(n)]


def read_gguf_header(path: Path) -> GgufHeader:
    """Metadata and tensor table of ``path``; raises UnsupportedHeader (use GGUFReader) or
    ValueError (not a GGUF file)."""
    mapped = np.memmap(path, mode="r", dtype=np.uint8)
    cur = _Cursor(memoryview(mapped))
    if bytes(mapped[:4]) != b"GGUF":
        raise ValueError(f"{path} is not a GGUF file (no GGUF magic)")
    version = cur.take("4x I")
    if version not in (2, 3):  # v1 counts in 32 bits; a byte-swapped version: big-endian
        raise UnsupportedHeader(f"GGUF version field {version}")
    n_tensors, n_kv = cur.take("Q"), cur.take("Q")
    # GGUFReader's pseudo-fields first, as it lists them
    metadata: dict[str, Any] = {"GGUF.version": version, "GGUF.tensor_count": n_tensors}
    metadata["GGUF.kv_count"] = n_kv
    for _ in range(n_kv):
        key = cur.string()
        metadata[key] = cur.value(cur.take("I"))
    table = []
    for _ in range(n_tensors):
        name = cur.string()
        n_dims = cur.take("I")
        dims = struct.unpack_from(f"<{n_dims}Q", cur.buf, cur.pos)
        cur.pos += 8 * n_dims
        table.append((name, tuple(int(d) for d in dims), cur.take("I"), cur.take("Q")))
    alignment = int(metadata.get("general.alignment", 32))
    start = (cur.pos + alignment - 1) // alignment * alignment
    tensors = []
    seen = set()
    for name, dims, raw_type, offset in table:
        if name in seen:
            raise ValueError(f"{path}: duplicated tensor {name!r}")
        seen.add(name)
        qtype = GGMLQuantizationType(raw_type)
        n_elems = int(np.prod(dims, dtype=np.int64))
        np_dims = tuple(reversed(dims))
        block, type_size = GGML_QUANT_SIZES[qtype]
        lo = start + offset
        if qtype in _VALUE_DTYPES:
            dtype = np.dtype(_VALUE_DTYPES[qtype])
            data = mapped[lo : lo + n_elems * dtype.itemsize].view(dtype).reshape(np_dims)
        else:
            n_bytes = n_elems * type_size // block
            shape = quant_shape_to_byte_shape(np_dims, qtype)
            data = mapped[lo : lo + n_bytes].reshape(shape)
        tensors.append(GgufTensor(name, qtype, dims, data))
    return GgufHeader(Path(path), metadata, tensors)
