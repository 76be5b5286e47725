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
from kvserve.models.deepseek import DEEPSEEK_REGISTRY
from kvserve.models.deepseek_config import DeepseekConfig
from kvserve.models.gguf_checkpoint import (
    ROPE_FREQS,
    QuantizedTensor,
    find_gguf_file,
    iter_gguf_tensors,
    read_gguf_config,
)
from kvserve.models.hf_checkpoint import count_hf_tensors, iter_hf_tensors, read_hf_config
from kvserve.models.layers import rope_inv_freq
from kvserve.models.llama import MODEL_REGISTRY, LlamaForCausalLM
from kvserve.models.row_thresholds import REMEASURE_ENV, RowThresholdCache
from kvserve.models.weight_formats import WeightsReport, finalize_weights, quantize_linears
from kvserve.platform import CpuFeatures, auto_dtype, detect_cpu_features

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_CHOICES = ("auto", *DTYPES)
# Buffers some older HF checkpoints saved; they are recomputed, never loaded.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclass(slots=True)
class LoadedModel:
    config: ModelConfig | DeepseekConfig
    model: LlamaForCausalLM
    path: Path  # the checkpoint directory or GGUF file
    gguf_file: Path | None  # set when loaded from GGUF
    weights: WeightsReport  # what each weight became in memory and how it multiplies


def parse_dtype(
    dtype: str | torch.dtype,
    device: torch.device | str = "cpu",
    features: CpuFeatures | None = None,
) -> torch.dtype:
    """A dtype name (or "auto": bfloat16 on CUDA and native-bf16 CPUs, else float32)."""
    if isinstance(dtype, torch.dtype):
        if dtype in DTYPES.values():
            return dtype
    elif dtype == "auto":
        return auto_dtype(device, features or detect_cpu_features())
    elif dtype in DTYPES:
        return DTYPES[dtype]
    raise ValueError(f"dtype must be one of {', '.join(DTYPE_CHOICES)}, got {dtype!r}")


def _warn_slow_dtype(dtype: torch.dtype, device: torch.device, features: CpuFeatures) -> None:
    if (
        device.type == "cpu"
        and dtype != torch.float32
        and not (dtype == torch.bfloat16 and features.native_bf16)
    ):
        logger.warning(
            "%s on this CPU (%s) has no native support: dense matmuls convert to float32, "
            "and attention and norms run emulated; --dtype float32 (what auto picks here) is "
            "faster",
            str(dtype).removeprefix("torch."),
            features.name,
        )


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
    quantization: str | None = None,
    features: CpuFeatures | None = None,
    thresholds: RowThresholdCache | None = None,
) -> LoadedModel:
    """Load a HF directory or a GGUF file (``None``: the embedded default model).

    GGUF weights in Q8_0/Q4_0/Q4_1/Q4_K/Q5_K/Q6_K stay quantized on CPU; ``quantization``
    ("q8_0" | "q4_0") quantizes a checkpoint's float weights at load. ``pack_weights``: on CPU,
    pre-pack dense linear weights for oneDNN where the CPU runs it (weight_formats.py).
    ``thresholds``: where the quantized matmuls' measured row thresholds are looked up and
    kept (default: this machine's file, models/row_thresholds.py).
    """
    path = resolve_model_path(model)
    device = torch.device(device)
    features = features or detect_cpu_features()
    torch_dtype = parse_dtype(dtype, device, features)
    _warn_slow_dtype(torch_dtype, device, features)
    gguf_file = find_gguf_file(path)
    keep_quantized = device.type == "cpu" and quantization is None
    if gguf_file is not None:
        config, reader = read_gguf_config(gguf_file)
        tensors: Iterator[tuple[str, torch.Tensor | QuantizedTensor]] = iter_gguf_tensors(
            reader, config, keep_quantized
        )
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
    net, quantized = build_model(config, bar, torch_dtype, device)
    if quantization is not None:
        if device.type != "cpu":
            raise ValueError(f"--quantization runs on CPU only, got device {device}")
        quantized = quantize_linears(net, quantization)
    if thresholds is None:
        thresholds = RowThresholdCache.default(features)
    report = finalize_weights(
        net, quantized, torch_dtype, device, features, pack_weights, thresholds
    )
    if thresholds.hits:
        logger.info(
            "quantized matmul row thresholds of %d weight shapes read from %s (measured before "
            "on this machine; %s=1 measures again)",
            thresholds.hits,
            thresholds.path,
            REMEASURE_ENV,
        )
    logger.info(
        "loaded %s (%s, %d layers, %s): weights %s",
        path,
        config.model_type,
        config.num_hidden_layers,
        torch_dtype,
        report.summary(),
    )
    return LoadedModel(config, net, path, gguf_file, report)


def build_model(
    config: ModelConfig,
    tensors: Iterator[tuple[str, torch.Tensor | QuantizedTensor]],
    dtype: torch.dtype,
    device: torch.device,
) -> tuple[LlamaForCausalLM, dict[str, QuantizedTensor]]:
    """Fill a meta-device model from (HF name, tensor) pairs; strict about names and shapes.

    Quantized tensors are checked the same way but not loaded: they are returned by name (the
    modules they fill stay on the meta device until ``finalize_weights`` replaces them).
    """
    cls = {**MODEL_REGISTRY, **DEEPSEEK_REGISTRY}[config.model_type]
    with torch.device("meta"):
        model = cls(config)
    expected = dict(model.named_parameters())
    if config.tie_word_embeddings:
        del expected["lm_head.weight"]
    state: dict[str, torch.Tensor] = {}
    quantized: dict[str, QuantizedTensor] = {}
    freq_factors = None
    tied_head = None
    for name, tensor in tensors:
        if name == ROPE_FREQS:
            freq_factors = tensor
            continue
        if name.endswith(_IGNORED_SUFFIXES):
            continue
        if hasattr(model, "skip_checkpoint_tensor") and model.skip_checkpoint_tensor(name):
            continue  # e.g. DeepSeek-V3's multi-token-prediction layers
        if name == "lm_head.weight" and config.tie_word_embeddings:
            tied_head = tensor  # some tied checkpoints store a copy; it must equal the embedding
            continue
        if isinstance(tensor, QuantizedTensor):
            _check_shape(name, tensor.shape, expected)
            quantized[name] = tensor
            continue
        _check_shape(name, tuple(tensor.shape), expected)
        keep = name.endswith(getattr(model, "float32_params", ()))  # e.g. a MoE router
        state[name] = tensor.to(device=device, dtype=torch.float32 if keep else dtype)
    missing = sorted(set(expected) - set(state) - set(quantized))
    if missing:
        shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
        raise ValueError(f"checkpoint is missing {len(missing)} tensor(s): {shown}")
    model.load_state_dict(state, strict=False, assign=True)
    if config.tie_word_embeddings and "model.embed_tokens.weight" not in quantized:
        model.lm_head.weight = model.model.embed_tokens.weight
        if tied_head is not None and not torch.equal(
            tied_head.to(device=device, dtype=dtype), model.lm_head.weight
        ):
            raise ValueError(
                "checkpoint has tie_word_embeddings but an lm_head.weight that differs from "
                "model.embed_tokens.weight"
            )
    if hasattr(model, "init_buffers"):  # a family with its own rotary (models/deepseek.py)
        model.init_buffers(device)
    else:
        rotary = model.model.rotary_emb
        rotary.inv_freq = rope_inv_freq(
            config.head_dim, config.rope_theta, config.rope_scaling, freq_factors
        ).to(device)
    model.eval().requires_grad_(False)
    filled = {n.removesuffix(".weight") for n in quantized}
    if config.tie_word_embeddings and "model.embed_tokens.weight" in quantized:
        filled.add("lm_head")
    leftover = [
        n
        for n, t in [*model.named_parameters(), *model.named_buffers()]
        if t.is_meta and n.rpartition(".")[0] not in filled
    ]
    assert not leftover, f"parameters left on meta device: {leftover}"
    return model, quantized


def _check_shape(name: str, shape: tuple[int, ...], expected: dict[str, torch.Tensor]) -> None:
    if name not in expected:
        raise ValueError(
            f"unexpected tensor {name!r} in checkpoint: the model has no such parameter"
        )
    want = tuple(expected[name].shape)
    if tuple(shape) != want:
        raise ValueError(f"tensor {name!r} has shape {tuple(shape)}, the model expects {want}")
