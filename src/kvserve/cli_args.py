"""The command line's shared flags and the records built from them (configs, sampling,
the model session, the offline engine). Defaults come from the config records themselves, so
every default has one source."""

from __future__ import annotations

import argparse

from kvserve.config import (
    SCHEDULING_POLICIES,
    CacheConfig,
    EngineConfig,
    SchedulerConfig,
    parse_memory,
)
from kvserve.engine.compiled_steps import COMPILE_MODES
from kvserve.engine.llm import LLM
from kvserve.kv.cache_dtype import CACHE_DTYPE_NAMES
from kvserve.models.loader import DTYPE_CHOICES
from kvserve.models.model_session import ModelSession
from kvserve.models.weight_formats import QUANTIZATIONS
from kvserve.sampling import SamplingParams

DEFAULT_MAX_TOKENS = 128  # the CLI's default; SamplingParams keeps vLLM's 16 for the API
_SP, _CACHE, _SCHED = SamplingParams(), CacheConfig(), SchedulerConfig()
_ENGINE = EngineConfig()


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        default=None,
        help="HF directory or .gguf file (default: the embedded SmolLM2-135M-Instruct)",
    )
    p.add_argument(
        "--dtype",
        default=_ENGINE.dtype,
        choices=list(DTYPE_CHOICES),
        help="activations and KV cache dtype; auto: bfloat16 on CUDA and on CPUs with native "
        "bfloat16, else float32 (GGUF quantized weights stay quantized either way)",
    )
    p.add_argument(
        "--quantization",
        default=None,
        choices=list(QUANTIZATIONS),
        help="quantize a checkpoint's float weights at load (GGUF files keep their own)",
    )
    p.add_argument(
        "--device", default=None, help="torch device (default: cuda if available, else cpu)"
    )
    p.add_argument(
        "--verbose", "-v", action="store_true", help="log more (and per-turn cache reuse in chat)"
    )


# `kvserve serve` defaults for latency under shared load (vLLM likewise gives its API server
# other step defaults than its LLM class): batches yield to single requests, and a step with
# decodes in it stays short. Offline use (generate, LLM) keeps fcfs and the whole budget.
SERVE_SCHEDULING_POLICY = "priority"
SERVE_MAX_PREFILL_TOKENS_WITH_DECODES = 256


def add_engine_args(p: argparse.ArgumentParser, serving: bool = False) -> None:
    p.add_argument(
        "--kv-cache-memory",
        default=None,
        help="KV cache budget: 2GiB, 512MiB, 8GB, or bytes without a unit (default 1GiB)",
    )
    p.add_argument(
        "--num-kv-blocks",
        type=int,
        default=None,
        help="KV cache size in blocks (overrides --kv-cache-memory)",
    )
    p.add_argument("--block-size", type=int, default=_CACHE.block_size)
    p.add_argument(
        "--kv-cache-dtype",
        default=_CACHE.kv_cache_dtype,
        choices=CACHE_DTYPE_NAMES,
        help="what K and V are stored as: auto (the model dtype, exact) or a lossy int8, int4 "
        "(q4_1-like), int4_sym (q4_0-like), fp8_e4m3; kvserve eval-cache says what each costs",
    )
    for side in ("k", "v"):
        p.add_argument(
            f"--{side}-cache-dtype",
            default=None,
            choices=CACHE_DTYPE_NAMES,
            help=f"{side.upper()} alone (overrides --kv-cache-dtype for {side.upper()})",
        )
    p.add_argument(
        "--streaming-window",
        type=int,
        default=None,
        metavar="W",
        help="StreamingLLM (lossy): full-attention layers keep only the last W tokens and the "
        "first --streaming-sinks, give the rest of their blocks back, and a request may run "
        "past the model's context in flat memory; usage reports the tokens dropped",
    )
    p.add_argument(
        "--streaming-sinks",
        type=int,
        default=_CACHE.streaming_sinks,
        metavar="S",
        help=f"attention sinks kept with --streaming-window (default {_CACHE.streaming_sinks})",
    )
    p.add_argument(
        "--enforce-eager",
        action="store_true",
        help="run the model step eagerly (no torch.compile; same as --compile-mode off)",
    )
    p.add_argument(
        "--compile-mode",
        choices=COMPILE_MODES,
        default=None,
        help="torch.compile of the model step (prefill ~5-10%% faster; decode runs the fused "
        "kernel either way): sync (before the first step), background (eager until compiled; "
        "the default of chat and serve) or off (the default of generate, where one prompt "
        "never repays the compile)",
    )
    p.add_argument(
        "--batch-invariant",
        action="store_true",
        help="the same logits, bit for bit, whatever a request's batch, prefill chunking, "
        "prefix-cache hits or preemptions: every matmul in one fixed order, every step through "
        "the fused kernel (a bfloat16 quantized Llama-family model on an AVX-512-BF16 CPU; "
        "prefill is slower, see the README)",
    )
    p.add_argument("--no-prefix-caching", action="store_true", help="disable the prefix cache")
    p.add_argument("--max-num-seqs", type=int, default=_SCHED.max_num_seqs)
    p.add_argument("--max-num-batched-tokens", type=int, default=_SCHED.max_num_batched_tokens)
    p.add_argument(
        "--max-model-len", type=int, default=None, help="default: the model's context length"
    )
    p.add_argument(
        "--scheduling-policy",
        default=SERVE_SCHEDULING_POLICY if serving else _SCHED.scheduling_policy,
        choices=list(SCHEDULING_POLICIES),
        help="admission order: fcfs (arrival), lpm (longest cached prefix first) or priority "
        "(lowest priority first; the server gives a batch's k-th prompt priority k, so "
        "batches yield to single requests)",
    )
    p.add_argument(
        "--max-prefill-tokens-with-decodes",
        type=int,
        default=SERVE_MAX_PREFILL_TOKENS_WITH_DECODES if serving else None,
        help="a step that carries decodes takes at most this many prefill tokens (bounds "
        "inter-token latency while prompts are prefilled; default: "
        + ("%(default)s" if serving else "the whole --max-num-batched-tokens")
        + ")",
    )


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS)
    p.add_argument("--temperature", type=float, default=_SP.temperature, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=_SP.top_p)
    p.add_argument("--top-k", type=int, default=_SP.top_k, help="0 = off")
    p.add_argument("--min-p", type=float, default=_SP.min_p)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument(
        "--presence-penalty",
        type=float,
        default=_SP.presence_penalty,
        help="[-2, 2]: subtracted from the logit of every token already generated",
    )
    p.add_argument(
        "--frequency-penalty",
        type=float,
        default=_SP.frequency_penalty,
        help="[-2, 2]: subtracted once per time a token was already generated",
    )
    p.add_argument(
        "--repetition-penalty",
        type=float,
        default=_SP.repetition_penalty,
        help="> 0, 1 = off: divides the positive logits of tokens seen in prompt or output "
        "(multiplies the negative ones)",
    )
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")


def sampling_params(args: argparse.Namespace, logprobs: int | None = None) -> SamplingParams:
    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        seed=args.seed,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        repetition_penalty=args.repetition_penalty,
        stop=tuple(args.stop),
        ignore_eos=args.ignore_eos,
        logprobs=logprobs,
    )


def cache_config(args: argparse.Namespace) -> CacheConfig:
    memory = args.kv_cache_memory
    return CacheConfig(
        block_size=args.block_size,
        kv_cache_memory=None if memory is None else parse_memory(memory, "--kv-cache-memory"),
        num_blocks=args.num_kv_blocks,
        enable_prefix_caching=not args.no_prefix_caching,
        kv_cache_dtype=args.kv_cache_dtype,
        k_cache_dtype=args.k_cache_dtype,
        v_cache_dtype=args.v_cache_dtype,
        streaming_window=args.streaming_window,
        streaming_sinks=args.streaming_sinks,
    )


def scheduler_config(args: argparse.Namespace) -> SchedulerConfig:
    return SchedulerConfig(
        args.max_num_seqs,
        args.max_num_batched_tokens,
        args.max_model_len,
        args.scheduling_policy,
        args.max_prefill_tokens_with_decodes,
    )


def open_session(args: argparse.Namespace, show_progress: bool) -> ModelSession:
    return ModelSession.open(
        args.model, args.dtype, args.device, show_progress, quantization=args.quantization
    )


def make_llm(
    args: argparse.Namespace, session: ModelSession, default_compile_mode: str = "sync"
) -> LLM:
    """The engine of ``generate``/``chat``; ``default_compile_mode`` unless --compile-mode."""
    return LLM(
        session=session,
        kv_cache_memory=args.kv_cache_memory,
        num_kv_blocks=args.num_kv_blocks,
        block_size=args.block_size,
        enable_prefix_caching=not args.no_prefix_caching,
        kv_cache_dtype=args.kv_cache_dtype,
        k_cache_dtype=args.k_cache_dtype,
        v_cache_dtype=args.v_cache_dtype,
        streaming_window=args.streaming_window,
        streaming_sinks=args.streaming_sinks,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        scheduling_policy=args.scheduling_policy,
        max_prefill_tokens_with_decodes=args.max_prefill_tokens_with_decodes,
        enforce_eager=args.enforce_eager,
        compile_mode=args.compile_mode or default_compile_mode,
        batch_invariant=args.batch_invariant,
    )
