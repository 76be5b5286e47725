"""Reading a GGUF file (llama.cpp's format) through the ``gguf`` package.

Tensors are renamed from llama.cpp names (``blk.3.attn_q.weight``) to Hugging Face names
(``model.layers.3.self_attn.q_proj.weight``) and dequantized to float32 with
``gguf.quants.dequantize`` -- except 2-D weights in a format kvserve multiplies in place
(``KEEP_QUANTIZED``), which stay in their block format as a ``QuantizedTensor``, and Q3_K /
Q5_0 ones, held losslessly as Q6_K / Q8_0 (``gguf_transcode.py``). llama.cpp's converter
permutes the rows of the Llama query and key projections for its interleaved rotary layout; we
undo that so the weights match HF's rotate-half layout.
"""

from __future__ import annotations

import logging
import re
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize

from kvserve.models.config import ModelConfig
from kvserve.models.gguf_header import GgufHeader, GgufTensor, UnsupportedHeader, read_gguf_header
from kvserve.models.gguf_transcode import TRANSCODED, transcode

log = logging.getLogger(__name__)

SUPPORTED_GGML_TYPES = (
    GGMLQuantizationType.F32,
    GGMLQuantizationType.F16,
    GGMLQuantizationType.BF16,
    GGMLQuantizationType.Q8_0,
    GGMLQuantizationType.Q4_0,
    GGMLQuantizationType.Q4_1,
    GGMLQuantizationType.Q5_0,
    GGMLQuantizationType.Q5_1,
    GGMLQuantizationType.Q2_K,
    GGMLQuantizationType.Q3_K,
    GGMLQuantizationType.Q4_K,
    GGMLQuantizationType.Q5_K,
    GGMLQuantizationType.Q6_K,
)

# Formats whose 2-D weights stay quantized in memory (kvserve.kernels multiplies them in place).
KEEP_QUANTIZED = (
    GGMLQuantizationType.Q8_0,
    GGMLQuantizationType.Q4_0,
    GGMLQuantizationType.Q4_1,
    GGMLQuantizationType.Q4_K,
    GGMLQuantizationType.Q5_K,
    GGMLQuantizationType.Q6_K,
)
# Formats held in a KEEP_QUANTIZED one they are a subset of, losslessly (gguf_transcode.py).
HELD_QUANTIZED = KEEP_QUANTIZED + tuple(TRANSCODED)


@dataclass(slots=True)
class QuantizedTensor:
    """A 2-D weight in a GGUF block format: ``data`` is uint8 (rows, bytes per row)."""

    data: torch.Tensor
    qtype: int  # GGMLQuantizationType value
    shape: tuple[int, int]  # (rows, cols) of the dequantized weight: (out, in) features

    @property
    def nbytes(self) -> int:
        return self.data.nbytes


# llama.cpp tensor name -> HF name. {i} is the layer index.
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_output.bias": "self_attn.o_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.(.+)$")
ROPE_FREQS = "rope_freqs.weight"  # Llama 3.1 rope scaling factors; not a model parameter


def gguf_to_hf_name(name: str) -> str:
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    m = _LAYER_RE.match(name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}"
    raise ValueError(f"unexpected GGUF tensor {name!r}: no Hugging Face name is known for it")


def read_gguf_metadata(reader: GGUFReader) -> dict[str, Any]:
    """Scalar and string fields as Python values; long arrays (the vocabulary) as their length."""
    meta: dict[str, Any] = {}
    for key, f in reader.fields.items():
        if len(f.types) > 1 and len(f.data) > 64:  # an array: store how long it is
            meta[key] = range(len(f.data))
        else:
            meta[key] = f.contents()
    return meta


def open_gguf(path: Path) -> GgufHeader:
    """Metadata and tensors of a GGUF file: the fast header walk (gguf_header.py), or
    GGUFReader for the files it does not read."""
    try:
        return read_gguf_header(path)
    except UnsupportedHeader:
        pass
    try:
        reader = GGUFReader(path)
    except (ValueError, IndexError, KeyError, OverflowError, struct.error) as e:
        # a cut file fails inside GGUFReader as a short array that cannot be reshaped
        size = Path(path).stat().st_size
        raise ValueError(
            f"{path} is truncated or corrupt ({size:,} bytes): gguf's reader failed on it: {e}"
        ) from e
    tensors = [
        GgufTensor(t.name, GGMLQuantizationType(t.tensor_type), tuple(map(int, t.shape)), t.data)
        for t in reader.tensors
    ]
    return GgufHeader(Path(path), read_gguf_metadata(reader), tensors)


def read_gguf_config(path: Path) -> tuple[ModelConfig, GgufHeader]:
    gguf = open_gguf(path)
    names = {t.name for t in gguf.tensors}
    meta = gguf.metadata
    if meta.get("general.architecture") == "deepseek2":  # models/deepseek_gguf.py
        from kvserve.models.deepseek_gguf import deepseek_config_from_gguf

        return deepseek_config_from_gguf(meta, names), gguf
    return ModelConfig.from_gguf(meta, names), gguf


def unpermute_rotary_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Inverse of llama.cpp convert_hf_to_gguf's ``permute`` of q/k projection rows.

    Per head, llama.cpp reorders rows [x0..x(d/2-1), y0..y(d/2-1)] (HF's halves) into the
    interleaved pairs [x0, y0, x1, y1, ...]; this restores the halves.
    """
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def dequantize_tensor(name: str, data: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    if qtype not in SUPPORTED_GGML_TYPES:
        supported = ", ".join(t.name for t in SUPPORTED_GGML_TYPES)
        raise ValueError(
            f"GGUF tensor {name!r} has unsupported quant type {qtype.name}; supported: {supported}"
        )
    return np.asarray(dequantize(data, qtype), dtype=np.float32)


def iter_gguf_tensors(
    reader: GgufHeader, config: ModelConfig, keep_quantized: bool = True
) -> Iterator[tuple[str, torch.Tensor | QuantizedTensor]]:
    """Yields (HF name, tensor) per tensor; ``rope_freqs.weight`` keeps its GGUF name.

    With ``keep_quantized``, 2-D weights in a ``KEEP_QUANTIZED`` format come as a
    ``QuantizedTensor`` (their bytes, copied out of the memory map); the rest as float32.
    """
    arch = reader.metadata["general.architecture"]
    if arch == "deepseek2":  # stacked experts, split kv_b: models/deepseek_gguf.py
        from kvserve.models.deepseek_gguf import iter_deepseek_gguf_tensors

        yield from iter_deepseek_gguf_tensors(
            reader, config, keep_quantized, QuantizedTensor, dequantize_tensor
        )
        return
    unpermute = arch == "llama"
    transcoded: dict[str, str] = {}
    for t in reader.tensors:
        qtype = GGMLQuantizationType(t.tensor_type)
        # GGUF lists dims innermost first: (rows, cols) = reversed
        shape = [int(d) for d in reversed(t.shape)]
        hf_name = ROPE_FREQS if t.name == ROPE_FREQS else gguf_to_hf_name(t.name)
        quantized = keep_quantized and qtype in HELD_QUANTIZED and len(shape) == 2
        if quantized:
            w = np.asarray(t.data)  # (rows, bytes per row) uint8: row permutes stay valid
            if qtype in TRANSCODED:
                w, qtype = transcode(w, qtype)
                transcoded[t.name] = GGMLQuantizationType(qtype).name
        else:
            w = dequantize_tensor(t.name, t.data, qtype).reshape(shape)
        if t.name == ROPE_FREQS:
            yield ROPE_FREQS, torch.from_numpy(np.array(w, copy=True))
            continue
        if unpermute and hf_name.endswith("q_proj.weight"):
            w = unpermute_rotary_rows(w, config.num_attention_heads)
        elif unpermute and hf_name.endswith("k_proj.weight"):
            w = unpermute_rotary_rows(w, config.num_key_value_heads)
        # the data are read-only views of the memory-mapped file: copy before torch owns them
        if quantized:
            data = torch.from_numpy(np.array(w, dtype=np.uint8, order="C", copy=True))
            yield hf_name, QuantizedTensor(data, int(qtype), (shape[0], shape[1]))
        else:
            yield hf_name, torch.from_numpy(np.array(w, dtype=np.float32, order="C", copy=True))
    if transcoded:
        held = sorted(set(transcoded.values()))
        log.info(
            "%d weights in Q3_K / Q5_0 are held as %s (lossless: the same values, more bytes; "
            "those formats have no kernel of their own)",
            len(transcoded),
            " / ".join(held),
        )


def find_gguf_file(path: Path) -> Path | None:
    """The GGUF file a path names: the file itself, or the single *.gguf in a directory."""
    if path.is_file() and path.suffix == ".gguf":
        return path
    if path.is_dir() and not (path / "config.json").exists():
        files = sorted(path.glob("*.gguf"))
        if len(files) == 1:
            return files[0]
        if len(files) > 1:
            raise ValueError(
                f"{path} holds several GGUF files; name one: {[f.name for f in files]}"
            )
    return None
