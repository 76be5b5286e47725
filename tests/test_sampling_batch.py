"""The batched sampler: one call for a whole step gives the tokens (and logprobs) each request
gets one row at a time; seeded rows do not depend on the rest of the batch; draws follow the
filtered distribution. No model is needed.
"""

from __future__ import annotations

import pytest
import torch
from test_sampling import expected_support, random_logits

from kvserve import sampling
from kvserve.sampling import (
    SamplingParams,
    as_batch,
    batch_logprobs,
    make_generator,
    sample,
    sample_batch,
    sample_step,
    top_logprobs,
)

MIXED = [
    SamplingParams(temperature=0.0),  # greedy: argmax, no generator
    SamplingParams(temperature=1e-9, seed=3),  # too cold to divide by: greedy
    SamplingParams(temperature=0.8, seed=11),
    SamplingParams(top_k=5, seed=12),
    SamplingParams(top_p=0.7, temperature=1.3, seed=13),
    SamplingParams(min_p=0.2, seed=14),
    SamplingParams(top_k=20, top_p=0.9, min_p=0.05, temperature=0.7, seed=15),
    SamplingParams(top_k=1, seed=16),
    SamplingParams(top_p=1e-9, seed=17),
    SamplingParams(temperature=0.0, top_k=3),
]


def mixed_logits(step: int, rows: int) -> torch.Tensor:
    logits = torch.stack([random_logits(1000 * step + i) for i in range(rows)])  # (B, VOCAB)
    logits[-1] = float("-inf")  # a degenerate row: falls back to argmax
    logits[-1, 9] = float("nan")
    return logits


def test_sample_batch_equals_one_row_at_a_time() -> None:
    """Greedy, seeded rows with every filter, and a degenerate row: over 30 steps the batch
    draws exactly the tokens each request draws alone, each generator advancing the same."""
    params = [*MIXED, SamplingParams(seed=18)]
    batch_gens = [make_generator(p.seed) for p in params]
    alone_gens = [make_generator(p.seed) for p in params]
    not_argmax = 0
    for step in range(30):
        logits = mixed_logits(step, len(params))
        got = sample_batch(logits, params, batch_gens)
        assert got.dtype == torch.long and got.shape == (len(params),)
        want = [sample(row, p, g) for row, p, g in zip(logits, params, alone_gens, strict=True)]
        assert got.tolist() == want, step
        assert got[0] == logits[0].argmax() and got[1] == logits[1].argmax() and got[-1] == 9
        assert got[7] == logits[7].argmax() and got[8] == logits[8].argmax()  # top-1 filters
        not_argmax += int(got[2] != logits[2].argmax())
    assert not_argmax > 5  # the seeded rows really sample


@pytest.mark.parametrize(
    "others",
    [
        [],
        [SamplingParams(temperature=0.0)],
        [SamplingParams(top_k=3, top_p=0.5, seed=5)],  # makes the batch sort: not this row
        [SamplingParams(), SamplingParams(min_p=0.3), SamplingParams(temperature=0.0)],
        [SamplingParams(seed=7, top_p=0.95)] * 4,
    ],
    ids=["alone", "with-greedy", "with-sorting", "with-unseeded", "with-four-seeded"],
)
def test_seeded_rows_do_not_depend_on_the_batch(others: list[SamplingParams]) -> None:
    """Two seeded requests (one without filters, one with top-p) draw the same 40 tokens
    whatever else is in the batch and wherever they sit in it."""
    mine = [SamplingParams(temperature=1.0, seed=42), SamplingParams(top_p=0.8, seed=43)]
    torch.manual_seed(0)

    def run(batch: list[SamplingParams], where: list[int]) -> list[list[int]]:
        gens = [make_generator(p.seed) for p in batch]
        tokens = []
        for step in range(40):
            logits = torch.stack([random_logits(50 * step + i) for i in range(len(batch))])
            for j, w in enumerate(where):  # my rows see the same logits in every batch
                logits[w] = random_logits(7919 * step + j, scale=1.0)
            got = sample_batch(logits, batch, gens).tolist()
            tokens.append([got[w] for w in where])
        return tokens

    alone = run(mine, [0, 1])
    assert run(others + mine, [len(others), len(others) + 1]) == alone
    assert run([mine[0], *others, mine[1]], [0, len(others) + 1]) == alone
    assert len({t[0] for t in alone}) > 5  # flat logits: really sampling


def test_unseeded_rows_stay_in_their_support() -> None:
    params = [SamplingParams(top_k=4), SamplingParams(top_p=0.5), SamplingParams(min_p=0.3)]
    logits = torch.stack([random_logits(300 + i) for i in range(len(params))])
    supports = [expected_support(row, p) for row, p in zip(logits, params, strict=True)]
    torch.manual_seed(1)
    seen: list[set[int]] = [set() for _ in params]
    for _ in range(200):
        for i, t in enumerate(sample_batch(logits, params, [None] * len(params)).tolist()):
            seen[i].add(t)
    for got, support in zip(seen, supports, strict=True):
        assert got <= support and len(got) > 1


def test_batched_draws_follow_the_filtered_distribution() -> None:
    """20000 rows of one request in one call: token frequencies against the float64 softmax
    of the top-k survivors at this temperature (chi-square, 4 degrees of freedom, fixed seed:
    the statistic stays far below 18.5, the 0.1% critical value)."""
    logits = torch.tensor([2.0, 1.5, 1.0, 0.2, -0.5, -3.0, -4.0])
    params = SamplingParams(temperature=0.9, top_k=5)
    n = 20000
    torch.manual_seed(2)
    got = sample_batch(logits.expand(n, -1).clone(), [params] * n, [None] * n)
    counts = torch.bincount(got, minlength=7).double()
    assert counts[5:].sum() == 0  # outside the top 5
    p = torch.softmax(logits.double()[:5] / 0.9, dim=0)
    chi2 = float(((counts[:5] - n * p) ** 2 / (n * p)).sum())
    assert chi2 < 18.5, (counts.tolist(), (n * p).tolist())


def test_batch_logprobs_equal_one_row_at_a_time() -> None:
    logits = torch.stack([random_logits(400 + i, vocab=300) for i in range(5)])
    ks = [None, 0, 3, 20, 1]
    tokens = torch.tensor([5, 6, int(logits[2].argmin()), 8, int(logits[4].argmax())])
    got = batch_logprobs(logits, ks, tokens)
    assert got[0] is None
    for i in range(1, 5):
        assert got[i] == top_logprobs(logits[i], ks[i], int(tokens[i]))
    assert len(got[2]) == 4 and list(got[2])[-1] == tokens[2]  # k + the sampled token
    assert list(got[4]) == [int(tokens[4])]  # the sampled token is the top one
    assert batch_logprobs(logits, [None] * 5, tokens) == [None] * 5


def test_sample_step_is_sample_batch_plus_logprobs() -> None:
    rows = [random_logits(500 + i) for i in range(3)]
    params = [SamplingParams(temperature=0.0, logprobs=2), SamplingParams(seed=1), MIXED[6]]
    out = sample_step(rows, params, [None, make_generator(1), make_generator(15)])
    want = sample_batch(torch.stack(rows), params, [None, make_generator(1), make_generator(15)])
    assert out.token_ids == want.tolist()
    assert out.logprobs == [top_logprobs(rows[0], 2, out.token_ids[0]), None, None]


def test_top_logprobs_order_ties_by_token_id_as_argmax_does() -> None:
    # bfloat16 logits tie often: a greedy token must come first among its equals
    logits = torch.tensor([1.0, 3.0, 3.0, 0.0, 3.0, 2.0])
    greedy = sample(logits, SamplingParams(temperature=0.0))
    assert greedy == 1
    assert list(top_logprobs(logits, 4, greedy)) == [1, 2, 4, 5]
    got = batch_logprobs(torch.stack([logits, logits.flip(0)]), [2, 3], torch.tensor([1, 1]))
    assert [list(g) for g in got] == [[1, 2], [1, 3, 4]]


@pytest.mark.parametrize("u", [0.0, 1.0 - 2**-24])
def test_inverse_cdf_draw_never_lands_on_a_zero_probability_token(monkeypatch, u: float) -> None:
    # the extremes of U[0, 1): the draw must skip zero-probability tokens at both ends
    monkeypatch.setattr(sampling, "_uniform", lambda gens, device: torch.full((len(gens),), u))
    probs = torch.tensor([[0.0, 0.3, 0.7, 0.0], [0.0, 0.0, 1.0, 0.0], [1e-30, 0.0, 0.0, 0.0]])
    drawn = sampling._draw(probs, [None] * 3).tolist()
    assert drawn == ([1, 2, 0] if u == 0.0 else [2, 2, 0])


def test_as_batch_takes_the_runners_tensor_and_stacks_anything_else() -> None:
    """The engine's rows are the consecutive rows of one logits tensor: a view of it is the
    batch, no copy. Rows out of order, repeated (a forked sibling) or from separate tensors
    are stacked, with the same values."""
    logits = torch.randn(4, 11)
    for mode in (torch.no_grad, torch.inference_mode):  # the runner's rows: inference mode
        with mode():
            view = as_batch([logits[i] for i in range(4)])
        assert view.data_ptr() == logits.data_ptr() and torch.equal(view, logits)
    head = as_batch([logits[i] for i in (1, 2)])  # a run of rows from the middle: a view too
    assert head.data_ptr() == logits[1].data_ptr() and torch.equal(head, logits[1:3])
    for rows in (
        [logits[i] for i in (0, 2, 1, 3)],
        [logits[0], logits[0], logits[1], logits[2]],
        [logits[i] for i in (1, 2, 3)] + [torch.randn(11)],
        [logits[i].clone() for i in range(4)],
    ):
        got = as_batch(rows)
        assert got.data_ptr() != logits.data_ptr()
        torch.testing.assert_close(got, torch.stack(rows), rtol=0, atol=0)
    one = as_batch([logits[2]])
    assert one.shape == (1, 11) and torch.equal(one[0], logits[2])
