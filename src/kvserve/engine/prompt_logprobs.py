"""Prompt logprobs (vLLM's ``prompt_logprobs``): the logprobs of every prompt token but the
first, from the logits of the position before it, computed chunk by chunk during prefill.

Position p's logits predict token p + 1, so a prefill chunk over positions [a, a + n) of a
prompt of P tokens yields the entries of tokens a + 1 .. min(a + n, P - 1):

    tokens      t0    t1    t2    t3   | first output
    positions   0     1     2     3
    entry       None  lp(0) lp(1) lp(2)  <- lp(p) = log_softmax(logits[p])[t(p+1)]

Position P - 1 predicts the first output token: it is the sampling row, not a prompt entry.
A request's entries arrive in order: it never reads the prefix cache while any are missing
(``Request.skip_reading_prefix_cache``), and a recompute after preemption skips the entries
it already has.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from kvserve.engine.request import Request
from kvserve.sampling import batch_logprobs

# rows of logits computed at once: a 2048-token chunk over a 49152-token vocabulary would be
# 400 MB of float32 logits in one piece
LOGITS_ROWS_PER_PIECE = 256


class PromptLogprobs(NamedTuple):
    """One prefill chunk's entries for one request."""

    start: int  # index of the first prompt token these entries belong to (>= 1)
    logprobs: list[dict[int, float]]  # per token: the top k, then the token itself if not among
    ranks: list[int]  # per token: its rank in its position's distribution (1 = most likely)


def positions_needed(req: Request, num_computed: int, num_new: int) -> range:
    """The positions of this chunk [num_computed, num_computed + num_new) whose logits give
    prompt entries the request does not have yet (empty when it asked for none)."""
    pl = req.prompt_logprobs
    if pl is None:
        return range(0)
    first = max(num_computed, len(pl) - 1)  # the position that predicts token len(pl)
    last = min(num_computed + num_new, req.num_prompt_tokens - 1)
    # entries arrive in order: no position between what we have and this chunk was skipped
    assert first >= last or num_computed <= len(pl) - 1, "prompt positions were skipped"
    return range(first, max(first, last))


def compute_prompt_logprobs(
    hidden: torch.Tensor,
    rows: range,
    next_tokens: list[int],
    k: int,
    compute_logits,
) -> tuple[list[dict[int, float]], list[int]]:
    """Entries for hidden-state rows ``rows`` of a step (hidden: (T, hidden_size)) whose next
    tokens are ``next_tokens``: the top k of each row's distribution and the next token, and
    the next token's rank. Logits are computed a piece at a time (``compute_logits``:
    (R, hidden_size) -> (R, vocab))."""
    assert len(rows) == len(next_tokens)
    logprobs: list[dict[int, float]] = []
    ranks: list[int] = []
    for lo in range(0, len(rows), LOGITS_ROWS_PER_PIECE):
        piece = rows[lo : lo + LOGITS_ROWS_PER_PIECE]
        logits = compute_logits(hidden[piece.start : piece.stop]).float()  # (R, vocab)
        nxt = torch.tensor(next_tokens[lo : lo + len(piece)], device=logits.device)  # (R,)
        top = batch_logprobs(logits, [k] * len(piece), nxt)
        logprobs.extend(d for d in top if d is not None)
        # rank = 1 + how many tokens are strictly more likely (log_softmax is monotone per row)
        chosen = logits.gather(1, nxt[:, None])  # (R, 1)
        ranks.extend(((logits > chosen).sum(dim=-1) + 1).tolist())
    return logprobs, ranks


def add_prompt_logprobs(req: Request, chunk: PromptLogprobs) -> None:
    """Append a chunk's entries to the request (they must continue where it stands)."""
    assert req.prompt_logprobs is not None and req.prompt_token_ranks is not None
    assert chunk.start == len(req.prompt_logprobs), "prompt logprobs out of order"
    req.prompt_logprobs.extend(chunk.logprobs)
    req.prompt_token_ranks.extend(chunk.ranks)
