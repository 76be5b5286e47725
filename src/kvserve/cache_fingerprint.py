"""What must match for a saved prefix cache to be this engine's own (kv/persist.py).

A block's K/V are a function of the model's weights, the dtypes it computes and caches in,
the quantization applied at load, and the cache layout; its hash and the token ids it is
looked up by come from the hash scheme and (through the text the server tokenizes) the
tokenizer. Every one of these goes into the fingerprint, as text, so a refusal can name what
differs. The weights are hashed by content (sha256 of the checkpoint's files; ~0.2 s per
100 MB), never by name or date.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from kvserve.kv.persist import FORMAT, FORMAT_VERSION
from kvserve.kv.prefix_cache import HASH_ROOT
from kvserve.kv.spec import KVCacheSpec
from kvserve.models.model_session import ModelSession


def weight_files(path: Path) -> list[Path]:
    """A GGUF file itself; a HF directory's config.json and safetensors files."""
    if path.is_file():
        return [path]
    return [path / "config.json", *sorted(path.glob("*.safetensors"))]


def files_sha256(files: list[Path]) -> str:
    h = hashlib.sha256()
    for f in files:
        h.update(f.name.encode() + b"\0")
        with open(f, "rb") as stream:
            while chunk := stream.read(1 << 20):
                h.update(chunk)
    return h.hexdigest()


def tokenizer_sha256(session: ModelSession) -> str:
    if session.tokenizer is None:
        return "none"
    hf = session.tokenizer.hf
    backend = getattr(hf, "backend_tokenizer", None)
    text = backend.to_str() if backend is not None else json.dumps(sorted(hf.get_vocab().items()))
    return hashlib.sha256(text.encode()).hexdigest()


def cache_fingerprint(
    session: ModelSession, spec: KVCacheSpec, quantization: str | None
) -> dict[str, str]:
    return {
        "format": f"{FORMAT}/{FORMAT_VERSION}",
        "hash_scheme": HASH_ROOT.decode(),
        "weights_sha256": files_sha256(weight_files(session.path)),
        "model_dtype": str(session.model.dtype).removeprefix("torch."),
        "cache_dtype": spec.cache_dtype_name,
        "quantization": quantization or "none",
        "block_size": str(spec.block_size),
        "layout": spec.describe(),  # layers, kinds, kv heads x head dim, K and V cache dtypes
        "tokenizer_sha256": tokenizer_sha256(session),
    }
