"""capacity: at the same KV memory, how many requests run at once with paged blocks vs one
dense max_model_len buffer per request, and the share of allocated KV slots holding no token.

The paged side runs the real Scheduler and KVCacheManager over the offline workload (prompt
lengths uniform in [32, 512], outputs in [32, 256]) with a simulated model: scheduling does not
depend on token values when EOS is ignored, so the bookkeeping is exactly the engine's. Sizes
come from KVCacheSpec, the same function the engine allocates with.

    python -m benchmarks.capacity [--kv-cache-memory 256MiB] [--dtype bfloat16] [--num-requests 256]
        [--kv-cache-dtype auto int8 fp8_e4m3 int4 int4_sym int4/int8]

One row per cache dtype (K/V apart as int4/int8): bytes per token, the pool's blocks and the
requests held at once at the same memory. For a latent-attention model (DeepSeek-V2/V3; a
checkpoint or a bare config.json as --model) two rows per float dtype and fp8_e4m3: the MLA
latent cache (fp8: the latent part, the rope key in --dtype) and the multi-head cache the same
model would need in that dtype (other quantized dtypes are left out: no such latent).
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import dataclass

from benchmarks import plot
from benchmarks.common import workload_offline
from kvserve.config import SchedulerConfig, parse_memory
from kvserve.engine.output import append_token
from kvserve.engine.request import Request
from kvserve.engine.scheduler import Scheduler
from kvserve.kv.cache_dtype import CacheDtype
from kvserve.kv.manager import KVCacheManager
from kvserve.kv.spec import KVCacheSpec
from kvserve.models.config import ModelConfig
from kvserve.models.deepseek import deepseek_kv_cache_spec
from kvserve.models.deepseek_config import DEEPSEEK_MODEL_TYPES, DeepseekConfig
from kvserve.models.gguf_checkpoint import find_gguf_file, read_gguf_config
from kvserve.models.hf_checkpoint import read_hf_config
from kvserve.models.llama import kv_cache_spec
from kvserve.models.loader import parse_dtype, resolve_model_path
from kvserve.sampling import SamplingParams


def model_config(model: str | None):
    """A checkpoint's config, or a bare config.json's (a DeepSeek-V3 shape needs no weights)."""
    path = resolve_model_path(model)
    if path.suffix == ".json":
        cfg = json.loads(path.read_text())
        if cfg.get("model_type") in DEEPSEEK_MODEL_TYPES:
            return DeepseekConfig.from_hf(cfg)
        return ModelConfig.from_hf(cfg)
    gguf = find_gguf_file(path)
    return read_gguf_config(gguf)[0] if gguf else read_hf_config(path)


def specs_for(cfg, name: str, model_dtype, block_size: int) -> list[tuple[str, object]]:
    """(row label, spec) for one --kv-cache-dtype. A latent-attention (MLA) model gets its
    latent spec and, beside it, the multi-head cache the same model would need at that dtype:
    heads x (K: nope + rope, V: v_head_dim), as a full-attention spec of equal bytes (head
    dim (nope + rope + v) / 2 for K and V alike: the simulation only reads bytes per block)."""
    k, v = (name.split("/") * 2)[:2]
    k_dt, v_dt = CacheDtype.parse(k, model_dtype), CacheDtype.parse(v, model_dtype)
    if not isinstance(cfg, DeepseekConfig):
        return [(name, kv_cache_spec(cfg, k_dt, v_dt, block_size))]
    if k_dt != v_dt or (k_dt.is_quantized and k_dt.name != "fp8_e4m3"):
        return []  # a latent is a float dtype or fp8_e4m3 (kv/spec.py MLASpec)
    rope = CacheDtype.of(model_dtype)  # an fp8 latent's rope key: the model's dtype
    latent = deepseek_kv_cache_spec(cfg, k_dt, v_dt, block_size, rope_dtype=rope)
    per_head = cfg.qk_head_dim + cfg.v_head_dim
    mha = KVCacheSpec.full_attention(
        cfg.num_hidden_layers, cfg.num_attention_heads, per_head // 2, k_dt, block_size
    )
    assert mha.bytes_per_token == latent.mha_equivalent_bytes_per_token or per_head % 2
    return [(f"{k_dt.name} mla latent", latent), (f"{k_dt.name} as MHA", mha)]


@dataclass(frozen=True, slots=True)
class CapacityRow:
    cache_dtype: str
    bytes_per_token: int
    num_blocks: int
    max_running: int
    median_running: float
    mean_empty_slots: float
    preemptions: int
    dense_requests: int  # one max_model_len buffer per request, same memory


def simulate(
    cfg, spec, memory: int, args, max_model_len: int, workload, label: str = ""
) -> CapacityRow:
    """The real Scheduler and KVCacheManager over the workload, a simulated model."""
    num_blocks = spec.num_blocks_for(memory)
    groups = [g.spec for g in spec.groups]
    kv = KVCacheManager(num_blocks, args.block_size, False, False, groups)
    sched = Scheduler(
        SchedulerConfig(
            args.max_num_seqs, max_num_batched_tokens=8192, max_model_len=max_model_len
        ),
        kv,
        max_model_len,
    )
    prompts, outputs = workload
    for i, (p, o) in enumerate(zip(prompts, outputs, strict=True)):
        sched.add_request(Request(f"r{i}", p, SamplingParams(max_tokens=o, ignore_eos=True)))
    running, waste = [], []
    while sched.has_unfinished():
        out = sched.schedule()
        sched.update_after_step(out)
        # after the step: tokens held vs slots allocated, over the running requests
        held = sum(r.num_computed_tokens for r in sched.running)
        allocated = kv.pool.num_used_blocks * args.block_size
        if allocated:
            running.append(len(sched.running))
            waste.append(1 - held / allocated)
        for s in out.scheduled:
            if s.samples:
                req = sched.requests[s.request_id]
                status = append_token(req, 7, None, max_model_len)
                if status is not None:
                    sched.finish(req, status)
    return CapacityRow(
        label or spec.cache_dtype_name,
        spec.bytes_per_token,
        num_blocks,
        max(running),
        statistics.median(running),
        statistics.mean(waste),
        sched.num_preemptions,
        memory // (spec.bytes_per_token * max_model_len),
    )


# Mistral-7B-v0.1's shape (32 layers, 8 KV heads x 128, every layer a 4096-token window) and
# the same model with full attention: what one request holds as it grows (no weights needed)
MISTRAL_7B = {
    "model_type": "mistral",
    "vocab_size": 32000,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "max_position_embeddings": 32768,
    "sliding_window": 4096,
}
GROWTH_LENGTHS = (1024, 2048, 4096, 8192, 16384, 32768)


@dataclass(frozen=True, slots=True)
class GrowthRow:
    model: str
    spec: str
    length: int  # tokens in the request
    blocks: int  # blocks it holds (every group)
    kv_bytes: int


def growth(cfg, label: str, block_size: int, model_dtype) -> list[GrowthRow]:
    """One request decoding to the longest length through the real Scheduler and
    KVCacheManager: the blocks it holds as it passes each of GROWTH_LENGTHS."""
    exact = CacheDtype.of(model_dtype)
    spec = kv_cache_spec(cfg, exact, exact, block_size)
    longest = max(GROWTH_LENGTHS)
    num_blocks = spec.max_blocks(longest + 1) + 1
    kv = KVCacheManager(num_blocks, block_size, False, False, [g.spec for g in spec.groups])
    sched = Scheduler(SchedulerConfig(1, 8192, longest + 1), kv, longest + 1)
    prompt = [1] * 16
    # one token more than the longest mark: the step that computes token ``longest`` runs
    params = SamplingParams(max_tokens=longest - 16 + 1, ignore_eos=True)
    req = Request("grow", prompt, params)
    sched.add_request(req)
    rows, marks = [], list(GROWTH_LENGTHS)
    while sched.has_unfinished():
        out = sched.schedule()
        sched.update_after_step(out)
        if marks and req.num_computed_tokens >= marks[0]:  # the step computed token marks[0]
            blocks = len(kv.held_blocks(req.request_id))
            rows.append(
                GrowthRow(
                    label, spec.describe(), marks.pop(0), blocks, blocks * spec.bytes_per_block
                )
            )
        if out.scheduled and out.scheduled[0].samples:
            status = append_token(req, 7, None, longest + 1)
            if status is not None:
                sched.finish(req, status)
    return rows


def growth_panel(grow: list[GrowthRow]) -> list:
    if not grow:
        return []
    models = list(dict.fromkeys(r.model for r in grow))
    series = {m: [r.blocks for r in grow if r.model == m] for m in models}
    return [
        plot.Lines(
            list(GROWTH_LENGTHS),
            series,
            "tokens in the request",
            "blocks held",
            annotate={m: [str(v) for v in vals] for m, vals in series.items()},
            title="one request growing: blocks held (windowed layers give theirs back)",
            logx=True,
        )
    ]


def print_growth(rows: list[GrowthRow]) -> None:
    print()
    print("one request growing (prompt 16 tokens, then decode): blocks held, all groups")
    print("| model | cache | tokens | blocks held | KV bytes held |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r.model} | {r.spec} | {r.length:,} | {r.blocks:,} | {r.kv_bytes / 2**20:,.1f} MiB |"
        )


def draw(path, title: str, rows: list[CapacityRow], grow: list[GrowthRow] = ()) -> None:
    base = rows[0]
    groups = [
        f"{r.cache_dtype}\n{r.bytes_per_token:,} B/token\n"
        f"{base.bytes_per_token / r.bytes_per_token:.2f}x tokens"
        for r in rows
    ]
    plot.figure(
        path,
        title,
        [
            plot.GroupedBars(
                groups,
                {
                    "paged: max": [r.max_running for r in rows],
                    "paged: median": [r.median_running for r in rows],
                    "dense max_model_len buffers": [r.dense_requests for r in rows],
                },
                "requests held at once",
                annotate={
                    "paged: max": [str(r.max_running) for r in rows],
                    "dense max_model_len buffers": [str(r.dense_requests) for r in rows],
                },
                title="requests at once at the same KV memory (x tokens: vs the first row)",
                xlabel="cache dtype",
            ),
            plot.Bars(
                [r.cache_dtype for r in rows],
                [100 * r.mean_empty_slots for r in rows],
                "allocated KV slots holding no token (%)",
                annotate=[
                    f"{r.mean_empty_slots:.1%}"
                    + (f"\n{r.preemptions} preempted" if r.preemptions else "")
                    for r in rows
                ],
                title="paged: empty slots (mean over steps)",
                xlabel="cache dtype",
            ),
        ]
        + growth_panel(grow),
    )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--kv-cache-memory", default="256MiB")
    ap.add_argument(
        "--kv-cache-dtype",
        nargs="+",
        default=["auto", "int8", "fp8_e4m3", "int4", "int4_sym", "int4/int8"],
        help="one row each; auto = --dtype (the exact cache); K/V apart as int4/int8",
    )
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-model-len", type=int, default=None, help="default: the model's context")
    ap.add_argument(
        "--no-growth", action="store_true", help="skip the windowed-vs-full growth table"
    )
    plot.add_plot_arg(ap)
    args = ap.parse_args(argv)

    cfg = model_config(args.model)
    memory = parse_memory(args.kv_cache_memory)
    max_model_len = args.max_model_len or cfg.max_model_len
    workload = workload_offline(args.num_requests, cfg.vocab_size)
    mean_tokens = statistics.mean(len(p) + o for p, o in zip(*workload, strict=True))
    model_dtype = parse_dtype(args.dtype)
    rows = []
    for name in args.kv_cache_dtype:
        for label, spec in specs_for(cfg, name, model_dtype, args.block_size):
            rows.append(simulate(cfg, spec, memory, args, max_model_len, workload, label))
    title = (
        f"capacity: model={cfg.model_type} activations={args.dtype} KV memory="
        f"{memory / 2**20:.0f} MiB, blocks of {args.block_size}, max_model_len={max_model_len}, "
        f"{args.num_requests} offline requests (mean prompt+output {mean_tokens:.0f} tokens, "
        f"max_num_seqs {args.max_num_seqs})"
    )
    print(title)
    title = title.replace(
        f"model={cfg.model_type}",
        f"model={resolve_model_path(args.model).name} ({cfg.model_type})",
        1,
    )
    base = rows[0]
    print(
        "| cache dtype | bytes/token | blocks | tokens vs first row | paged: requests at once "
        "(max / median) | empty slots (mean) | preemptions | dense: requests at once |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r.cache_dtype} | {r.bytes_per_token:,} | {r.num_blocks:,} "
            f"| {base.bytes_per_token / r.bytes_per_token:.2f}x | {r.max_running} / "
            f"{r.median_running:.0f} | {r.mean_empty_slots:.2%} | {r.preemptions} "
            f"| {r.dense_requests} |"
        )
    grow = []
    if not args.no_growth:
        windowed = ModelConfig.from_hf(MISTRAL_7B)
        full = ModelConfig.from_hf({**MISTRAL_7B, "sliding_window": None})
        hybrid = ModelConfig.from_hf(
            {**MISTRAL_7B, "layer_types": ["sliding_attention", "full_attention"] * 16}
        )
        for cfg_g, label in (
            (full, "Mistral-7B shape, full attention"),
            (windowed, "Mistral-7B-v0.1 (every layer windowed)"),
            (hybrid, "hybrid: every other layer windowed (Gemma 2's pattern)"),
        ):
            grow += growth(cfg_g, label, args.block_size, model_dtype)
        print_growth(grow)
    if args.plot:
        draw(args.plot, title, rows, grow)


if __name__ == "__main__":
    main()
