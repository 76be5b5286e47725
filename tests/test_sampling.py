"""Sampling: seeds, greedy, the support of top-k / top-p / min-p, top logprobs.

Every support is computed here independently of ``kvserve.sampling`` (float64, one token at a
time), then many draws are checked against it. No model is needed.
SamplingParams validation is tested in test_sampling_params.py, the batched sampler against
the same requests one row at a time in test_sampling_batch.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.reference.decoders import DecodeCounters
from kvserve.reference.generation import generate
from kvserve.sampling import (
    SamplingParams,
    filtered_probs,
    make_generator,
    sample,
    top_logprobs,
)

VOCAB = 64


def random_logits(seed: int, vocab: int = VOCAB, scale: float = 3.0) -> torch.Tensor:
    return scale * torch.randn(vocab, generator=torch.Generator().manual_seed(seed))


def expected_support(logits: torch.Tensor, params: SamplingParams) -> set[int]:
    """Tokens the filters keep, in float64: temperature, top-k, top-p, then min-p."""
    x = logits.double().numpy() / params.temperature
    vocab = x.shape[0]
    keep = np.ones(vocab, dtype=bool)
    if 0 < params.top_k < vocab:
        kth = np.sort(x)[::-1][params.top_k - 1]
        keep &= x >= kth
    z = np.where(keep, x, -np.inf)
    p = np.exp(z - z.max())
    p /= p.sum()
    if params.top_p < 1.0:
        top_p_set = np.zeros(vocab, dtype=bool)
        mass = 0.0
        for i in np.argsort(-p, kind="stable"):
            top_p_set[i] = True
            mass += p[i]
            if mass >= params.top_p:
                break
        keep &= top_p_set
    if params.min_p > 0.0:
        keep &= p >= params.min_p * p.max()
    return {int(i) for i in np.flatnonzero(keep)}


def draws(logits: torch.Tensor, params: SamplingParams, n: int, seed: int = 0) -> list[int]:
    gen = make_generator(seed)
    return [sample(logits, params, gen) for _ in range(n)]


# --------------------------------------------------------------------------------------------
# seeds and greedy


def test_same_seed_same_tokens() -> None:
    logits = random_logits(1, vocab=1000, scale=0.5)  # flat: 50 draws of two seeds differ
    params = SamplingParams(temperature=1.0, seed=1234)
    a = draws(logits, params, 50, seed=1234)
    b = draws(logits, params, 50, seed=1234)
    c = draws(logits, params, 50, seed=4321)
    assert a == b
    assert a != c


def test_seed_makes_generate_reproducible() -> None:
    """Two requests with the same seed get the same tokens; another seed does not."""

    def run(seed: int) -> list[int]:
        params = SamplingParams(max_tokens=40, temperature=1.0, seed=seed)
        return generate(_TableDecoder(), [0], params).token_ids

    assert run(7) == run(7)
    assert run(7) != run(8)


def test_no_seed_uses_no_private_generator() -> None:
    assert make_generator(None) is None
    g = make_generator(5)
    assert isinstance(g, torch.Generator) and g.initial_seed() == 5


@pytest.mark.parametrize("seed", range(5))
def test_greedy_is_argmax(seed: int) -> None:
    logits = random_logits(seed)
    # the filters are ignored at temperature 0, and no generator is needed
    params = SamplingParams(temperature=0.0, top_k=3, top_p=0.1, min_p=0.5)
    assert params.greedy
    assert sample(logits, params) == int(torch.argmax(logits))
    assert sample(logits, params, make_generator(seed)) == int(torch.argmax(logits))


@pytest.mark.parametrize("temperature", [1e-300, 1e-9, 9.9e-6])
def test_temperatures_too_small_to_divide_by_are_greedy(temperature: float) -> None:
    # logits / 1e-300 overflows to inf and softmax to nan: found by fuzzing the server
    params = SamplingParams(temperature=temperature, seed=1)
    assert params.greedy
    logits = random_logits(0)
    assert sample(logits, params, make_generator(1)) == int(torch.argmax(logits))


def test_degenerate_logits_fall_back_to_argmax() -> None:
    logits = torch.full((50,), float("-inf"))
    logits[7] = float("nan")
    probs = filtered_probs(logits, SamplingParams(temperature=1.0))
    assert torch.isfinite(probs).all() and float(probs.sum()) == 1.0
    assert sample(logits, SamplingParams(temperature=1.0), make_generator(0)) == int(probs.argmax())


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(top_k=1),
        SamplingParams(top_p=1e-9),
        SamplingParams(top_p=1e-9, temperature=5.0),
        SamplingParams(min_p=1.0),
        SamplingParams(top_k=1, temperature=100.0),
    ],
    ids=["top_k=1", "top_p-tiny", "top_p-tiny-hot", "min_p=1", "top_k=1-hot"],
)
def test_filters_that_keep_only_the_argmax(params: SamplingParams) -> None:
    for seed in range(5):
        logits = random_logits(seed)
        best = int(torch.argmax(logits))
        assert expected_support(logits, params) == {best}
        assert set(draws(logits, params, 30, seed)) == {best}
        probs = filtered_probs(logits, params)
        assert probs[best] == pytest.approx(1.0)
        assert int(torch.count_nonzero(probs)) == 1


# --------------------------------------------------------------------------------------------
# supports


SUPPORT_CASES = [
    SamplingParams(),
    SamplingParams(temperature=0.5),
    SamplingParams(top_k=5),
    SamplingParams(top_k=-1),
    SamplingParams(top_k=VOCAB + 10),
    SamplingParams(top_p=0.5),
    SamplingParams(top_p=0.9, temperature=2.0),
    SamplingParams(min_p=0.1),
    SamplingParams(min_p=0.3, temperature=1.5),
    SamplingParams(top_k=10, top_p=0.8),
    SamplingParams(top_k=20, top_p=0.95, min_p=0.05, temperature=0.7),
]


@pytest.mark.parametrize("params", SUPPORT_CASES, ids=repr)
def test_samples_stay_in_the_support(params: SamplingParams) -> None:
    for seed in range(3):
        logits = random_logits(100 + seed)
        support = expected_support(logits, params)
        got = draws(logits, params, 300, seed)
        assert set(got) <= support
        if len(support) > 1:
            assert len(set(got)) > 1  # really sampling, not collapsing to the argmax


@pytest.mark.parametrize("params", SUPPORT_CASES, ids=repr)
def test_filtered_probs_is_the_renormalised_support(params: SamplingParams) -> None:
    for seed in range(3):
        logits = random_logits(200 + seed)
        support = sorted(expected_support(logits, params))
        probs = filtered_probs(logits, params)
        assert probs.dtype == torch.float32 and probs.shape == logits.shape
        assert float(probs.sum()) == pytest.approx(1.0, abs=1e-5)
        assert sorted(torch.nonzero(probs).flatten().tolist()) == support
        # inside the support the probabilities keep their ratios (softmax at this temperature)
        ref = torch.softmax(logits.double()[support] / params.temperature, dim=0)
        torch.testing.assert_close(probs.double()[support], ref, atol=1e-6, rtol=1e-5)


def test_top_k_keeps_ties_with_the_kth_value() -> None:
    logits = torch.tensor([3.0, 1.0, 2.0, 2.0, 0.0])
    probs = filtered_probs(logits, SamplingParams(top_k=2))
    assert torch.nonzero(probs).flatten().tolist() == [0, 2, 3]


def test_top_p_keeps_the_token_that_reaches_the_mass() -> None:
    # probs 0.5, 0.3, 0.2: top_p 0.5 -> {0}; 0.6 -> {0, 1}; 0.8 -> {0, 1}; 0.81 -> all
    logits = torch.tensor([0.5, 0.3, 0.2]).log()
    for top_p, want in [(0.5, [0]), (0.6, [0, 1]), (0.79, [0, 1]), (0.81, [0, 1, 2])]:
        probs = filtered_probs(logits, SamplingParams(top_p=top_p))
        assert torch.nonzero(probs).flatten().tolist() == want, top_p


def test_min_p_is_relative_to_the_most_likely_token() -> None:
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()  # min_p 0.3 -> p >= 0.15
    probs = filtered_probs(logits, SamplingParams(min_p=0.3))
    assert torch.nonzero(probs).flatten().tolist() == [0, 1, 2]


def test_masked_logits_are_never_sampled() -> None:
    logits = torch.full((10,), float("-inf"))
    logits[[3, 7]] = torch.tensor([0.0, 1.0])
    assert set(draws(logits, SamplingParams(), 200)) == {3, 7}
    assert set(draws(logits, SamplingParams(top_p=0.99, min_p=0.01), 200)) == {3, 7}


logit_lists = st.lists(
    st.floats(min_value=-20, max_value=20, allow_nan=False, width=32), min_size=1, max_size=40
)


@settings(max_examples=150, deadline=None)
@given(
    values=logit_lists,
    temperature=st.floats(min_value=0.05, max_value=5.0),
    top_k=st.integers(min_value=-1, max_value=45),
    top_p=st.floats(min_value=1e-6, max_value=1.0),
    min_p=st.floats(min_value=0.0, max_value=1.0),
    seed=st.integers(min_value=0, max_value=2**32),
)
def test_filtered_probs_properties(
    values: list[float], temperature: float, top_k: int, top_p: float, min_p: float, seed: int
) -> None:
    """For any logits: a distribution, the most likely token kept, each filter's rule held.

    Checked as properties of the kept set (not a recomputed set) so that ties and float
    rounding at a boundary cannot make the test flaky.
    """
    logits = torch.tensor(values, dtype=torch.float32)
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    probs = filtered_probs(logits, params)
    assert torch.isfinite(probs).all() and (probs >= 0).all()
    assert float(probs.sum()) == pytest.approx(1.0, abs=1e-5)
    kept = probs > 0
    x = logits.float() / temperature  # scaled exactly as the sampler does (ties stay ties)
    # top-k: only tokens whose scaled logit reaches the k-th largest survive
    survivors = torch.ones_like(kept)
    if 0 < top_k < len(values):
        survivors = x >= torch.sort(x, descending=True).values[top_k - 1]
    assert bool(survivors[kept].all())
    # the most likely token is always kept; top-p and min-p drop the least likely first
    p32 = torch.softmax(x.masked_fill(~survivors, float("-inf")), dim=0)
    assert bool(kept[p32 == p32.max()].any())
    dropped = survivors & ~kept
    if dropped.any():
        assert float(p32[kept].min()) >= float(p32[dropped].max())
    p = p32.double()
    if top_p < 1.0:
        # minimal: without its least likely token the kept set would fall short of top_p
        assert float(p[kept].sum() - p[kept].min()) < top_p + 1e-5
        if min_p == 0.0:
            assert float(p[kept].sum()) >= top_p - 1e-5  # and it reaches top_p
    # min-p: every kept token has p >= min_p * max(p)
    assert bool((p[kept] >= min_p * p.max() - 1e-6).all())
    token = sample(logits, params, make_generator(seed))
    assert kept[token]


# --------------------------------------------------------------------------------------------
# top logprobs


@pytest.mark.parametrize("k", [1, 5, 20])
def test_top_logprobs_match_log_softmax(k: int) -> None:
    logits = random_logits(3, vocab=500)
    got = top_logprobs(logits, k)
    logp = torch.log_softmax(logits.double(), dim=-1)
    values, ids = torch.topk(logp, k)
    assert list(got) == ids.tolist()  # ordered best first
    assert all(isinstance(t, int) and isinstance(v, float) for t, v in got.items())
    np.testing.assert_allclose(list(got.values()), values.numpy(), atol=1e-5)
    assert all(v <= 0.0 for v in got.values())
    assert next(iter(got)) == int(torch.argmax(logits))


def test_top_logprobs_add_the_sampled_token_last_when_not_among_the_top() -> None:
    logits = random_logits(5, vocab=500)
    logp = torch.log_softmax(logits.double(), dim=-1)
    worst = int(torch.argmin(logits))
    got = top_logprobs(logits, 3, worst)
    assert len(got) == 4 and list(got)[-1] == worst
    assert got[worst] == pytest.approx(float(logp[worst]), abs=1e-5)
    best = int(torch.argmax(logits))
    assert list(top_logprobs(logits, 3, best)) == list(top_logprobs(logits, 3))
    assert top_logprobs(logits, 0, worst) == {worst: pytest.approx(float(logp[worst]), abs=1e-5)}


def test_top_logprobs_zero_and_bfloat16() -> None:
    logits = random_logits(4)
    assert top_logprobs(logits, 0) == {}
    got = top_logprobs(logits.bfloat16(), 3)
    ref = torch.log_softmax(logits.bfloat16().float(), dim=-1)
    for t, v in got.items():
        assert v == pytest.approx(float(ref[t]), abs=1e-5)


# --------------------------------------------------------------------------------------------
# the generation loop on a fake decoder (cheap: no model)


class _TableDecoder:
    """Next-token logits looked up from a fixed random table by the last token."""

    def __init__(self, vocab: int = 32, eos: int | None = None) -> None:
        self.table = random_logits(99, vocab=vocab * vocab, scale=1.0).view(vocab, vocab)
        if eos is not None:
            self.table[:, eos] = -1e9
        self.counters = DecodeCounters()
        self.tokens: list[int] = []

    def prefill(self, token_ids):
        self.tokens = list(token_ids)
        self.counters.kv_projections += len(self.tokens)
        return self.table[self.tokens[-1]].clone()

    def decode(self, token_id):
        self.tokens.append(int(token_id))
        self.counters.kv_projections += 1
        return self.table[token_id].clone()


def test_generate_stops_on_stop_token_and_eos() -> None:
    greedy = generate(_TableDecoder(), [0], SamplingParams(max_tokens=20, temperature=0))
    assert greedy.finish_reason == "length" and greedy.completion_tokens == 20
    first = greedy.token_ids[3]
    cut = greedy.token_ids.index(first) + 1
    params = SamplingParams(max_tokens=20, temperature=0, stop_token_ids=[first])
    r = generate(_TableDecoder(), [0], params)
    assert r.token_ids == greedy.token_ids[:cut] and r.finish_reason == "stop"
    r = generate(
        _TableDecoder(), [0], SamplingParams(max_tokens=20, temperature=0), eos_token_ids=[first]
    )
    assert r.token_ids == greedy.token_ids[:cut] and r.finish_reason == "stop"
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    r = generate(_TableDecoder(), [0], params, eos_token_ids=[first])
    assert r.token_ids == greedy.token_ids and r.finish_reason == "length"


def test_generate_logprobs_and_kept_logits() -> None:
    params = SamplingParams(max_tokens=6, temperature=0.8, seed=3, logprobs=4)
    r = generate(_TableDecoder(), [1, 2], params, keep_logits=True)
    assert r.logprobs is not None and len(r.logprobs) == len(r.token_ids) == 6
    assert len(r.step_logits) == 6
    for token, step, logits in zip(r.token_ids, r.logprobs, r.step_logits, strict=True):
        assert step == top_logprobs(logits, 4, token)
    assert r.kv_projections == 2 + 5
    assert generate(_TableDecoder(), [1], SamplingParams(max_tokens=2)).logprobs is None


def test_generate_stop_strings_need_a_tokenizer() -> None:
    with pytest.raises(ValueError, match="tokenizer"):
        generate(_TableDecoder(), [0], SamplingParams(stop="x"))
