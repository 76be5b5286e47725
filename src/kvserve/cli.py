"""kvserve command line: generate | chat | serve | cluster | plan | eval-cache | verify | info.

The CLI owns the terminal: it parses flags, configures logging, prints. Everything it runs
lives in the library. ``generate`` and ``chat`` run on the paged engine; ``generate
--no-cache`` and ``verify`` use the reference decoders.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvserve.cli_args import (
    add_engine_args,
    add_model_args,
    add_sampling_args,
    cache_config,
    make_llm,
    open_session,
    sampling_params,
    scheduler_config,
)
from kvserve.cluster import add_cluster_args
from kvserve.cluster import config_from_args as cluster_config_from_args
from kvserve.cluster import run as run_cluster
from kvserve.config import EngineConfig
from kvserve.engine.faults import FAULT_STEPS_ENV, FaultInjector
from kvserve.engine.limits import RequestLimits
from kvserve.engine.request import RequestOutput
from kvserve.eval_cache_cli import add_eval_cache_args, run_eval_cache
from kvserve.kv import cache_explain
from kvserve.plan_cli import add_plan_args, run_plan
from kvserve.reference.sessions import generate_once
from kvserve.reference.verify import verify
from kvserve.serve_args import add_serve_args, server_config
from kvserve.server.config import ServerConfig

if TYPE_CHECKING:
    from kvserve.models.model_session import ModelSession
    from kvserve.sampling import SamplingParams

_SERVER_PORT = ServerConfig().port  # the cluster's router takes the server's default port


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
    add_model_args(g)
    add_engine_args(g)
    add_sampling_args(g)
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
    g.add_argument(
        "--explain-cache",
        action="store_true",
        help="say how many prompt tokens came from the prefix cache and why not more",
    )
    g.add_argument("--json", action="store_true", help="print one JSON object instead of streaming")

    c = sub.add_parser("chat", help="interactive multi-turn chat; each turn reuses the cache")
    add_model_args(c)
    add_engine_args(c)
    add_sampling_args(c)
    c.add_argument("--system", default=None, help="system prompt")

    add_serve_args(sub.add_parser("serve", help="OpenAI-compatible HTTP server"))

    add_cluster_args(
        sub.add_parser(
            "cluster", help="N `kvserve serve` replicas behind SGLang's cache-aware router"
        ),
        default_port=_SERVER_PORT,
    )

    add_plan_args(
        sub.add_parser(
            "plan", help="the KV cache's bytes per token and request, and the requests that fit"
        )
    )

    add_eval_cache_args(
        sub.add_parser(
            "eval-cache",
            help="what each lossy KV cache costs against the exact one: perplexity, KL, top-1",
        )
    )
    v = sub.add_parser("verify", help="no-cache vs cached decoding on the same prompt")
    add_model_args(v)
    v.add_argument("--prompt", default="The key-value cache of a transformer stores")
    v.add_argument("--max-tokens", type=int, default=64)
    v.add_argument("--json", action="store_true")

    i = sub.add_parser(
        "info", help="this machine's CPU features, kernels, dtype auto, bandwidth, a model's paths"
    )
    add_model_args(i)
    i.add_argument("--no-model", action="store_true", help="report the machine only")
    i.add_argument("--json", action="store_true")
    return parser


def _write(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def _refuse_early(
    args: argparse.Namespace,
    session: ModelSession,
    prompt_ids: list[int],
    params: SamplingParams,
) -> None:
    """Refuse what the engine would refuse anyway (token ids outside the vocabulary, a
    request longer than the context) before building it: its compile takes seconds. The KV
    pool's own limit is the engine's to check, once it is built."""
    limit = session.config.max_model_len
    if args.streaming_window is not None or (args.max_model_len or 0) > limit:
        return  # the engine's length rules (or its error about the flag) apply
    limits = RequestLimits.dense(
        session.config.vocab_size, args.max_model_len or limit, session.tokenizer is not None
    )
    limits.check(prompt_ids, params)


def _cmd_generate(args: argparse.Namespace) -> int:
    params = sampling_params(args, args.logprobs)  # validate flags before the slow model load
    session = open_session(args, show_progress=not args.json)
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
    if args.no_cache and args.streaming_window is not None:
        print(
            "error: --no-cache runs the exact model; --streaming-window is the engine's",
            file=sys.stderr,
        )
        return 2
    if args.no_cache:
        r = generate_once(session, prompt_ids, params, no_cache=True, on_text=on_text)
        token_ids, text, finish, cached = r.token_ids, r.text, r.finish_reason, 0
        explanation = None  # no prefix cache on the no-cache path
        dropped = None
        projections, ttft, total = r.kv_projections, r.ttft_s, r.ttft_s + r.decode_s
        logprobs = r.logprobs
    else:
        out: RequestOutput | None = None
        _refuse_early(args, session, prompt_ids, params)
        llm = make_llm(args, session, "off")
        for out in llm.stream(prompt_ids, params, explain_cache=args.explain_cache):
            if on_text is not None and out.new_text:
                on_text(out.new_text)
        assert out is not None and out.finished
        if out.error is not None:  # the engine step it was in failed
            print(f"error: {out.error}", file=sys.stderr)
            return 1
        token_ids, text, finish, cached = (
            out.token_ids,
            out.text,
            out.finish_reason,
            out.num_cached_tokens,
        )
        projections, ttft, total = out.kv_projections, out.ttft_s, out.ttft_s + out.decode_time_s
        logprobs = out.logprobs
        explanation = out.kv_cache
        dropped = out.num_dropped_tokens
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
            "decode_s": total - ttft,
            "tokens_per_s": len(token_ids) / total if total > 0 else 0.0,
        }
        if logprobs is not None:
            result["logprobs"] = [{str(t): lp for t, lp in step.items()} for step in logprobs]
        if explanation is not None:
            result["kv_cache"] = cache_explain.as_dict(explanation, _decoder(session))
        if dropped is not None:  # --streaming-window: tokens the policy dropped
            result["num_dropped_tokens"] = dropped
        print(json.dumps(result))
    else:
        decode_rate = (len(token_ids) - 1) / (total - ttft) if total > ttft else 0.0
        _write("\n")
        print(
            f"[{len(prompt_ids)} prompt tokens ({cached} cached) + {len(token_ids)} generated, "
            f"finish={finish}, TTFT {ttft * 1e3:.0f} ms, {decode_rate:.1f} tok/s decode]",
            file=sys.stderr,
        )
        if explanation is not None:
            print(cache_explain.describe(explanation, _decoder(session)), file=sys.stderr)
    return 0


def _decoder(session):
    tok = session.tokenizer
    return None if tok is None else tok.decode


def _cmd_chat(args: argparse.Namespace) -> int:
    params = sampling_params(args)
    session = open_session(args, show_progress=True)
    tokenizer = session.require_tokenizer()
    llm = make_llm(args, session, "background")
    messages = [{"role": "system", "content": args.system}] if args.system else []
    print("kvserve chat -- empty line or Ctrl-D to quit", file=sys.stderr)
    try:
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
                for out in llm.stream(prompt, params, explain_cache=args.verbose):
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
                if out.kv_cache is not None:
                    print(cache_explain.describe(out.kv_cache, tokenizer.decode), file=sys.stderr)
    finally:
        llm.engine.close()  # a background compile must not outlive the process
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    from kvserve.server.launch import run_server  # FastAPI/uvicorn only when serving

    engine = EngineConfig(
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        quantization=args.quantization,
        enforce_eager=args.enforce_eager,
        compile_mode=args.compile_mode or EngineConfig().compile_mode,
        batch_invariant=args.batch_invariant,
        cache=cache_config(args),
        scheduler=scheduler_config(args),
    )
    server = server_config(args)
    # tests of fault containment make the model raise on chosen steps; read here only
    fault_steps = os.environ.get(FAULT_STEPS_ENV, "")
    faults = FaultInjector.parse(fault_steps)
    if faults is not None:
        logging.getLogger(__name__).warning(
            "%s=%s: the model will raise on those model steps", FAULT_STEPS_ENV, fault_steps
        )
    run_server(engine, server, faults)
    return 0


def _cmd_cluster(args: argparse.Namespace) -> int:
    return run_cluster(cluster_config_from_args(args))


def _cmd_verify(args: argparse.Namespace) -> int:
    session = open_session(args, show_progress=not args.json)
    report = verify(session, args.prompt, args.max_tokens)
    if args.json:
        print(json.dumps(report.as_dict()))
    else:
        for line in report.lines():
            print(line)
    return 0 if report.same_tokens else 1


def _cmd_info(args: argparse.Namespace) -> int:
    from kvserve.info import collect_info

    session = None if args.no_model else open_session(args, show_progress=False)
    report = collect_info(session, args.device)
    if args.json:
        print(json.dumps(report.as_dict()))
    else:
        for line in report.lines():
            print(line)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    serving = args.command in ("serve", "cluster")
    logging.basicConfig(
        # the server logs every finished request and a periodic load line at INFO, with times
        level=logging.INFO if args.verbose or serving else logging.WARNING,
        format=("%(asctime)s " if serving else "") + "%(levelname)s %(name)s: %(message)s",
    )
    commands = {
        "cluster": _cmd_cluster,
        "generate": _cmd_generate,
        "chat": _cmd_chat,
        "serve": _cmd_serve,
        "verify": _cmd_verify,
        "info": _cmd_info,
        "plan": run_plan,
        "eval-cache": run_eval_cache,
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
