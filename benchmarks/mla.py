"""mla: decode-1 and offline-64 on a small random DeepSeek-V2 checkpoint (MLA + MoE), kvserve
vs HF transformers in the same dtype, and the capacity rows of its latent cache against the
multi-head cache the same model would need.

The checkpoint is built here (transformers' DeepseekV2Config, its own random init, saved with
``save_pretrained`` into a temp dir) and loaded by both sides from that directory. HF runs
in this process with its default (dynamic) cache, which holds the latent too but re-expands
it through kv_b_proj for every cached token at every step; kvserve decodes absorbed over the
paged latent (attention/mla.py). decode-1: one request, 128-token prompt, 128 new tokens,
greedy, ignore EOS (TTFT and decode tokens/s); offline-64: 64 requests, prompts uniform in
[32, 512], outputs in [32, 256], all at once (HF: one left-padded batch generating to the
longest output, credited only with the tokens each request asked for). Medians of ``--runs``,
kvserve and HF alternating.

    python -m benchmarks.mla [--dtype auto] [--runs 3] [--num-requests 64] [--skip-hf] \\
        [--layers 4] [--hidden 512] [--heads 8] [--kv-lora-rank 64] [--plot FILE.png]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks import plot
from benchmarks.capacity import simulate, specs_for
from benchmarks.common import random_prompt, workload_offline
from kvserve.engine.llm import LLM
from kvserve.models.loader import parse_dtype
from kvserve.sampling import SamplingParams


def build_checkpoint(directory: Path, args) -> dict:
    """A random DeepseekV2 checkpoint (MoE from layer 1, no q LoRA, as V2-Lite) -> its sizes."""
    from transformers import AutoModelForCausalLM, DeepseekV2Config

    sizes = dict(
        vocab_size=4096,
        hidden_size=args.hidden,
        intermediate_size=2 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.heads,
        kv_lora_rank=args.kv_lora_rank,
        q_lora_rank=None,
        qk_nope_head_dim=32,
        qk_rope_head_dim=16,
        v_head_dim=32,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_shared_experts=1,
        moe_intermediate_size=args.hidden // 2,
        first_k_dense_replace=1,
        max_position_embeddings=2048,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(DeepseekV2Config(**sizes), dtype=torch.float32)
    model.save_pretrained(directory)
    return sizes


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def kvserve_decode(llm: LLM, prompt: list[int], new: int) -> tuple[float, float]:
    t = time.perf_counter()
    llm.generate([prompt], greedy(1), use_tqdm=False)
    ttft = time.perf_counter() - t
    t = time.perf_counter()
    (out,) = llm.generate([prompt], greedy(new), use_tqdm=False)
    assert len(out.token_ids) == new
    return ttft, time.perf_counter() - t


def hf_decode(model, prompt: list[int], new: int) -> tuple[float, float]:
    ids = torch.tensor([prompt])
    common = dict(do_sample=False, pad_token_id=0)
    with torch.inference_mode():
        t = time.perf_counter()
        model.generate(ids, max_new_tokens=1, min_new_tokens=1, **common)
        ttft = time.perf_counter() - t
        t = time.perf_counter()
        out = model.generate(ids, max_new_tokens=new, min_new_tokens=new, **common)
    assert out.shape[1] == len(prompt) + new
    return ttft, time.perf_counter() - t


def hf_offline(model, prompts: list[list[int]], outputs: list[int]) -> float:
    width = max(len(p) for p in prompts)
    ids = torch.zeros((len(prompts), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    new = max(outputs)
    t = time.perf_counter()
    with torch.inference_mode():
        model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=False,
            pad_token_id=0,
        )
    return time.perf_counter() - t


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="auto", help="both sides (auto: kvserve's choice here)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--offline-runs", type=int, default=1, help="runs of offline-64")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-lora-rank", type=int, default=64)
    ap.add_argument("--capacity-memory", default="64MiB", help="KV memory of the capacity rows")
    plot.add_plot_arg(ap)
    args = ap.parse_args(argv)

    dtype = parse_dtype(args.dtype)
    name = str(dtype).removeprefix("torch.")
    with tempfile.TemporaryDirectory() as tmp:
        sizes = build_checkpoint(Path(tmp), args)
        llm = LLM(model=tmp, dtype=name)
        hf = None
        if not args.skip_hf:
            from transformers import AutoModelForCausalLM

            hf = AutoModelForCausalLM.from_pretrained(tmp, dtype=dtype).eval()
        results = run(llm, hf, args, sizes["vocab_size"])
        capacity = capacity_rows(llm, args)
    report(args, sizes, name, llm, results, capacity)


def run(llm: LLM, hf, args, vocab: int) -> dict[str, dict[str, float]]:
    import random

    prompt = random_prompt(random.Random(0), 128, vocab)
    prompts, outputs = workload_offline(args.num_requests, vocab)
    useful = sum(outputs)
    kvserve_decode(llm, prompt, 8)  # warm-up
    if hf is not None:
        hf_decode(hf, prompt, 8)
    sides = {"kvserve": llm, "hf": hf} if hf is not None else {"kvserve": llm}
    ttft: dict[str, list[float]] = {s: [] for s in sides}
    tps: dict[str, list[float]] = {s: [] for s in sides}
    for _ in range(args.runs):
        for side, target in sides.items():
            fn = kvserve_decode if side == "kvserve" else hf_decode
            first, total = fn(target, prompt, 128)
            ttft[side].append(first)
            tps[side].append(127 / max(total - first, 1e-9))
    offline: dict[str, list[float]] = {s: [] for s in sides}
    for _ in range(args.offline_runs):
        t = time.perf_counter()
        outs = llm.generate(prompts, [greedy(o) for o in outputs], use_tqdm=False)
        offline["kvserve"].append(useful / (time.perf_counter() - t))
        assert sum(len(o.token_ids) for o in outs) == useful
        if hf is not None:
            offline["hf"].append(useful / hf_offline(hf, prompts, outputs))
    return {
        side: {
            "ttft_ms": 1000 * statistics.median(ttft[side]),
            "decode_tok_s": statistics.median(tps[side]),
            "offline_tok_s": statistics.median(offline[side]),
        }
        for side in sides
    }


def capacity_rows(llm: LLM, args):
    from kvserve.config import parse_memory

    cfg = llm.engine.model_config
    sim = argparse.Namespace(block_size=16, max_num_seqs=256)
    workload = workload_offline(256, cfg.vocab_size)
    memory = parse_memory(args.capacity_memory)
    dtype = llm.session.model.dtype
    return [
        simulate(cfg, spec, memory, sim, cfg.max_model_len, workload, label)
        for label, spec in specs_for(cfg, "auto", dtype, 16)
    ]


def report(args, sizes: dict, name: str, llm: LLM, results, capacity) -> None:
    spec = llm.engine.spec
    title = (
        f"mla: random DeepseekV2 {sizes['num_hidden_layers']} layers, hidden "
        f"{sizes['hidden_size']}, {sizes['num_attention_heads']} heads, kv_lora_rank "
        f"{sizes['kv_lora_rank']}, rope {sizes['qk_rope_head_dim']}, nope "
        f"{sizes['qk_nope_head_dim']}, v {sizes['v_head_dim']}, {sizes['n_routed_experts']} "
        f"experts top-{sizes['num_experts_per_tok']} + {sizes['n_shared_experts']} shared, "
        f"vocab {sizes['vocab_size']}; dtype {name}, {torch.get_num_threads()} threads"
    )
    print(title)
    print(
        f"KV cache per token: {spec.bytes_per_token:,} B latent (MLA) vs "
        f"{spec.mha_equivalent_bytes_per_token:,} B as MHA "
        f"({spec.bytes_per_token / spec.mha_equivalent_bytes_per_token:.1%})"
    )
    print("| side | decode-1 TTFT (ms) | decode-1 tok/s | offline-64 tok/s |")
    print("|---|---|---|---|")
    for side, r in results.items():
        print(
            f"| {side} | {r['ttft_ms']:.1f} | {r['decode_tok_s']:.1f} | {r['offline_tok_s']:.1f} |"
        )
    if "hf" in results:
        k, h = results["kvserve"], results["hf"]
        print(
            f"kvserve / HF: decode-1 tok/s {k['decode_tok_s'] / h['decode_tok_s']:.2f}x, "
            f"TTFT {h['ttft_ms'] / k['ttft_ms']:.2f}x faster, "
            f"offline-64 tok/s {k['offline_tok_s'] / h['offline_tok_s']:.2f}x"
        )
    print(f"capacity at {args.capacity_memory} KV memory (256 offline requests, blocks of 16):")
    print("| cache | bytes/token | blocks | requests at once (max / median) | preemptions |")
    print("|---|---|---|---|---|")
    for r in capacity:
        print(
            f"| {r.cache_dtype} | {r.bytes_per_token:,} | {r.num_blocks:,} | "
            f"{r.max_running} / {r.median_running:.0f} | {r.preemptions} |"
        )
    if args.plot:
        sides = list(results)
        plot.figure(
            args.plot,
            title,
            [
                plot.Bars(sides, [results[s]["decode_tok_s"] for s in sides], "decode-1 tok/s"),
                plot.Bars(sides, [results[s]["offline_tok_s"] for s in sides], "offline tok/s"),
                plot.Bars(
                    [r.cache_dtype for r in capacity],
                    [r.max_running for r in capacity],
                    "requests at once (capacity)",
                ),
            ],
        )


if __name__ == "__main__":
    main()
