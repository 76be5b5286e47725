"""Presence, frequency and repetition penalties on next-token logits, as vLLM applies them.

For a row with its token history (prompt + output so far), in vLLM's order:

- repetition (HF's ``RepetitionPenaltyLogitsProcessor``, vLLM's ``repetition_penalty``): for
  every token seen in the prompt or the output, ``logit / p`` if the logit is positive, else
  ``logit * p`` (p > 1 discourages repeats, p < 1 encourages them, 1 is off);
- frequency and presence (OpenAI's definition), over the OUTPUT tokens only:
  ``logit[t] -= frequency * count[t] + presence * (count[t] > 0)``.

They act on the raw logits before temperature and every filter, and on greedy rows too (an
argmax over the penalised logits), as vLLM's sampler does. Rows without penalties are left
bit for bit as they are and cost nothing; every operation is row-wise, so a row's result
never depends on the others in the batch.

The counts are rebuilt from the history at every step: O(tokens of the penalised rows) per
step, a few scatter ops, no per-token Python beyond building one id tensor.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple, Protocol

import torch

if TYPE_CHECKING:
    from kvserve.sampling import SamplingParams


class TokenHistory(Protocol):
    """What the penalties read of a request: the engine's ``Request`` satisfies it."""

    @property
    def all_token_ids(self) -> Sequence[int]: ...  # prompt + output so far

    @property
    def num_prompt_tokens(self) -> int: ...


class History(NamedTuple):
    """A plain ``TokenHistory`` for callers without a ``Request`` (tests, tools)."""

    all_token_ids: Sequence[int]  # prompt + output so far
    num_prompt_tokens: int

    @classmethod
    def of(cls, prompt_token_ids: Sequence[int], output_token_ids: Sequence[int] = ()) -> History:
        return cls([*prompt_token_ids, *output_token_ids], len(prompt_token_ids))


def _column(values: list[float], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, device=device)[:, None]  # (R, 1)


def _penalised(
    x: torch.Tensor, params: Sequence[SamplingParams], histories: Sequence[TokenHistory]
) -> torch.Tensor:
    """The penalties on R rows of float32 logits (R, V); returns a new tensor."""
    num_rows, vocab = x.shape
    device = x.device
    seqs = [h.all_token_ids for h in histories]
    starts = [h.num_prompt_tokens for h in histories]
    # one flat id tensor for all rows: row r's ids are seqs[r], its outputs from starts[r] on
    lengths = torch.tensor([len(s) for s in seqs], device=device)  # (R,)
    ids = torch.tensor(list(itertools.chain.from_iterable(seqs)), dtype=torch.long, device=device)
    assert ids.numel() == 0 or (int(ids.min()) >= 0 and int(ids.max()) < vocab)
    row_of = torch.repeat_interleave(torch.arange(num_rows, device=device), lengths)  # (N,)
    # position of each id within its own row, to tell prompt ids from output ids
    offsets = torch.cumsum(lengths, 0) - lengths  # (R,)
    pos = torch.arange(ids.numel(), device=device) - offsets[row_of]  # (N,)
    is_output = pos >= torch.tensor(starts, device=device)[row_of]  # (N,)

    flat = row_of * vocab + ids  # (N,) index into the (R * V) flattening
    reps = [p.repetition_penalty for p in params]
    if any(r != 1.0 for r in reps):
        seen = torch.zeros(num_rows * vocab, dtype=torch.bool, device=device)
        seen[flat] = True
        rep = _column(reps, device)  # (R, 1); 1 leaves the row unchanged (x / 1 == x * 1 == x)
        scaled = torch.where(x > 0, x / rep, x * rep)  # (R, V)
        x = torch.where(seen.view(num_rows, vocab), scaled, x)
    freqs = [p.frequency_penalty for p in params]
    pres = [p.presence_penalty for p in params]
    if any(f != 0.0 for f in freqs) or any(p != 0.0 for p in pres):
        out = flat[is_output]
        counts = torch.zeros(num_rows * vocab, dtype=torch.float32, device=device)
        counts.index_add_(0, out, torch.ones(out.numel(), device=device))
        counts = counts.view(num_rows, vocab)  # (R, V): output occurrences of each token
        # 0 * count and 0 * mask subtract exactly 0: neutral rows keep their bits
        x = x - _column(freqs, device) * counts - _column(pres, device) * (counts > 0)
    return x


def apply_penalties(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    histories: Sequence[TokenHistory] | None,
) -> torch.Tensor:
    """Logits (B, V) with each row's penalties applied: the same tensor when no row has any
    (or ``histories`` is None); else a new float32 tensor whose unpenalised rows are the
    input's, converted to float32 (exact)."""
    if histories is None:
        return logits
    rows = [i for i, p in enumerate(params) if p.has_penalties]
    if not rows:
        return logits
    assert len(histories) == len(params) == logits.shape[0]
    if len(rows) == len(params):
        return _penalised(logits.float(), params, histories)
    idx = torch.tensor(rows, device=logits.device)
    sub = _penalised(logits[idx].float(), [params[i] for i in rows], [histories[i] for i in rows])
    return logits.to(torch.float32, copy=True).index_copy_(0, idx, sub)
