"""RequestLimits: the one check of a request against what an engine can run.

The server, ``LLM`` and the CLI all validate through it (vocabulary, prompt length, context
and KV-pool room, stop strings), so a limit and its message exist once. It is frozen plain
data read from the engine when it is built, so the server's handlers may call it on any
thread while the engine loop runs.

A refusal is a ``RequestRejected`` (a ValueError) that names the request field at fault
(``param``) and, where OpenAI has one, an error ``code``; the server turns it into a 400.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # no torch at import: the server's protocol reads MAX_N from here
    from kvserve.sampling import SamplingParams

MAX_N = 64  # samples per prompt (n): SamplingParams and the server's protocol both bound it


class RequestRejected(ValueError):
    """A request that can never run; ``param`` names the field to change."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.code = code


@dataclass(frozen=True, slots=True)
class RequestLimits:
    vocab_size: int
    max_model_len: int  # prompt + output tokens of one request
    num_blocks: int  # the KV pool: no request can outgrow it
    block_size: int
    has_tokenizer: bool
    # the most tokens one request can hold in the pool, when not num_blocks x block_size
    # (windowed layers give blocks back: kv/spec.py KVCacheSpec.max_tokens_for)
    pool_tokens: int | None = None

    @classmethod
    def dense(cls, vocab_size: int, max_model_len: int, has_tokenizer: bool) -> RequestLimits:
        """The limits of a dense (reference) cache: it holds the whole context, no pool."""
        return cls(vocab_size, max_model_len, max_model_len, 1, has_tokenizer)

    @property
    def max_tokens_in_pool(self) -> int:
        if self.pool_tokens is not None:
            return self.pool_tokens
        return self.num_blocks * self.block_size

    @property
    def max_request_tokens(self) -> int:
        """Prompt + output tokens one request may have: the context or the pool, the less."""
        return min(self.max_model_len, self.max_tokens_in_pool)

    def _what(self) -> str:
        limit = self.max_request_tokens
        if limit == self.max_model_len:
            return f"this model's maximum context length is {limit} tokens"
        return (
            f"the KV cache holds at most {limit} tokens per request ({self.num_blocks} blocks "
            f"of {self.block_size}; raise kv_cache_memory)"
        )

    def check_token_ids(self, ids: Sequence[int], param: str = "prompt") -> None:
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise RequestRejected(
                f"token id {bad} is outside the vocabulary [0, {self.vocab_size})", param
            )

    def room(self, prompt_len: int, prompt_param: str = "prompt") -> int:
        """Output tokens a prompt of this length leaves room for (at least 1, or refused)."""
        if prompt_len == 0:
            raise RequestRejected("the prompt is empty", prompt_param, "empty_prompt")
        if prompt_len >= self.max_request_tokens:
            raise RequestRejected(
                f"the prompt is {prompt_len} tokens, but {self._what()} (room is needed for at "
                "least one generated token)",
                prompt_param,
                "context_length_exceeded",
            )
        return self.max_request_tokens - prompt_len

    def resolve_max_tokens(
        self,
        requested: int | None,
        prompt_len: int,
        default: int | None = None,
        param: str = "max_tokens",
        prompt_param: str = "prompt",
    ) -> int:
        """The request's max_tokens, refused with both numbers when it cannot fit; when not
        given, ``default`` capped to the room left (None: all the room left, as vLLM's chat).
        ``param`` and ``prompt_param`` name the fields the caller sent, for the error."""
        room = self.room(prompt_len, prompt_param)
        if requested is None:
            return room if default is None else min(default, room)
        if requested > room:
            raise RequestRejected(
                f"{self._what()}, but {prompt_len + requested} tokens were requested "
                f"({prompt_len} in the prompt, {requested} for the completion); lower {param} "
                f"to at most {room}",
                param,
                "context_length_exceeded",
            )
        return requested

    def check_params(self, params: SamplingParams) -> None:
        """What of the params (validated ranges aside) this engine cannot honour."""
        self.check_token_ids(params.stop_token_ids, "stop_token_ids")
        if params.stop and not self.has_tokenizer:
            raise RequestRejected(
                "stop strings need a tokenizer; this model has none: use stop_token_ids", "stop"
            )

    def check(self, prompt_ids: Sequence[int], params: SamplingParams) -> None:
        """Everything about one prompt and its params that could stop it from ever running."""
        self.check_token_ids(prompt_ids, "prompt")
        self.check_params(params)
        self.resolve_max_tokens(params.max_tokens, len(prompt_ids))
