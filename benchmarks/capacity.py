"""capacity: at the same KV memory, how many requests run at once with paged blocks vs one
dense max_model_len buffer per request, and the share of allocated KV slots holding no token.

The paged side runs the real Scheduler and KVCacheManager over the offline workload (prompt
lengths uniform in [32, 512], outputs in [32, 256]) with a simulated model: scheduling does not
depend on token values when EOS is ignored, so the bookkeeping is exactly the engine's. Sizes
come from KVCacheSpec, the same function the engine allocates with.

    python -m benchmarks.capacity [--kv-cache-memory 256MiB] [--dtype bfloat16] [--num-requests 256]
"""

from __future__ import annotations

import argparse
import statistics

from benchmarks.common import workload_offline
from kvserve.config import SchedulerConfig, parse_memory
from kvserve.engine.output import append_token
from kvserve.engine.request import Request
from kvserve.engine.scheduler import Scheduler
from kvserve.kv.cache_dtype import CacheDtype
from kvserve.kv.manager import KVCacheManager
from kvserve.models.gguf_checkpoint import find_gguf_file, read_gguf_config
from kvserve.models.hf_checkpoint import read_hf_config
from kvserve.models.llama import kv_cache_spec
from kvserve.models.loader import parse_dtype, resolve_model_path
from kvserve.sampling import SamplingParams


def model_config(model: str | None):
    path = resolve_model_path(model)
    gguf = find_gguf_file(path)
    return read_gguf_config(gguf)[0] if gguf else read_hf_config(path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--kv-cache-memory", default="256MiB")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-model-len", type=int, default=None, help="default: the model's context")
    args = ap.parse_args()

    cfg = model_config(args.model)
    exact = CacheDtype.of(parse_dtype(args.dtype))
    spec = kv_cache_spec(cfg, exact, exact, args.block_size)
    memory = parse_memory(args.kv_cache_memory)
    num_blocks = spec.num_blocks_for(memory)
    max_model_len = args.max_model_len or cfg.max_model_len
    kv = KVCacheManager(num_blocks, args.block_size, enable_prefix_caching=False)
    sched = Scheduler(
        SchedulerConfig(
            args.max_num_seqs, max_num_batched_tokens=8192, max_model_len=max_model_len
        ),
        kv,
        max_model_len,
    )
    prompts, outputs = workload_offline(args.num_requests, cfg.vocab_size)
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

    dense_per_req = spec.bytes_per_token * max_model_len
    dense_max = memory // dense_per_req
    mean_tokens = statistics.mean(len(p) + o for p, o in zip(prompts, outputs, strict=True))
    print(
        f"capacity: model={cfg.model_type} dtype={args.dtype} KV memory={memory / 2**20:.0f} MiB "
        f"({spec.bytes_per_token} bytes/token, {num_blocks} blocks of {args.block_size}), "
        f"max_model_len={max_model_len}, {args.num_requests} offline requests "
        f"(mean prompt+output {mean_tokens:.0f} tokens)"
    )
    print(
        f"dense, one max_model_len buffer per request: {dense_max} requests at once, "
        f"slots holding no token at the mean request: {1 - mean_tokens / max_model_len:.1%}"
    )
    print(
        f"paged blocks: {max(running)} requests at once (max), {statistics.median(running):.0f} median; "
        f"slots allocated but empty: {statistics.mean(waste):.2%} mean, {max(waste):.2%} worst step; "
        f"preemptions {sched.num_preemptions}"
    )
    print(f"ratio paged / dense requests at once: {max(running) / max(dense_max, 1):.1f}x")


if __name__ == "__main__":
    main()
