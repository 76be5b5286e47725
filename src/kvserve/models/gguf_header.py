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

A truncated or corrupt file (a download cut short, a copy still being written) is a
ValueError naming the file and both sizes: the bytes its header or its tensor table says it
needs, and the bytes it has (``test_gguf_truncated``), never a ``struct.error`` or a failed
reshape.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import quant_shape_to_byte_shape

LONG_ARRAY = 64  # arrays longer than this are kept as range(length), never decoded
_FIXED_HEADER = 24  # magic, version, tensor count, metadata count

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


class _PastEnd(Exception):
    """The walk needs ``needed`` bytes of a file that has fewer."""

    def __init__(self, needed: int) -> None:
        super().__init__(needed)
        self.needed = needed


def truncated_message(path: Path, what: str, needed: int, size: int) -> str:
    return (
        f"{path} is truncated or corrupt: {what} needs at least {needed:,} bytes, but the file "
        f"has {size:,} ({needed - size:,} missing); download or convert it again"
    )


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
    """Reads forward through ``buf``; any read past its end raises ``_PastEnd``."""

    def __init__(self, buf: memoryview) -> None:
        self.buf = buf
        self.pos = 0

    def need(self, n: int) -> int:
        """The position after ``n`` more bytes, which must exist."""
        end = self.pos + n
        if end > len(self.buf):
            raise _PastEnd(end)
        return end

    def take(self, fmt: str) -> Any:
        end = self.need(struct.calcsize("<" + fmt))
        (value,) = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos = end
        return value

    def take_dims(self, n: int) -> tuple[int, ...]:
        end = self.need(8 * n)
        dims = struct.unpack_from(f"<{n}Q", self.buf, self.pos)
        self.pos = end
        return tuple(int(d) for d in dims)

    def string(self) -> str:
        end = self.need(self.take("Q"))
        s = bytes(self.buf[self.pos : end]).decode("utf-8")
        self.pos = end
        return s

    def skip_string(self) -> None:
        self.pos = self.need(self.take("Q"))

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
                self.pos = self.need(n * struct.calcsize("<" + _SCALAR[etype]))
            else:
                raise UnsupportedHeader(f"metadata array of type {etype}")
            return range(n)
        return [self.value(etype) for _ in range(n)]


def read_gguf_header(path: Path) -> GgufHeader:
    """Metadata and tensor table of ``path``; raises UnsupportedHeader (use GGUFReader) or
    ValueError (not a GGUF file, or truncated or corrupt)."""
    size = Path(path).stat().st_size
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF"[: len(magic)]:  # an empty file is a cut one
        raise ValueError(f"{path} is not a GGUF file (no GGUF magic)")
    if size < _FIXED_HEADER:
        raise ValueError(truncated_message(path, "a GGUF header", _FIXED_HEADER, size))
    mapped = np.memmap(path, mode="r", dtype=np.uint8)
    cur = _Cursor(memoryview(mapped))
    try:
        metadata, table = _walk_header(cur)
    except _PastEnd as e:
        raise ValueError(truncated_message(path, "its header", e.needed, size)) from None
    except UnicodeDecodeError as e:
        raise ValueError(
            f"{path} is corrupt: a metadata key or tensor name at byte {cur.pos:,} is not "
            f"UTF-8 ({e.reason})"
        ) from None
    alignment = int(metadata.get("general.alignment", 32))
    start = (cur.pos + alignment - 1) // alignment * alignment
    entries = _table_entries(path, table)
    data_end = max((start + e.offset + e.nbytes for e in entries), default=0)
    if data_end > size:
        what = f"its tensor data ({len(entries)} tensors from byte {start:,})"
        raise ValueError(truncated_message(path, what, data_end, size))
    tensors = []
    for e in entries:
        np_dims = tuple(reversed(e.dims))
        raw = mapped[start + e.offset : start + e.offset + e.nbytes]
        if e.qtype in _VALUE_DTYPES:
            data = raw.view(np.dtype(_VALUE_DTYPES[e.qtype])).reshape(np_dims)
        else:
            data = raw.reshape(quant_shape_to_byte_shape(np_dims, e.qtype))
        tensors.append(GgufTensor(e.name, e.qtype, e.dims, data))
    return GgufHeader(Path(path), metadata, tensors)


@dataclass(frozen=True, slots=True)
class _TableEntry:
    name: str
    dims: tuple[int, ...]  # innermost first
    qtype: GGMLQuantizationType
    offset: int  # bytes from the start of the tensor data
    nbytes: int


def _table_entries(
    path: Path, table: list[tuple[str, tuple[int, ...], int, int]]
) -> list[_TableEntry]:
    """The walked table as entries with their byte sizes; unknown types and repeated names
    are errors naming the tensor."""
    entries = []
    seen = set()
    for name, dims, raw_type, offset in table:
        if name in seen:
            raise ValueError(f"{path}: duplicated tensor {name!r}")
        seen.add(name)
        try:
            qtype = GGMLQuantizationType(raw_type)
        except ValueError:
            raise ValueError(
                f"{path} is corrupt: tensor {name!r} has ggml type {raw_type}, which gguf "
                "does not know"
            ) from None
        n_elems = math.prod(dims)  # exact: corrupt dims must not wrap around
        if qtype in _VALUE_DTYPES:
            nbytes = n_elems * np.dtype(_VALUE_DTYPES[qtype]).itemsize
        else:
            block, type_size = GGML_QUANT_SIZES[qtype]
            nbytes = n_elems * type_size // block
        entries.append(_TableEntry(name, dims, qtype, offset, nbytes))
    return entries


def _walk_header(
    cur: _Cursor,
) -> tuple[dict[str, Any], list[tuple[str, tuple[int, ...], int, int]]]:
    """Metadata and the tensor table (name, dims, ggml type, data offset), the cursor left
    at the table's end."""
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
        dims = cur.take_dims(cur.take("I"))
        table.append((name, dims, cur.take("I"), cur.take("Q")))
    return metadata, table
