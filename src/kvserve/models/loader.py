"""Build a model from a checkpoint, strictly.

The model is built on the ``meta`` device (no memory), every checkpoint tensor is checked
against the parameter it fills (name and shape), and loading fails with a message naming the
tensor if one is missing, unused or the wrong shape.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from kvserve.default_model import default_model_path
from kvserve.models.config import ModelConfig
from kvserve.models.gguf_checkpoint import (
    ROPE_FREQS,
    find_gguf_file,
    iter_gguf_tensors,
    read_gguf_config,
)
from kvserve.models.hf_checkpoint import count_hf_tensors, iter_hf_tensors, read_hf_config
from kvserve.models.layers import rope_inv_freq
from kvserve.models.llama import MODEL_REGISTRY, LlamaForCausalLM
from kvserve.models.packed_linear import pack_linears, packing_available

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Buffers some older HF checkpoints saved; they are recomputed, never loaded.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclass(slots=True)
class LoadedModel:
    config: ModelConfig
    model: LlamaForCausalLM
    path: Path  # the checkpoint directory or GGUF file
    gguf_file: Path | None  # set when loaded from GGUF


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        if dtype in DTYPES.values():
            return dtype
    elif dtype in DTYPES:
        return DTYPES[dtype]
    raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")


def resolve_model_path(model: str | Path | None) -> Path:
    if model is None:
        return default_model_path()
    path = Path(model).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"model path {str(path)!r} does not exist")
    return path


def load_model(
    model: str | Path | None = None,
    dtype: str | torch.dtype = "float32",
    device: str | torch.device = "cpu",
    show_progress: bool = False,
    pack_weights: bool = True,
) -> LoadedModel:
    """Load a HF directory or a GGUF file (``None``: the embedded default model).

    ``pack_weights``: on CPU, pre-pack linear weights for oneDNN (see packed_linear.py).
    """
    path = resolve_model_path(model)
    torch_dtype = parse_dtype(dtype)
    gguf_file = find_gguf_file(path)
    if gguf_file is not None:
        config, reader = read_gguf_config(gguf_file)
        tensors: Iterator[tuple[str, torch.Tensor]] = iter_gguf_tensors(reader, config)
        total = len(reader.tensors)
    elif path.is_dir():
        config = read_hf_config(path)
        tensors = iter_hf_tensors(path)
        total = count_hf_tensors(path)
    else:
        raise ValueError(f"{path} is neither a Hugging Face model directory nor a .gguf file")
    bar = tqdm(
        tensors, total=total, desc=f"loading {path.name}", unit="tensor", disable=not show_progress
    )
    net = build_model(config, bar, torch_dtype, torch.device(device))
    if pack_weights and packing_available(torch.device(device)):
        pack_linears(net)
    logger.info(
        "loaded %s (%s, %d layers, %s)",
        path,
        config.model_type,
        config.num_hidden_layers,
        torch_dtype,
    )
    return LoadedModel(config, net, path, gguf_file)


def build_model(
    config: ModelConfig,
    tensors: Iterator[tuple[str, torch.Tensor]],
    dtype: torch.dtype,
    device: torch.device,
) -> LlamaForCausalLM:
    """Fill a meta-device model from (HF name, tensor) pairs; strict about names and shapes."""
    cls = MODEL_REGISTRY[config.model_type]
    with torch.device("meta"):
        model = cls(config)
    expected = dict(model.named_parameters())
    if config.tie_word_embeddings:
        del expected["lm_head.weight"]
    state: dict[str, torch.Tensor] = {}
    freq_factors = None
    tied_head = None
    for name, tensor in tensors:
        if name == ROPE_FREQS:
            freq_factors = tensor
            continue
        if name.endswith(_IGNORED_SUFFIXES):
            continue
        if name == "lm_head.weight" and config.tie_word_embeddings:
            tied_head = tensor  # some tied checkpoints store a copy; it must equal the embedding
            continue
        if name not in expected:
            raise ValueError(
                f"unexpected tensor {name!r} in checkpoint: the {config.model_type} model has no "
                "such parameter"
            )
        want = tuple(expected[name].shape)
        if tuple(tensor.shape) != want:
            raise ValueError(
                f"tensor {name!r} has shape {tuple(tensor.shape)}, the model expects {want}"
            )
        state[name] = tensor.to(device=device, dtype=dtype)
    missing = sorted(set(expected) - set(state))
    if missing:
        shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
        raise ValueError(f"checkpoint is missing {len(missing)} tensor(s): {shown}")
    model.load_state_dict(state, strict=False, assign=True)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
        if tied_head is not None and not torch.equal(
            tied_head.to(device=device, dtype=dtype), model.lm_head.weight
        ):
            raise ValueError(
                "checkpoint has tie_word_embeddings but an lm_head.weight that differs from "
                "model.embed_tokens.weight"
            )
    rotary = model.model.rotary_emb
    rotary.inv_freq = rope_inv_freq(
        config.head_dim, config.rope_theta, config.rope_scaling, freq_factors
    ).to(device)
    model.eval().requires_grad_(False)
    leftover = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    assert not leftover, f"parameters left on meta device: {leftover}"
    return model
