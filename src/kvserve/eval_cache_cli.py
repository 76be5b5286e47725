"""`kvserve eval-cache`'s flags and output (the measuring is eval_cache.py's)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from kvserve.cli_args import add_model_args, open_session
from kvserve.eval_cache import (
    DEFAULT_PROMPTS,
    DEFAULT_VARIANTS,
    CacheVariant,
    default_text,
    evaluate,
    table,
    window_variants,
)
from kvserve.kv.cache_dtype import CACHE_DTYPE_NAMES


def add_eval_cache_args(p: argparse.ArgumentParser) -> None:
    add_model_args(p)
    p.add_argument("--text", type=Path, default=None, help="a UTF-8 text (default: shipped prose)")
    p.add_argument(
        "--kv-cache-dtype",
        nargs="*",
        default=None,
        metavar="DTYPE",
        help="variants to compare with the exact cache: a dtype for K and V, or K/V apart as "
        "int4/int8 (default: int8 int4 int4_sym fp8_e4m3 int4/int8 int8/int4; none: the flag "
        "with no value)",
    )
    p.add_argument(
        "--window",
        nargs="*",
        type=int,
        default=[256, 1024],
        metavar="W",
        help="StreamingLLM rows per size W: a window of W tokens alone, and --sinks sinks + a "
        "window of W - sinks (default: 256 1024; none: --window with no value)",
    )
    p.add_argument("--sinks", type=int, default=4, help="attention sinks of the window rows")
    p.add_argument("--max-text-tokens", type=int, default=4096, help="cut the text here")
    p.add_argument("--chunk", type=int, default=256, help="prefill chunk (tokens)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="greedy tokens per prompt")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--json", action="store_true")


def parse_variant(text: str) -> CacheVariant:
    names = text.split("/")
    if len(names) > 2 or any(n not in CACHE_DTYPE_NAMES for n in names):
        raise ValueError(
            f"a cache variant is one of {', '.join(CACHE_DTYPE_NAMES)} or K/V as int4/int8, "
            f"got {text!r}"
        )
    k, v = names[0], names[-1]
    return CacheVariant(k if k == v else f"K {k} + V {v}", k, v)


def run_eval_cache(args: argparse.Namespace) -> int:
    session = open_session(args, show_progress=False)
    tok = session.require_tokenizer()
    text = args.text.read_text("utf-8") if args.text is not None else default_text()
    ids = tok.encode(text)[: args.max_text_tokens]
    if args.kv_cache_dtype is None:
        variants = [CacheVariant(*v) for v in DEFAULT_VARIANTS[1:]]
    else:
        variants = [parse_variant(v) for v in args.kv_cache_dtype]
    variants += window_variants(args.window, args.sinks)
    prompts = [session.encode_prompt(p, chat=False) for p in DEFAULT_PROMPTS]
    report = evaluate(
        session.model, ids, variants, prompts, args.max_new_tokens, args.chunk, args.block_size
    )
    if args.json:
        rows = [r.as_dict() for r in report.rows]
        print(
            json.dumps(
                {
                    "model": str(session.path),
                    "dtype": str(session.model.dtype).removeprefix("torch."),
                    "text_tokens": report.text_tokens,
                    "chunk": report.chunk,
                    "generated_tokens": report.generated_tokens,
                    "rows": rows,
                }
            )
        )
        return 0
    print(f"{session.path.name}, {str(session.model.dtype).removeprefix('torch.')} activations")
    for line in table(report):
        print(line)
    return 0
