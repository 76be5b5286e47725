"""The per-request bounds of the server (``ServerConfig``): how deep its JSON body nests, how
many sequences, prompt tokens and stop strings one request may bring, each refused with a 400
naming its flag.

Plain functions of the config, so the route handlers and the body pre-check
(``body_check.py``, in another process) refuse with the same words.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from itertools import accumulate

from kvserve.server.config import ServerConfig
from kvserve.server.errors import bad_request

# a JSON string, escapes included (the unrolled form: no backtracking per character)
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_STEP = [1 if c in b"[{" else -1 if c in b"]}" else 0 for c in range(256)]  # per byte


def json_depth(raw: bytes) -> int:
    """How deep ``raw`` nests (``[`` and ``{`` levels outside strings), without parsing it:
    the parsers (json's, pydantic's) recurse per level, and a deep enough body makes them
    raise RecursionError. Linear, in C but for one pass over the brackets (~40 ns each)."""
    brackets = _JSON_STRING.sub(b"", raw).translate(None, _NOT_BRACKETS)
    return max(accumulate(map(_STEP.__getitem__, brackets)), default=0)


def check_json_depth(bounds: ServerConfig, raw: bytes) -> None:
    """Before any parsing, whatever the body's size."""
    limit = bounds.max_json_depth
    depth = json_depth(raw)
    if depth > limit:
        raise bad_request(
            f"the request body nests {depth} levels deep; the limit is {limit} (--max-json-depth)",
            None,
            "json_too_deep",
        )


def check_sequences(bounds: ServerConfig, num_prompts: int, n: int) -> None:
    """Before any tokenizing: the request's prompts, counted with their n samples."""
    limit = bounds.max_prompts_per_request
    if num_prompts * n > limit:
        what = f"{num_prompts} prompts" if n == 1 else f"{num_prompts} prompts x n={n}"
        raise bad_request(
            f"this request has {what} = {num_prompts * n} sequences; the limit is {limit} "
            "per request (--max-prompts-per-request)",
            "prompt" if n == 1 else "n",
            "too_many_prompts",
        )


def check_prompt_tokens(bounds: ServerConfig, total: int) -> None:
    limit = bounds.max_prompt_tokens_per_request
    if total > limit:
        raise bad_request(
            f"this request's prompts are {total} tokens together; the limit is {limit} "
            "per request (--max-prompt-tokens-per-request)",
            "prompt",
            "too_many_prompt_tokens",
        )


def check_stops(bounds: ServerConfig, stop: Sequence[str]) -> None:
    """Stop strings are scanned at every token of every sample: bound that work."""
    count, chars = len(stop), sum(len(s) for s in stop)
    if count > bounds.max_stop_strings:
        raise bad_request(
            f"{count} stop strings were sent; the limit is {bounds.max_stop_strings} "
            "(--max-stop-strings)",
            "stop",
        )
    if chars > bounds.max_stop_chars:
        raise bad_request(
            f"the stop strings are {chars} characters together; the limit is "
            f"{bounds.max_stop_chars} (--max-stop-chars)",
            "stop",
        )
