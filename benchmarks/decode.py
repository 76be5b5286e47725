"""decode-1 (../shared/docs/BENCHMARKS.md): one request, 128-token prompt, 128 new tokens, greedy,
ignore EOS. kvserve cached, kvserve no-cache and HF transformers (static cache) on the same
model and dtype, alternating in the same run; prints medians and ratios, and the decode step's
bytes read per second against this machine's measured memory bandwidth.

    python benchmarks/decode.py [--model PATH] [--dtype bfloat16] [--runs 3] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from kvserve.generation import generate
from kvserve.models.loader import load_model
from kvserve.reference import DenseCacheDecoder, NoCacheDecoder
from kvserve.sampling import SamplingParams


def measure_bandwidth(threads: int) -> float:
    """GB/s of summing a 1 GiB float32 tensor (read-only streaming), best of 5."""
    x = torch.ones(256 * 1024 * 1024, dtype=torch.float32)
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t)
    return x.nbytes / best / 1e9


def load_hf(loaded, dtype: torch.dtype):
    """HF transformers on the same weights. A GGUF file is first written out as an HF directory
    of its dequantized weights: transformers 5 keeps GGUF weights packed and dequantizes in
    every matmul, which would not be the dense-weight peer a user runs."""
    from transformers import AutoModelForCausalLM

    if loaded.gguf_file is None:
        return AutoModelForCausalLM.from_pretrained(loaded.path, dtype=dtype).eval()
    tmp = Path(tempfile.mkdtemp(prefix="kvserve-bench-hf-"))
    export_hf_dir(loaded, tmp)
    return AutoModelForCausalLM.from_pretrained(tmp, dtype=dtype).eval()


def export_hf_dir(loaded, out: Path) -> None:
    """config.json + model.safetensors with the loaded (dequantized) weights; names are HF's."""
    cfg = loaded.config
    state = {k: v.contiguous() for k, v in loaded.model.state_dict().items()}
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight")
    save_file(state, out / "model.safetensors")
    hf_cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama" if cfg.model_type == "smollm" else cfg.model_type,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "attention_bias": cfg.attention_bias,
    }
    (out / "config.json").write_text(json.dumps(hf_cfg))


def run_hf(model, prompt: list[int], new_tokens: int) -> tuple[float, float]:
    """(time to first token, total time) of HF generate with its static cache."""
    ids = torch.tensor([prompt])
    common = dict(do_sample=False, cache_implementation="static", pad_token_id=0)
    with torch.inference_mode():
        t = time.perf_counter()
        model.generate(ids, max_new_tokens=1, min_new_tokens=1, **common)
        ttft = time.perf_counter() - t
        t = time.perf_counter()
        out = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **common)
        total = time.perf_counter() - t
    assert out.shape[1] == len(prompt) + new_tokens
    return ttft, total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--skip-no-cache", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    loaded = load_model(args.model, args.dtype)
    model, cfg = loaded.model, loaded.config
    hf = load_hf(loaded, model.dtype)
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(100, cfg.vocab_size, (args.prompt_len,), generator=gen).tolist()
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    max_len = args.prompt_len + args.new_tokens

    rows: dict[str, list[tuple[float, float]]] = {
        "kvserve": [],
        "kvserve-no-cache": [],
        "hf-static": [],
    }
    for run in range(args.runs):  # alternate engines within each run
        r = generate(DenseCacheDecoder(model, max_len), prompt, params)
        rows["kvserve"].append((r.ttft_s, r.ttft_s + r.decode_s))
        if not args.skip_no_cache:
            r = generate(NoCacheDecoder(model), prompt, params)
            rows["kvserve-no-cache"].append((r.ttft_s, r.ttft_s + r.decode_s))
        rows["hf-static"].append(run_hf(hf, prompt, args.new_tokens))
        print(f"run {run + 1}/{args.runs} done", file=sys.stderr)

    bw = measure_bandwidth(args.threads)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    kv_row_bytes = cfg.kv_elements_per_token * model.dtype.itemsize
    avg_ctx = args.prompt_len + args.new_tokens / 2
    step_bytes = weight_bytes + kv_row_bytes * avg_ctx

    print(
        f"decode-1: model={loaded.path.name} dtype={args.dtype} threads={args.threads} "
        f"prompt={args.prompt_len} new={args.new_tokens} runs={args.runs} torch={torch.__version__}"
    )
    print(f"{'engine':<18}{'tok/s':>8}{'TTFT ms':>9}{'TPOT ms':>9}{'GB/s':>7}{'of BW':>7}")
    results = {}
    for name, vals in rows.items():
        if not vals:
            continue
        ttft = statistics.median(v[0] for v in vals)
        total = statistics.median(v[1] for v in vals)
        tpot = (total - ttft) / (args.new_tokens - 1)
        tps = args.new_tokens / total
        results[name] = tps
        gbs = step_bytes / tpot / 1e9
        print(
            f"{name:<18}{tps:>8.1f}{ttft * 1e3:>9.1f}{tpot * 1e3:>9.2f}{gbs:>7.1f}{gbs / bw:>7.0%}"
        )
    print(
        f"memory bandwidth (sum of 1 GiB float32, {args.threads} threads): {bw:.1f} GB/s; "
        f"decode step reads ~{step_bytes / 1e6:.0f} MB (weights + mean live KV)"
    )
    base = results["hf-static"]
    for name, tps in results.items():
        if name != "hf-static":
            print(f"ratio {name} / hf-static: {tps / base:.2f}x")


if __name__ == "__main__":
    main()
