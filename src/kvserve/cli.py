"""kvserve command line: generate | chat | verify.

The CLI owns the terminal: it parses flags, configures logging, prints. Everything it runs
lives in the library.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence

from kvserve.models.loader import DTYPES
from kvserve.sampling import SamplingParams
from kvserve.session import ModelSession, chat_turn, generate_once, new_conversation
from kvserve.verify import verify

DEFAULT_MAX_TOKENS = 128  # the CLI's default; SamplingParams keeps vLLM's 16 for the API
_SP = SamplingParams()


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="HF directory or .gguf file (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="float32", choices=list(DTYPES), help="weights and KV cache dtype")
    p.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    p.add_argument("--verbose", "-v", action="store_true", help="log more (and per-turn cache reuse in chat)")


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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvserve", description="An LLM inference engine built around its KV cache.")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="complete one prompt, streaming the text")
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompt-ids", help="prompt as comma-separated token ids, e.g. 1,2,3")
    g.add_argument("--chat", action="store_true", help="wrap --prompt as a user message in the chat template")
    _add_model_args(g)
    _add_sampling_args(g)
    g.add_argument("--no-cache", action="store_true", help="recompute K/V of the whole sequence every step")
    g.add_argument("--logprobs", type=int, default=None, metavar="K", help="top-K logprobs per token (with --json)")
    g.add_argument("--json", action="store_true", help="print one JSON object instead of streaming")

    c = sub.add_parser("chat", help="interactive multi-turn chat; each turn reuses the cache")
    _add_model_args(c)
    _add_sampling_args(c)
    c.add_argument("--system", default=None, help="system prompt")
    c.add_argument("--max-model-len", type=int, default=4096, help="cache capacity in tokens")

    v = sub.add_parser("verify", help="no-cache vs cached decoding on the same prompt")
    _add_model_args(v)
    v.add_argument("--prompt", default="The key-value cache of a transformer stores")
    v.add_argument("--max-tokens", type=int, default=64)
    v.add_argument("--json", action="store_true")
    return parser


def _cmd_generate(args: argparse.Namespace) -> int:
    session = ModelSession.open(args.model, args.dtype, args.device, show_progress=not args.json)
    if args.prompt_ids is not None:
        try:
            prompt_ids = [int(x) for x in args.prompt_ids.split(",") if x.strip()]
        except ValueError as e:
            raise ValueError(f"--prompt-ids must be comma-separated integers, got {args.prompt_ids!r}") from e
    else:
        prompt_ids = session.encode_prompt(args.prompt, chat=args.chat)
    params = _sampling(args, args.logprobs)

    def stream(text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    result = generate_once(session, prompt_ids, params, no_cache=args.no_cache, on_text=None if args.json else stream)
    if args.json:
        out = {
            "token_ids": result.token_ids,
            "text": result.text,
            "prompt_tokens": result.prompt_tokens,
            "completion_tokens": result.completion_tokens,
            "finish_reason": result.finish_reason,
            "kv_projections": result.kv_projections,
            "ttft_s": result.ttft_s,
            "tokens_per_s": result.tokens_per_s,
        }
        if result.logprobs is not None:
            out["logprobs"] = [{str(t): lp for t, lp in step.items()} for step in result.logprobs]
        print(json.dumps(out))
    else:
        sys.stdout.write("\n")
        print(
            f"[{result.prompt_tokens} prompt + {result.completion_tokens} generated tokens, "
            f"finish={result.finish_reason}, TTFT {result.ttft_s * 1e3:.0f} ms, "
            f"{result.decode_tokens_per_s:.1f} tok/s decode]",
            file=sys.stderr,
        )
    return 0


def _cmd_chat(args: argparse.Namespace) -> int:
    session = ModelSession.open(args.model, args.dtype, args.device, show_progress=True)
    params = _sampling(args)
    conversation = new_conversation(session, args.system, args.max_model_len)
    print("kvserve chat -- empty line or Ctrl-D to quit", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            break
        if not line.strip():
            break

        def stream(text: str) -> None:
            sys.stdout.write(text)
            sys.stdout.flush()

        turn = chat_turn(session, conversation, line, params, on_text=stream)
        sys.stdout.write("\n")
        if args.verbose:
            print(
                f"[prompt {turn.prompt_tokens} tokens: {turn.reused_tokens} reused from the cache, "
                f"{turn.computed_tokens} computed; {turn.completion_tokens} generated; "
                f"cache holds {turn.cache_tokens}/{args.max_model_len} tokens]",
                file=sys.stderr,
            )
    return 0


def _cmd_verify(args: argparse.Namespace) -> int:
    session = ModelSession.open(args.model, args.dtype, args.device, show_progress=not args.json)
    report = verify(session, args.prompt, args.max_tokens)
    if args.json:
        print(json.dumps(report.as_dict()))
    else:
        for line in report.lines():
            print(line)
    return 0 if report.same_tokens else 1


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    commands = {"generate": _cmd_generate, "chat": _cmd_chat, "verify": _cmd_verify}
    try:
        return commands[args.command](args)
    except (ValueError, TypeError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
