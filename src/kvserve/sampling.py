"""SamplingParams (validated) and the batched sampler: penalties, greedy, temperature, top-k,
top-p, min-p, seed; the top logprobs of the model's own distribution.

One step samples every request in one call, ``sample_batch(logits (B, V), params,
generators, histories)``: the rows with presence / frequency / repetition penalties have them
applied first (``penalties.py``, over each row's token history; greedy rows too); then greedy
rows are an argmax (no softmax); the other rows go through one vectorized pipeline with
per-row parameters as tensors and one softmax. Filters apply in vLLM's order: temperature,
then top-k, then top-p, then min-p. Greedy (temperature below 1e-5, as vLLM) ignores the
filters. Logprobs are the raw model's (before penalties and filters), as vLLM's default. The single-sequence loop calls the same code with B = 1.

A draw is by the inverse CDF: one uniform u per row, token = the first i with
cumsum(probs)[i] > u * sum(probs), which picks token i with probability probs[i] and never a
token of probability 0. One random number per row, not one per vocabulary entry: vLLM's
exponential race (argmax(probs / q), q ~ Exp(1) per token) costs 3M exponentials at 64 rows of
a 49k vocabulary, ~47 ms on a 2-core CPU, against ~2 ms for the cumsum. A seeded request draws
its u from its own ``torch.Generator`` (seeded once), and every step of the pipeline is
row-wise, so its tokens do not depend on what else is in the batch. Unseeded rows share the
global RNG.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from kvserve.engine.limits import MAX_N
from kvserve.kernels.row_argmax import row_argmax
from kvserve.penalties import TokenHistory, apply_penalties

GREEDY_BELOW = 1e-5  # a temperature below this samples greedily


class RequestOutputKind(enum.Enum):
    """What each RequestOutput of a request carries (vLLM's names). Every output has the
    step's delta (``new_token_ids``, ``new_text``, ``new_logprobs``); the whole lists
    (``token_ids``, ``text``, ``logprobs``) cost O(tokens so far) to build, so only
    CUMULATIVE builds them at every step."""

    CUMULATIVE = 0  # every output: the delta and the whole lists so far (O(T^2) per request)
    DELTA = 1  # every output: the delta; the final one also the whole lists (O(T))
    FINAL_ONLY = 2  # one output, when the request finishes, with the whole lists


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
    # vLLM's: the top-K logprobs (and the actual token's) at every prompt position but the
    # first; such a request skips the prefix-cache hit (its positions must be computed)
    prompt_logprobs: int | None = None
    n: int = 1  # samples of one prompt; they share the prompt's KV blocks (copy-on-write)
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # OpenAI's, over output tokens: logit -= presence * (count > 0) + frequency * count
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # HF's / vLLM's, over prompt + output tokens: logit / p if positive, else logit * p
    repetition_penalty: float = 1.0

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
        if self.prompt_logprobs is not None:
            _check_int("prompt_logprobs", self.prompt_logprobs, 0, 20)
        _check_int("n", self.n, 1, MAX_N)
        _check_float("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _check_float("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        _check_float("repetition_penalty", self.repetition_penalty, 0.0, None, low_open=True)
        if not isinstance(self.output_kind, RequestOutputKind):
            raise TypeError(f"output_kind must be a RequestOutputKind, got {self.output_kind!r}")

    @property
    def greedy(self) -> bool:
        # as vLLM: below 1e-5, logits / temperature overflows to inf and softmax to nan
        return self.temperature < GREEDY_BELOW

    @property
    def has_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )


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


class _RowParams(NamedTuple):
    """Per-row filter parameters of the non-greedy rows, as (R, 1) columns on the device."""

    temperature: torch.Tensor  # float32
    top_k: torch.Tensor | None  # long in [1, V]: V keeps all; None when no row filters
    top_p: torch.Tensor | None  # float32; inf keeps all; None when no row filters
    min_p: torch.Tensor | None  # float32; 0 keeps all; None when no row filters
    max_top_k: int  # the largest k of the rows that filter by top-k (0: none)

    @classmethod
    def of(cls, params: Sequence[SamplingParams], vocab: int, device: torch.device) -> _RowParams:
        def col(values: list, dtype: torch.dtype, active: bool) -> torch.Tensor | None:
            return torch.tensor(values, dtype=dtype, device=device)[:, None] if active else None

        ks = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
        # top_p = 1 must keep everything, also where a cumulative sum rounds past 1.0
        ps = [p.top_p if p.top_p < 1.0 else math.inf for p in params]
        mins = [p.min_p for p in params]
        max_top_k = max((k for k in ks if k < vocab), default=0)
        return cls(
            col([p.temperature for p in params], torch.float32, True),
            col(ks, torch.long, max_top_k > 0),
            col(ps, torch.float32, any(p < math.inf for p in ps)),
            col(mins, torch.float32, any(m > 0.0 for m in mins)),
            max_top_k,
        )


def _filtered_probs(logits: torch.Tensor, rp: _RowParams) -> torch.Tensor:
    """Non-greedy rows' logits (R, V) -> probabilities (R, V) float32 after temperature,
    top-k, top-p and min-p, renormalised; a row whose mass is not finite and positive (all
    -inf, nan) is the one-hot of its argmax.

    Every operation is row-wise and a filter that a row does not use leaves it bit for bit
    unchanged (no k-th value, top_p = inf, min_p = 0), so a row's result never depends on
    the others in the batch.
    """
    vocab = logits.shape[-1]
    x = logits.float() / rp.temperature  # (R, V)
    order = None
    if rp.top_p is not None:
        # stable: ties are ordered by token id, whatever the batch
        sorted_x, order = torch.sort(x, dim=-1, descending=True, stable=True)  # (R, V)
    if rp.top_k is not None:
        # the k-th largest value; without top-p, the max_top_k largest suffice (no full sort)
        top = sorted_x if order is not None else torch.topk(x, rp.max_top_k, dim=-1).values
        kth = top.gather(1, rp.top_k.clamp(max=top.shape[-1]) - 1)  # (R, 1)
        kth = kth.masked_fill(rp.top_k >= vocab, float("-inf"))  # rows without top-k
        x = x.masked_fill(x < kth, float("-inf"))  # ties with the k-th value are kept
    probs = torch.softmax(x, dim=-1)  # (R, V): the one softmax, in vocab order
    if rp.top_p is not None:
        assert order is not None
        # softmax is monotone, so x's order is the probabilities' order (masked ones last)
        sorted_p = probs.gather(1, order)  # (R, V) descending
        # keep the smallest prefix whose mass reaches top_p: drop a token when the mass
        # strictly before it already reaches top_p (the most likely token is always kept)
        before = torch.cumsum(sorted_p, dim=-1) - sorted_p
        drop = torch.zeros_like(before, dtype=torch.bool).scatter_(1, order, before >= rp.top_p)
        probs = probs.masked_fill(drop, 0.0)
    if rp.min_p is not None:
        best = probs.amax(dim=-1, keepdim=True)  # (R, 1)
        probs = probs.masked_fill(probs < rp.min_p * best, 0.0)
    total = probs.sum(dim=-1, keepdim=True)  # (R, 1)
    ok = torch.isfinite(total) & (total > 0)
    fallback = torch.nn.functional.one_hot(logits.argmax(dim=-1), logits.shape[-1]).float()
    return torch.where(ok, probs / total, fallback)


def _uniform(generators: Sequence[torch.Generator | None], device: torch.device) -> torch.Tensor:
    """u ~ U[0, 1) of shape (R,): a seeded row from its own generator, the rest from the global
    RNG in one call."""
    u = torch.rand(len(generators), device=device)
    for i, g in enumerate(generators):
        if g is not None:
            u[i] = torch.rand(1, generator=g, device=device)[0]
    return u


def _draw(probs: torch.Tensor, generators: Sequence[torch.Generator | None]) -> torch.Tensor:
    """One token per row of probs (R, V), row i with probability probs[i] / sum."""
    cum = probs.cumsum(dim=-1)  # (R, V)
    total = cum[:, -1:]  # (R, 1)
    u = _uniform(generators, probs.device)[:, None] * total
    # strictly below the total, so the first cum > u exists and has probability > 0
    u = torch.minimum(u, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cum, u, right=True).squeeze(1)


def sample_batch(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
    histories: Sequence[TokenHistory] | None = None,
) -> torch.Tensor:
    """Next token ids (B,) long from next-token logits (B, V) float32, one row per request
    with its params, generator (None: the global RNG) and token history (prompt + output so
    far, read only by rows with penalties; None: no row has any)."""
    assert logits.dim() == 2 and len(params) == len(generators) == logits.shape[0]
    logits = apply_penalties(logits, params, histories)  # the same tensor without penalties
    tokens = row_argmax(logits)  # (B,): the greedy rows' answer, the others' overwritten
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if not rows:
        return tokens
    idx = torch.tensor(rows, device=logits.device)
    sub = logits if len(rows) == len(params) else logits[idx]  # (R, V)
    rp = _RowParams.of([params[i] for i in rows], logits.shape[-1], logits.device)
    probs = _filtered_probs(sub, rp)
    drawn = _draw(probs, [generators[i] for i in rows])  # (R,)
    return tokens.index_copy_(0, idx, drawn)


def batch_logprobs(
    logits: torch.Tensor, ks: Sequence[int | None], tokens: torch.Tensor | None = None
) -> list[dict[int, float] | None]:
    """Per row of logits (B, V): None where ``ks[i]`` is None; else the ``ks[i]`` most likely
    tokens of the model's own distribution (before any filter), best first (ties by token
    id), then, as vLLM, the sampled ``tokens[i]`` when it is not among them (k + 1 entries)."""
    rows = [i for i, k in enumerate(ks) if k is not None]
    out: list[dict[int, float] | None] = [None] * len(ks)
    if not rows:
        return out
    idx = torch.tensor(rows, device=logits.device)
    sub = logits if len(rows) == len(ks) else logits[idx]  # (R, V)
    logp = torch.log_softmax(sub.float(), dim=-1)  # (R, V)
    k_max = max(ks[i] for i in rows)  # type: ignore[type-var]
    values, ids = torch.topk(logp, k_max, dim=-1)  # (R, k_max), best first
    # ties (common with bfloat16 logits) in token id order, as argmax breaks them: a greedy
    # token is then first among the logprobs that equal its own
    ids, perm = ids.sort(dim=-1)
    values, perm = values.gather(1, perm).sort(dim=-1, descending=True, stable=True)
    ids = ids.gather(1, perm)
    # one transfer to Python for the whole batch
    values_l, ids_l = values.tolist(), ids.tolist()
    chosen_l: list[list[float]] = []
    toks_l: list[int] = []
    if tokens is not None:
        toks = tokens[idx]  # (R,)
        chosen_l, toks_l = logp.gather(1, toks[:, None]).tolist(), toks.tolist()
    for r, i in enumerate(rows):
        k = ks[i]
        top = dict(zip(ids_l[r][:k], values_l[r][:k], strict=True))
        if tokens is not None and toks_l[r] not in top:
            top[toks_l[r]] = chosen_l[r][0]
        out[i] = top
    return out


class SampledTokens(NamedTuple):
    token_ids: list[int]  # (B,)
    logprobs: list[dict[int, float] | None]  # (B,): None where the request asked for none


def as_batch(rows: Sequence[torch.Tensor]) -> torch.Tensor:
    """(B, vocab) from B rows (vocab,). The engine's rows are usually the consecutive rows of
    the runner's one logits tensor, in order: then a view of that tensor, not a copy (at
    batch 64 the copy is 12.6 MB, every step). Anything else (a forked sibling repeating a
    row, rows of separate tensors) is stacked. The check reads storage offsets, not
    ``Tensor._base``: the runner makes its rows under inference mode, whose views have none."""
    first = rows[0]
    if len(rows) == 1:
        return first[None]
    vocab, start = first.shape[-1], first.storage_offset()
    storage = first.untyped_storage().data_ptr()
    if all(
        r.dim() == 1
        and r.shape[0] == vocab
        and r.stride(0) == 1
        and r.dtype == first.dtype
        and r.device == first.device
        and r.storage_offset() == start + i * vocab
        and r.untyped_storage().data_ptr() == storage
        for i, r in enumerate(rows)
    ):
        return first.as_strided((len(rows), vocab), (vocab, 1), start)
    return torch.stack(list(rows))


def sample_step(
    rows: Sequence[torch.Tensor],
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
    histories: Sequence[TokenHistory] | None = None,
) -> SampledTokens:
    """One step of B requests: their next-token logits (vocab,) each, stacked once into
    (B, vocab), sampled in one call, with the logprobs of those that ask in another. The
    engine calls it with its batch (its requests are the histories), the single-sequence
    loop with B = 1."""
    logits = as_batch(rows)  # (B, vocab)
    tokens = sample_batch(logits, params, generators, histories)
    logprobs = batch_logprobs(logits, [p.logprobs for p in params], tokens)
    return SampledTokens(tokens.tolist(), logprobs)


# -- one row: the same code with B = 1 --------------------------------------------------------


def sample(
    logits: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator | None = None,
    history: TokenHistory | None = None,
) -> int:
    """Next token id from next-token logits (vocab,)."""
    histories = None if history is None else [history]
    return int(sample_batch(logits[None], [params], [generator], histories)[0])


def filtered_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Probabilities (vocab,) after temperature, top-k, top-p and min-p; zero outside support."""
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(), logits.shape[-1]).float()
    rp = _RowParams.of([params], logits.shape[-1], logits.device)
    return _filtered_probs(logits[None], rp)[0]


def top_logprobs(logits: torch.Tensor, k: int, token: int | None = None) -> dict[int, float]:
    """``batch_logprobs`` of one row (vocab,)."""
    tokens = None if token is None else torch.tensor([token], device=logits.device)
    out = batch_logprobs(logits[None], [k], tokens)[0]
    assert out is not None
    return out
