"""Random-weight GGUFs of real model shapes, for speed at the sizes people run (issue "Decode at
memory speed"): an F16 file written with gguf-py, then quantized by llama.cpp's own quantizer
(``llama_model_quantize`` through llama-cpp-python, in the peer's venv) to the types GGUF users
download. Random weights: the speed is real, the text is not.

    python -m benchmarks.synthetic_model [--shape tinyllama-1.1b] [--types Q4_0,Q4_K_M]
        [--out .bench-models] [--llama-python .peers/llama/bin/python]

Prints one path per file; files already there are kept. The tokenizer (vocabulary, merges,
chat template) is the default model's, copied from its GGUF, so both engines tokenize alike.
Then, e.g.: ``python -m benchmarks.decode --model PATH --skip-hf --skip-no-cache``.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter

from benchmarks.common import default_peer_python
from kvserve.default_model import default_model_path


@dataclass(frozen=True)
class Shape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    rope_theta: float
    tied: bool


SHAPES = {
    "tinyllama-1.1b": Shape(2048, 22, 32, 4, 5632, 10000.0, tied=False),
    "llama3.2-3b": Shape(3072, 28, 24, 8, 8192, 500000.0, tied=True),
    "llama3.1-8b": Shape(4096, 32, 32, 8, 14336, 500000.0, tied=False),
}
# llama.cpp's LLAMA_FTYPE_MOSTLY_* values (include/llama.h)
FTYPES = {
    "Q4_0": 2,
    "Q4_1": 3,
    "Q8_0": 7,
    "Q5_0": 8,
    "Q5_1": 9,
    "Q2_K": 10,
    "Q3_K_M": 12,
    "Q4_K_M": 15,
    "Q5_K_M": 17,
    "Q6_K": 18,
}

QUANTIZE = """
import ctypes, sys
import llama_cpp
params = llama_cpp.llama_model_quantize_default_params()
params.ftype = int(sys.argv[3])
params.nthread = 2
rc = llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), ctypes.byref(params))
sys.exit(rc)
"""


def _tensors(s: Shape, vocab: int) -> list[tuple[str, tuple[int, ...]]]:
    """(llama.cpp name, numpy shape (rows, cols)) in llama.cpp's converter order."""
    head_dim = s.hidden // s.heads
    out = [("token_embd.weight", (vocab, s.hidden))]
    for i in range(s.layers):
        b = f"blk.{i}."
        out += [
            (b + "attn_norm.weight", (s.hidden,)),
            (b + "attn_q.weight", (s.heads * head_dim, s.hidden)),
            (b + "attn_k.weight", (s.kv_heads * head_dim, s.hidden)),
            (b + "attn_v.weight", (s.kv_heads * head_dim, s.hidden)),
            (b + "attn_output.weight", (s.hidden, s.heads * head_dim)),
            (b + "ffn_norm.weight", (s.hidden,)),
            (b + "ffn_gate.weight", (s.ffn, s.hidden)),
            (b + "ffn_up.weight", (s.ffn, s.hidden)),
            (b + "ffn_down.weight", (s.hidden, s.ffn)),
        ]
    out.append(("output_norm.weight", (s.hidden,)))
    if not s.tied:
        out.append(("output.weight", (vocab, s.hidden)))
    return out


def _array(name: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    if len(shape) == 1:  # norms: ones, as an initialized model has
        return np.ones(shape, dtype=np.float32)
    # std 1 / sqrt(fan-in): activations stay O(1) through the layers
    w = rng.standard_normal(shape, dtype=np.float32) * np.float32(shape[1] ** -0.5)
    return w.astype(np.float16)


def write_f16(path: Path, shape: Shape) -> None:
    """The F16 GGUF, tensor by tensor (an 8B model does not fit in memory twice)."""
    src = GGUFReader(str(default_model_path()))
    vocab = int(src.fields["llama.vocab_size"].contents())
    writer = GGUFWriter(str(path), "llama")
    writer.add_name(f"kvserve synthetic {path.stem} (random weights)")
    writer.add_block_count(shape.layers)
    writer.add_context_length(4096)
    writer.add_embedding_length(shape.hidden)
    writer.add_feed_forward_length(shape.ffn)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_rope_freq_base(shape.rope_theta)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(vocab)
    writer.add_rope_dimension_count(shape.hidden // shape.heads)
    writer.add_file_type(1)  # F16
    for key, field in src.fields.items():
        if key.startswith("tokenizer."):
            sub = field.types[1] if field.types[0] == GGUFValueType.ARRAY else None
            writer.add_key_value(key, field.contents(), field.types[0], sub)
    specs = _tensors(shape, vocab)
    for name, shp in specs:
        dt = np.float32 if len(shp) == 1 else np.float16
        nbytes = int(np.prod(shp)) * np.dtype(dt).itemsize
        raw = GGMLQuantizationType.F32 if len(shp) == 1 else GGMLQuantizationType.F16
        writer.add_tensor_info(name, shp, np.dtype(dt), nbytes, raw_dtype=raw)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(0)
    for name, shp in specs:
        writer.write_tensor_data(_array(name, shp, rng))
    writer.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="tinyllama-1.1b", choices=sorted(SHAPES))
    ap.add_argument("--types", default="Q4_0,Q4_K_M", help=f"of {', '.join(FTYPES)}")
    ap.add_argument("--out", type=Path, default=Path(".bench-models"))
    ap.add_argument("--llama-python", default=None, help="llama-cpp-python's interpreter")
    args = ap.parse_args()
    types = [t.strip() for t in args.types.split(",") if t.strip()]
    bad = [t for t in types if t not in FTYPES]
    if bad:
        ap.error(f"unknown type(s) {bad}; choose from {', '.join(FTYPES)}")
    args.out.mkdir(parents=True, exist_ok=True)
    f16 = args.out / f"{args.shape}-F16.gguf"
    if not f16.exists():
        print(f"writing {f16} (random weights)", file=sys.stderr)
        tmp = f16.with_suffix(".partial")
        write_f16(tmp, SHAPES[args.shape])
        tmp.rename(f16)
    py = args.llama_python or default_peer_python("llama")
    for t in types:
        dst = args.out / f"{args.shape}-{t}.gguf"
        if not dst.exists():
            if py is None:
                sys.exit("llama-cpp-python not found: bash benchmarks/peers/setup.sh llama")
            print(f"quantizing {dst} with llama.cpp", file=sys.stderr)
            tmp = dst.with_suffix(".partial")
            subprocess.run(
                [py, "-c", QUANTIZE, str(f16), str(tmp), str(FTYPES[t])],
                check=True,
                stdout=subprocess.DEVNULL,
            )
            tmp.rename(dst)
        print(dst)


if __name__ == "__main__":
    main()
