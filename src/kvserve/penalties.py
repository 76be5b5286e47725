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
step, a gather and a scatter over those tokens, no per-token Python beyond building one id
tensor.
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


def _occurrences(
    rows: list[int], seqs: list[Sequence[int]], vocab: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Where the tokens of ``seqs[j]`` (row ``rows[j]``) sit in the flattened logits (B * V),
    each position once, and how often it occurs: (U,) long, (U,) float32."""
    lengths = torch.tensor([len(s) for s in seqs], device=device)  # (R,)
    ids = torch.tensor(list(itertools.chain.from_iterable(seqs)), dtype=torch.long, device=device)
    assert ids.numel() == 0 or (int(ids.min()) >= 0 and int(ids.max()) < vocab)
    row_of = torch.tensor(rows, device=device).repeat_interleave(lengths)  # (N,)
    # row i's token t is at i * V + t
    positions, counts = torch.unique(row_of * vocab + ids, return_counts=True)  # (U,), (U,)
    return positions, counts.float()


def apply_penalties(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    histories: Sequence[TokenHistory] | None,
) -> torch.Tensor:
    """Logits (B, V) with each row's penalties applied: the same tensor when no row has any
    (or ``histories`` is None); else a new float32 tensor whose unpenalised rows are the
    input's, converted to float32 (exact).

    Only the logits of tokens in a history are read and written (gather, compute, scatter,
    as HF's processor): O(tokens of the penalised rows), plus one copy of the logits.
    """
    if histories is None:
        return logits
    rows = [i for i, p in enumerate(params) if p.has_penalties]
    if not rows:
        return logits
    assert len(histories) == len(params) == logits.shape[0]
    vocab, device = logits.shape[-1], logits.device
    out = logits.to(torch.float32, copy=True)  # (B, V)
    flat = out.view(-1)  # (B * V,)

    def per_position(values: list[float], positions: torch.Tensor) -> torch.Tensor:
        # each row's value, (B,), looked up for the positions' rows, (U,)
        return torch.tensor(values, dtype=torch.float32, device=device)[positions // vocab]

    rep_rows = [i for i in rows if params[i].repetition_penalty != 1.0]
    if rep_rows:
        # every token seen, prompt and output
        pos, _ = _occurrences(
            rep_rows, [histories[i].all_token_ids for i in rep_rows], vocab, device
        )
        rep = per_position([p.repetition_penalty for p in params], pos)  # (U,)
        x = flat[pos]
        flat[pos] = torch.where(x > 0, x / rep, x * rep)
    add_rows = [
        i for i in rows if params[i].frequency_penalty != 0.0 or params[i].presence_penalty != 0.0
    ]
    if add_rows:
        # output tokens only
        outputs = [histories[i].all_token_ids[histories[i].num_prompt_tokens :] for i in add_rows]
        pos, counts = _occurrences(add_rows, outputs, vocab, device)
        freq = per_position([p.frequency_penalty for p in params], pos)  # (U,)
        pres = per_position([p.presence_penalty for p in params], pos)  # (U,)
        flat[pos] = flat[pos] - freq * counts - pres
    return out
