"""`kvserve plan`'s flags and output (the arithmetic is plan.py's): where the model's shape and
weight bytes come from (a checkpoint, a bare config.json, or explicit dims), and the device's
memory (bytes, a named preset, or this machine's RAM)."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from pathlib import Path

from kvserve.config import parse_memory
from kvserve.default_model import default_model_path
from kvserve.models.config import ModelConfig
from kvserve.models.deepseek_config import DEEPSEEK_MODEL_TYPES, DeepseekConfig
from kvserve.plan import (
    CACHE_DTYPES,
    DEFAULT_RESERVE,
    DEVICE_PRESETS,
    MLAShape,
    PlanInput,
    TextCost,
    human,
    plan,
    table,
    text_cost,
)

THIS_MACHINE = "this-machine"


def add_plan_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        default=None,
        help="HF directory, .gguf file or a bare config.json (default: the embedded model)",
    )
    p.add_argument("--layers", type=int, default=None, help="instead of --model: layers")
    p.add_argument("--kv-heads", type=int, default=None, help="instead of --model: KV heads")
    p.add_argument("--head-dim", type=int, default=None, help="instead of --model: head dim")
    p.add_argument(
        "--mla",
        type=int,
        nargs=5,
        default=None,
        metavar=("KV_LORA_RANK", "ROPE_DIM", "HEADS", "NOPE_DIM", "V_DIM"),
        help="with --layers instead of --kv-heads / --head-dim: an MLA latent cache "
        "(DeepSeek-V2-Lite: 512 64 16 128 128); heads, nope and v dims size the MHA figure",
    )
    p.add_argument(
        "--kv-cache-dtype",
        nargs="+",
        default=["bfloat16"],
        metavar="DTYPE",
        help=f"one row per cache dtype: {', '.join(CACHE_DTYPES)}, or K/V apart as int4/int8",
    )
    p.add_argument("--context", type=int, nargs="+", default=[2048, 8192, 32768])
    p.add_argument(
        "--sliding-window",
        type=int,
        default=None,
        help="with dims: every layer a sliding window of this many tokens (Mistral v0.1)",
    )
    p.add_argument(
        "--streaming-window",
        type=int,
        default=None,
        help="the StreamingLLM policy (as the engine's flag): full-attention layers keep the "
        "last W tokens and the first --streaming-sinks",
    )
    p.add_argument("--streaming-sinks", type=int, default=4)
    p.add_argument("--block-size", type=int, default=16)
    dev = p.add_mutually_exclusive_group()
    dev.add_argument("--device-memory", default=None, help="e.g. 80GB (decimal) or 80GiB")
    dev.add_argument(
        "--device",
        default=THIS_MACHINE,
        choices=[*DEVICE_PRESETS, THIS_MACHINE],
        help="a named device (its public memory size) or this machine's RAM",
    )
    p.add_argument(
        "--weights-bytes",
        default=None,
        help="the weights' size on the device (default: the checkpoint's files; 0 with dims)",
    )
    p.add_argument(
        "--reserve",
        type=float,
        default=DEFAULT_RESERVE,
        help="share of device memory kept for activations and slack (vLLM's 1 - "
        "gpu_memory_utilization)",
    )
    p.add_argument(
        "--text",
        type=Path,
        default=None,
        help="a UTF-8 text: its tokens under the model's tokenizer, tokens per word, the KV "
        "bytes it holds and its share of each --context",
    )
    p.add_argument("--json", action="store_true")
    p.add_argument("--verbose", "-v", action="store_true", help="log more")


def _machine_memory() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) * 1024
    raise ValueError("cannot read this machine's memory (/proc/meminfo); pass --device-memory")


def _model_shape(path: Path) -> tuple[ModelConfig | DeepseekConfig, int]:
    """The model's config and its weight files' bytes."""
    from kvserve.models.gguf_checkpoint import read_gguf_config
    from kvserve.models.hf_checkpoint import read_hf_config, safetensors_files

    if path.suffix == ".gguf":
        return read_gguf_config(path)[0], path.stat().st_size
    if path.name.endswith(".json"):  # a bare config: no weights to size
        cfg = json.loads(path.read_text())
        if cfg.get("model_type") in DEEPSEEK_MODEL_TYPES:
            return DeepseekConfig.from_hf(cfg), 0
        return ModelConfig.from_hf(cfg), 0
    return read_hf_config(path), sum(f.stat().st_size for f in safetensors_files(path))


def plan_input(args: argparse.Namespace) -> tuple[str, PlanInput]:
    if args.mla is not None:
        return _mla_dims_input(args)
    dims = (args.layers, args.kv_heads, args.head_dim)
    if any(d is not None for d in dims):
        if None in dims or args.model is not None:
            raise ValueError("give --layers, --kv-heads and --head-dim together, without --model")
        layers, kv_heads, head_dim = dims
        name, weights = f"{layers} layers x {kv_heads} KV heads x head dim {head_dim}", 0
        windows = (args.sliding_window,) * layers if args.sliding_window else ()
    else:
        path = Path(args.model) if args.model else default_model_path()
        config, weights = _model_shape(path)
        if isinstance(config, DeepseekConfig):
            return _mla_plan_input(args, path, config, weights)
        layers, kv_heads, head_dim = (
            config.num_hidden_layers,
            config.num_key_value_heads,
            config.head_dim,
        )
        name = f"{path.name}: {layers} layers x {kv_heads} KV heads x head dim {head_dim}"
        if args.sliding_window is not None:
            raise ValueError("--sliding-window goes with dims; a model's config has its own")
        windows = tuple(config.layer_window(i) for i in range(layers))
        if all(w is None for w in windows):
            windows = ()
    weights, memory = _weights_and_memory(args, weights)
    streaming = None
    if args.streaming_window is not None:
        streaming = (args.streaming_sinks, args.streaming_window)
    inp = PlanInput(
        layers,
        kv_heads,
        head_dim,
        memory,
        weights,
        args.block_size,
        args.reserve,
        windows,
        streaming,
    )
    return name, inp


def _mla_dims_input(args: argparse.Namespace) -> tuple[str, PlanInput]:
    """--layers N --mla R P H D V: a latent cache from explicit dims."""
    if args.layers is None or args.model is not None or args.kv_heads or args.head_dim:
        raise ValueError("--mla goes with --layers only (no --model, --kv-heads, --head-dim)")
    rank, rope, heads, nope, v = args.mla
    mla = MLAShape(rank, rope, heads, nope, v)
    name = (
        f"{args.layers} layers x MLA latent {rank} + rope {rope} ({rank + rope} values/token/layer)"
    )
    weights, memory = _weights_and_memory(args, 0)
    inp = PlanInput(
        args.layers, heads, nope + rope, memory, weights, args.block_size, args.reserve, mla=mla
    )
    return name, inp


def _weights_and_memory(args: argparse.Namespace, weights: int) -> tuple[int, int]:
    if args.weights_bytes is not None:
        weights = parse_memory(args.weights_bytes, "--weights-bytes")
    if args.device_memory is not None:
        return weights, parse_memory(args.device_memory, "--device-memory")
    if args.device == THIS_MACHINE:
        return weights, _machine_memory()
    return weights, DEVICE_PRESETS[args.device]


def _mla_plan_input(
    args: argparse.Namespace, path: Path, config: DeepseekConfig, weights: int
) -> tuple[str, PlanInput]:
    """A latent-attention model: one MLA row per token and layer (``MLASpec``)."""
    c = config
    mla = MLAShape(
        c.kv_lora_rank, c.qk_rope_head_dim, c.num_attention_heads, c.qk_nope_head_dim, c.v_head_dim
    )
    name = (
        f"{path.name}: {c.num_hidden_layers} layers x MLA latent {c.kv_lora_rank} + rope "
        f"{c.qk_rope_head_dim} ({c.latent_width} values/token/layer; as MHA {c.num_attention_heads}"
        f" heads x ({c.qk_nope_head_dim} + {c.qk_rope_head_dim} + {c.v_head_dim}) = "
        f"{c.num_attention_heads * (c.qk_head_dim + c.v_head_dim):,})"
    )
    if args.streaming_window is not None or args.sliding_window is not None:
        raise ValueError(
            "an MLA model's plan has no windows (--streaming-window / --sliding-window)"
        )
    weights, memory = _weights_and_memory(args, weights)
    inp = PlanInput(
        c.num_hidden_layers,
        c.num_attention_heads,
        c.qk_head_dim,
        memory,
        weights,
        args.block_size,
        args.reserve,
        mla=mla,
    )
    return name, inp


def _text_costs(args: argparse.Namespace, inp: PlanInput) -> list[TextCost]:
    """The text's tokens under the model's own tokenizer, costed per cache dtype."""
    from kvserve.models.gguf_checkpoint import find_gguf_file
    from kvserve.tokenizer import Tokenizer

    if args.model is None and args.layers is not None:
        raise ValueError("--text needs a model's tokenizer: give --model (or no dims)")
    path = Path(args.model) if args.model else default_model_path()
    if path.name.endswith(".json"):
        path = path.parent  # a config.json beside its tokenizer files
    gguf = path if path.suffix == ".gguf" else find_gguf_file(path)
    tok = Tokenizer.load(path if gguf is None else gguf.parent, gguf)
    text = args.text.read_text("utf-8")
    tokens = len(tok.encode(text, add_special_tokens=False))
    words = len(text.split())
    return [text_cost(inp, d, tokens, words, args.context) for d in args.kv_cache_dtype]


def run_plan(args: argparse.Namespace) -> int:
    name, inp = plan_input(args)
    rows = plan(inp, args.kv_cache_dtype, args.context)
    costs = _text_costs(args, inp) if args.text is not None else []
    if args.json:
        out = {"model": name, "input": inp_dict(inp), "rows": [r.as_dict() for r in rows]}
        if costs:
            out["text"] = {"path": str(args.text), "costs": [c.as_dict() for c in costs]}
        print(json.dumps(out))
        return 0
    print(name)
    print(
        f"device {human(inp.device_memory)}, weights {human(inp.weights_bytes)}, reserve "
        f"{inp.reserve:.0%}: {human(inp.kv_budget)} for the KV cache"
    )
    for line in table(rows):
        print(line)
    for r in rows:
        if r.context % 1024 == 0 and r.layout == "full":  # "8k": the lessons' 1,000 tokens
            k = r.context // 1024
            rounded = k * 1000 * r.bytes_per_token
            print(
                f"{r.dtype} at {k}k = {r.context:,} tokens: {r.bytes_per_request:,} bytes = "
                f"{human(r.bytes_per_request)} per request (as {k},000 tokens, the lessons' "
                f"rounding: {rounded / 1e9:.2f} GB); {r.requests} requests fit"
            )
    for c in costs:
        shares = ", ".join(f"{s:.1%} of {n:,}" for n, s in c.context_share.items())
        print(
            f"{args.text.name}: {c.tokens:,} tokens, {c.words:,} words ({c.tokens_per_word:.2f} "
            f"tokens per word); at {c.dtype} it holds {c.kv_bytes:,} bytes = {human(c.kv_bytes)} "
            f"of KV ({human(c.allocated_bytes)} in whole blocks), {shares} tokens of context"
        )
    return 0


def inp_dict(inp: PlanInput) -> dict[str, int | float]:
    return {
        "num_layers": inp.num_layers,
        "num_kv_heads": inp.num_kv_heads,
        "head_dim": inp.head_dim,
        "block_size": inp.block_size,
        "device_memory": inp.device_memory,
        "weights_bytes": inp.weights_bytes,
        "reserve": inp.reserve,
        "layout": inp.layout,
        **({} if inp.mla is None else {"mla": asdict(inp.mla)}),
    }
