"""kvserve command line: generate | chat | serve | verify | info.

The CLI owns the terminal: it parses flags, configures logging, prints. Everything it runs
lives in the library. ``generate`` and ``chat`` run on the paged engine; ``generate
--no-cache`` and ``verify`` use the reference decoders.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence

from kvserve.config import CacheConfig, EngineConfig, SchedulerConfig
from kvserve.engine.llm import LLM
from kvserve.engine.request import RequestOutput
from kvserve.kv.spec import parse_memory
from kvserve.models.loader import DTYPE_CHOICES
from kvserve.models.weight_formats import QUANTIZATIONS
from kvserve.sampling import SamplingParams
from kvserve.server.config import ServerConfig
from kvserve.session import ModelSession, generate_once
from kvserve.verify import verify

DEFAULT_MAX_TOKENS = 128  # the CLI's default; SamplingParams keeps vLLM's 16 for the API
_SP, _CACHE, _SCHED = SamplingParams(), CacheConfig(), SchedulerConfig()
_SERVER = ServerConfig()
_ENGINE = EngineConfig()


def _add_model_args(p: argparse.ArgumentParser) -> None:
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


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--kv-cache-memory",
        default=None,
        help="KV cache budget: bytes, GiB, or e.g. 2GiB / 512MiB (default 1GiB)",
    )
    p.add_argument(
        "--num-kv-blocks",
        type=int,
        default=None,
        help="KV cache size in blocks (overrides --kv-cache-memory)",
    )
    p.add_argument("--block-size", type=int, default=_CACHE.block_size)
    p.add_argument(
        "--enforce-eager",
        action="store_true",
        help="run the model step eagerly (no torch.compile; starts faster, steps slower)",
    )
    p.add_argument("--no-prefix-caching", action="store_true", help="disable the prefix cache")
    p.add_argument("--max-num-seqs", type=int, default=_SCHED.max_num_seqs)
    p.add_argument("--max-num-batched-tokens", type=int, default=_SCHED.max_num_batched_tokens)
    p.add_argument(
        "--max-model-len", type=int, default=None, help="default: the model's context length"
    )
    p.add_argument(
        "--scheduling-policy",
        default=_SCHED.scheduling_policy,
        choices=["fcfs", "lpm"],
        help="admission order: fcfs (arrival) or lpm (longest cached prefix first)",
    )


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS)
    p.add_argument("--temperature", type=float, default=_SP.temperature, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=_SP.top_p)
    p.add_argument("--top-k", type=int, default=_SP.top_k, help="0 = off")
    p.add_argument("--min-p", type=float, default=_SP.min_p)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")


def _sampling(args: argparse.Namespace, logprobs: int | None = None) -> SamplingParams:
    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        seed=args.seed,
        stop=tuple(args.stop),
        ignore_eos=args.ignore_eos,
        logprobs=logprobs,
    )


def _cache_config(args: argparse.Namespace) -> CacheConfig:
    memory = args.kv_cache_memory
    return CacheConfig(
        block_size=args.block_size,
        kv_cache_memory=None if memory is None else parse_memory(memory),
        num_blocks=args.num_kv_blocks,
        enable_prefix_caching=not args.no_prefix_caching,
    )


def _scheduler_config(args: argparse.Namespace) -> SchedulerConfig:
    return SchedulerConfig(
        args.max_num_seqs, args.max_num_batched_tokens, args.max_model_len, args.scheduling_policy
    )


def _open(args: argparse.Namespace, show_progress: bool) -> ModelSession:
    return ModelSession.open(
        args.model, args.dtype, args.device, show_progress, quantization=args.quantization
    )


def _llm(args: argparse.Namespace, session: ModelSession) -> LLM:
    return LLM(
        session=session,
        kv_cache_memory=args.kv_cache_memory,
        num_kv_blocks=args.num_kv_blocks,
        block_size=args.block_size,
        enable_prefix_caching=not args.no_prefix_caching,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        scheduling_policy=args.scheduling_policy,
        enforce_eager=args.enforce_eager,
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvserve", description="An LLM inference engine built around its KV cache."
    )
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="complete one prompt, streaming the text")
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompt-ids", help="prompt as comma-separated token ids, e.g. 1,2,3")
    g.add_argument(
        "--chat", action="store_true", help="wrap --prompt as a user message in the chat template"
    )
    _add_model_args(g)
    _add_engine_args(g)
    _add_sampling_args(g)
    g.add_argument(
        "--no-cache",
        action="store_true",
        help="reference decoder: recompute K/V of the whole sequence every step",
    )
    g.add_argument(
        "--logprobs",
        type=int,
        default=None,
        metavar="K",
        help="top-K logprobs per token (with --json)",
    )
    g.add_argument("--json", action="store_true", help="print one JSON object instead of streaming")

    c = sub.add_parser("chat", help="interactive multi-turn chat; each turn reuses the cache")
    _add_model_args(c)
    _add_engine_args(c)
    _add_sampling_args(c)
    c.add_argument("--system", default=None, help="system prompt")

    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    _add_model_args(s)
    _add_engine_args(s)
    s.add_argument("--host", default=_SERVER.host)
    s.add_argument("--port", type=int, default=_SERVER.port)
    s.add_argument(
        "--api-key", default=None, help="require 'Authorization: Bearer KEY' on every endpoint"
    )
    s.add_argument(
        "--served-model-name", default=None, help="the model id clients send (default: file name)"
    )
    s.add_argument(
        "--max-queued-requests",
        type=int,
        default=_SERVER.max_queued_requests,
        help="prompts waiting to start; beyond it requests get 503 with Retry-After",
    )
    s.add_argument(
        "--max-body-bytes",
        type=int,
        default=_SERVER.max_body_bytes,
        help="larger request bodies get 413",
    )
    s.add_argument(
        "--log-interval",
        type=float,
        default=_SERVER.log_interval_s,
        help="seconds between the running/waiting/KV usage log lines",
    )

    v = sub.add_parser("verify", help="no-cache vs cached decoding on the same prompt")
    _add_model_args(v)
    v.add_argument("--prompt", default="The key-value cache of a transformer stores")
    v.add_argument("--max-tokens", type=int, default=64)
    v.add_argument("--json", action="store_true")

    i = sub.add_parser(
        "info", help="this machine's CPU features, kernels, dtype auto, bandwidth, a model's paths"
    )
    _add_model_args(i)
    i.add_argument("--no-model", action="store_true", help="report the machine only")
    i.add_argument("--json", action="store_true")
    return parser


def _write(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def _cmd_generate(args: argparse.Namespace) -> int:
    params = _sampling(args, args.logprobs)  # validate flags before the slow model load
    session = _open(args, show_progress=not args.json)
    if args.prompt_ids is not None:
        try:
            prompt_ids = [int(x) for x in args.prompt_ids.split(",") if x.strip()]
        except ValueError as e:
            raise ValueError(
                f"--prompt-ids must be comma-separated integers, got {args.prompt_ids!r}"
            ) from e
    else:
        prompt_ids = session.encode_prompt(args.prompt, chat=args.chat)
    on_text = None if args.json else _write
    if args.no_cache:
        r = generate_once(session, prompt_ids, params, no_cache=True, on_text=on_text)
        token_ids, text, finish, cached = r.token_ids, r.text, r.finish_reason, 0
        projections, ttft, total = r.kv_projections, r.ttft_s, r.ttft_s + r.decode_s
        logprobs = r.logprobs
    else:
        out: RequestOutput | None = None
        for out in _llm(args, session).stream(prompt_ids, params):
            if on_text is not None and out.new_text:
                on_text(out.new_text)
        assert out is not None and out.finished
        token_ids, text, finish, cached = (
            out.token_ids,
            out.text,
            out.finish_reason,
            out.num_cached_tokens,
        )
        projections, ttft, total = out.kv_projections, out.ttft_s, out.ttft_s + out.decode_time_s
        logprobs = out.logprobs
    if args.json:
        result = {
            "token_ids": token_ids,
            "text": text,
            "prompt_tokens": len(prompt_ids),
            "completion_tokens": len(token_ids),
            "finish_reason": finish,
            "num_cached_tokens": cached,
            "kv_projections": projections,
            "ttft_s": ttft,
            "tokens_per_s": len(token_ids) / total if total > 0 else 0.0,
        }
        if logprobs is not None:
            result["logprobs"] = [{str(t): lp for t, lp in step.items()} for step in logprobs]
        print(json.dumps(result))
    else:
        decode_rate = (len(token_ids) - 1) / (total - ttft) if total > ttft else 0.0
        _write("\n")
        print(
            f"[{len(prompt_ids)} prompt tokens ({cached} cached) + {len(token_ids)} generated, "
            f"finish={finish}, TTFT {ttft * 1e3:.0f} ms, {decode_rate:.1f} tok/s decode]",
            file=sys.stderr,
        )
    return 0


def _cmd_chat(args: argparse.Namespace) -> int:
    params = _sampling(args)
    session = _open(args, show_progress=True)
    tokenizer = session.require_tokenizer()
    llm = _llm(args, session)
    messages = [{"role": "system", "content": args.system}] if args.system else []
    print("kvserve chat -- empty line or Ctrl-D to quit", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            break
        if not line.strip():
            break
        messages.append({"role": "user", "content": line})
        prompt = tokenizer.apply_chat_template(messages)
        out: RequestOutput | None = None
        try:
            for out in llm.stream(prompt, params):
                _write(out.new_text)
        except ValueError as e:  # e.g. the conversation outgrew max_model_len
            messages.pop()
            print(f"error: {e}", file=sys.stderr)
            continue
        _write("\n")
        assert out is not None
        messages.append({"role": "assistant", "content": out.text})
        if args.verbose:
            # the prefix cache works in whole blocks: reuse is the conversation so far, rounded
            # down to a block boundary
            print(
                f"[prompt {len(prompt)} tokens: {out.num_cached_tokens} reused from the cache, "
                f"{len(prompt) - out.num_cached_tokens} computed; {len(out.token_ids)} generated]",
                file=sys.stderr,
            )
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    from kvserve.server.launch import run_server  # FastAPI/uvicorn only when serving

    engine = EngineConfig(
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        quantization=args.quantization,
        enforce_eager=args.enforce_eager,
        cache=_cache_config(args),
        scheduler=_scheduler_config(args),
    )
    server = ServerConfig(
        host=args.host,
        port=args.port,
        api_key=args.api_key,
        served_model_name=args.served_model_name,
        max_queued_requests=args.max_queued_requests,
        max_body_bytes=args.max_body_bytes,
        log_interval_s=args.log_interval,
    )
    run_server(engine, server)
    return 0


def _cmd_verify(args: argparse.Namespace) -> int:
    session = _open(args, show_progress=not args.json)
    report = verify(session, args.prompt, args.max_tokens)
    if args.json:
        print(json.dumps(report.as_dict()))
    else:
        for line in report.lines():
            print(line)
    return 0 if report.same_tokens else 1


def _cmd_info(args: argparse.Namespace) -> int:
    from kvserve.info import collect_info

    session = None if args.no_model else _open(args, show_progress=False)
    report = collect_info(session, args.device)
    if args.json:
        print(json.dumps(report.as_dict()))
    else:
        for line in report.lines():
            print(line)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    serving = args.command == "serve"
    logging.basicConfig(
        # the server logs every finished request and a periodic load line at INFO, with times
        level=logging.INFO if args.verbose or serving else logging.WARNING,
        format=("%(asctime)s " if serving else "") + "%(levelname)s %(name)s: %(message)s",
    )
    commands = {
        "generate": _cmd_generate,
        "chat": _cmd_chat,
        "serve": _cmd_serve,
        "verify": _cmd_verify,
        "info": _cmd_info,
    }
    try:
        return commands[args.command](args)
    except (ValueError, TypeError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
