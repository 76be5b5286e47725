"""SamplingParams (validated) and sampling: greedy, temperature, top-k, top-p, min-p, seed.

Filters apply in vLLM's order: temperature, then top-k, then top-p, then min-p. Greedy
(temperature below 1e-5, as vLLM) is argmax and ignores the filters. A seed makes a request's draws
reproducible: each request owns a ``torch.Generator`` seeded once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

MAX_N = 64  # samples per prompt
GREEDY_BELOW = 1e-5  # a temperature below this samples greedily


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to pick tokens and when to stop. Defaults follow vLLM."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k filter
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # return the top-K logprobs of every generated token
    n: int = 1  # samples of one prompt; they share the prompt's KV blocks (copy-on-write)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        for name in ("stop", "stop_token_ids"):
            try:
                object.__setattr__(self, name, tuple(getattr(self, name)))
            except TypeError as e:
                raise TypeError(f"{name} must be a sequence, got {getattr(self, name)!r}") from e
        if not isinstance(self.ignore_eos, bool):
            raise TypeError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        _check_int("max_tokens", self.max_tokens, 1, None)
        _check_float("temperature", self.temperature, 0.0, None)
        _check_float("top_p", self.top_p, 0.0, 1.0, low_open=True)
        _check_int("top_k", self.top_k, -1, None)
        _check_float("min_p", self.min_p, 0.0, 1.0)
        if self.seed is not None:
            _check_int("seed", self.seed, 0, 2**63 - 1)
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop must be non-empty strings, got {s!r}")
        for t in self.stop_token_ids:
            _check_int("stop_token_ids[]", t, 0, None)
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, 0, 20)
        _check_int("n", self.n, 1, MAX_N)

    @property
    def greedy(self) -> bool:
        # as vLLM: below 1e-5, logits / temperature overflows to inf and softmax to nan
        return self.temperature < GREEDY_BELOW


def _check_int(name: str, value: object, low: int, high: int | None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an integer, got {value!r}")
    if value < low or (high is not None and value > high):
        upper = "inf" if high is None else str(high)
        raise ValueError(f"{name} must be in [{low}, {upper}], got {value}")


def _check_float(
    name: str, value: object, low: float, high: float | None, low_open: bool = False
) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{name} must be a number, got {value!r}")
    bad_low = value <= low if low_open else value < low
    if not math.isfinite(value) or bad_low or (high is not None and value > high):
        left = "(" if low_open else "["
        upper = "inf)" if high is None else f"{high}]"
        raise ValueError(f"{name} must be in {left}{low}, {upper}, got {value}")


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator | None:
    if seed is None:
        return None
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    return g


def filtered_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Probabilities (vocab,) after temperature, top-k, top-p and min-p; zero outside support."""
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(), logits.shape[-1]).float()
    x = logits.float() / params.temperature
    vocab = x.shape[-1]
    if 0 < params.top_k < vocab:
        kth = torch.topk(x, params.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if params.top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        # keep the smallest prefix whose mass reaches top_p: drop a token when the mass
        # strictly before it already reaches top_p (the most likely token is always kept)
        before = torch.cumsum(sorted_p, dim=-1) - sorted_p
        drop_sorted = before >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
    if params.min_p > 0.0:
        probs = probs.masked_fill(probs < params.min_p * probs.max(), 0.0)
    total = probs.sum()
    if not torch.isfinite(total) or total <= 0:  # degenerate logits (all -inf, nan): argmax
        return torch.nn.functional.one_hot(logits.argmax(), logits.shape[-1]).float()
    return probs / total


def sample(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None
) -> int:
    """Next token id from next-token logits (vocab,)."""
    if params.greedy:
        return int(torch.argmax(logits))
    probs = filtered_probs(logits, params)
    return int(torch.multinomial(probs, 1, generator=generator))


def top_logprobs(logits: torch.Tensor, k: int, token: int | None = None) -> dict[int, float]:
    """The k most likely tokens of the model's own distribution (before any filter), best
    first; then, as vLLM, the sampled ``token`` when it is not among them (k + 1 entries)."""
    if k == 0 and token is None:
        return {}
    logp = torch.log_softmax(logits.float(), dim=-1)
    values, ids = torch.topk(logp, k)
    out = {int(i): float(v) for i, v in zip(ids, values, strict=True)}
    if token is not None and token not in out:
        out[token] = float(logp[token])
    return out
