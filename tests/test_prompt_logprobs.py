"""Prompt logprobs (vLLM's ``prompt_logprobs``) against a full no-cache forward's
log_softmax: whole prompts, prompts split over many prefill chunks, after a prefix-cache
entry for the same prompt exists (the hit is skipped), across a preemption mid-prefill, and
shared by the n samples of one prompt."""

from __future__ import annotations

import pytest
import torch
from conftest import make_hf_checkpoint, random_token_ids

from kvserve import LLM, RequestOutput, SamplingParams  # as vLLM users import them
from kvserve.engine.scheduler import SchedulerOutput, _StepBudget
from kvserve.models.model_session import ModelSession
from kvserve.reference.decoders import full_logits

BLOCK = 4
K = 3


@pytest.fixture(scope="module")
def session(tmp_path_factory) -> ModelSession:
    path, _ = make_hf_checkpoint(
        tmp_path_factory.mktemp("plp"), "llama", num_key_value_heads=2, max_position_embeddings=512
    )
    return ModelSession.open(path, "float32", "cpu")


def make_llm(session: ModelSession, **kwargs) -> LLM:
    kwargs.setdefault("num_kv_blocks", 128)
    kwargs.setdefault("block_size", BLOCK)
    return LLM(session=session, **kwargs)


def params(**kwargs) -> SamplingParams:
    kwargs.setdefault("max_tokens", 2)
    return SamplingParams(temperature=0.0, ignore_eos=True, prompt_logprobs=K, **kwargs)


def assert_matches_reference(session: ModelSession, prompt: list[int], out: RequestOutput):
    """Entry j (j >= 1) holds log_softmax(logits[j - 1]): the top K by value and prompt[j]
    with its rank; entry 0 is None."""
    logp = torch.log_softmax(full_logits(session.model, prompt), dim=-1)  # (P, vocab)
    pl, ranks = out.prompt_logprobs, out.prompt_token_ranks
    assert pl is not None and ranks is not None
    assert len(pl) == len(ranks) == len(prompt)
    assert pl[0] is None and ranks[0] is None
    for j in range(1, len(prompt)):
        row = logp[j - 1]
        top = torch.topk(row, K).indices.tolist()
        entry = pl[j]
        assert list(entry)[:K] == top, j
        expected = set(top) | {prompt[j]}
        assert set(entry) == expected, j
        for t, v in entry.items():
            assert v == pytest.approx(row[t].item(), abs=1e-5), (j, t)
        assert ranks[j] == int((row > row[prompt[j]]).sum()) + 1, j


@pytest.mark.parametrize("chunk", [2048, 8, 5])
def test_prompt_logprobs_equal_full_forward(session: ModelSession, chunk: int) -> None:
    prompt = random_token_ids(37, seed=3)
    llm = make_llm(session, max_num_batched_tokens=chunk)
    (out,) = llm.generate([prompt], params(), use_tqdm=False)
    assert_matches_reference(session, prompt, out)
    assert len(out.token_ids) == 2


def test_prompt_logprobs_skip_the_prefix_cache_hit(session: ModelSession) -> None:
    prompt = random_token_ids(29, seed=4)
    llm = make_llm(session)
    plain = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    llm.generate([prompt], plain, use_tqdm=False)  # fills the prefix cache
    (out,) = llm.generate([prompt], params(), use_tqdm=False)
    assert out.num_cached_tokens == 0  # every position was computed
    assert_matches_reference(session, prompt, out)
    (again,) = llm.generate([prompt], plain, use_tqdm=False)
    assert again.num_cached_tokens == 28  # (29 - 1) // 4 full blocks: caching still works
    assert again.prompt_logprobs is None


def test_prompt_logprobs_survive_preemption_mid_prefill(session: ModelSession) -> None:
    prompt = random_token_ids(30, seed=5)
    llm = make_llm(session, max_num_batched_tokens=8)
    engine = llm.engine
    req = engine.add_request(prompt, params())
    engine.step()  # positions 0..7: entries 1..8
    assert req.prompt_logprobs is not None and len(req.prompt_logprobs) == 9
    engine.scheduler._preempt(req, SchedulerOutput(), _StepBudget(0))  # recomputed from 0
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            final = out if out.finished else final
    assert final is not None
    assert_matches_reference(session, prompt, final)


def test_n_samples_share_the_prompt_logprobs(session: ModelSession) -> None:
    prompt = random_token_ids(11, seed=6)
    llm = make_llm(session)
    outs = llm.generate([prompt], params(n=3, seed=1), use_tqdm=False)
    assert [o.index for o in outs] == [0, 1, 2]
    for out in outs:
        assert_matches_reference(session, prompt, out)


def test_one_token_prompt_has_one_null_entry(session: ModelSession) -> None:
    llm = make_llm(session)
    (out,) = llm.generate([[7]], params(), use_tqdm=False)
    assert out.prompt_logprobs == [None] and out.prompt_token_ranks == [None]


def test_prompt_logprobs_zero_gives_the_token_alone(session: ModelSession) -> None:
    prompt = random_token_ids(9, seed=7)
    llm = make_llm(session)
    p = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    (out,) = llm.generate([prompt], p, use_tqdm=False)
    logp = torch.log_softmax(full_logits(session.model, prompt), dim=-1)
    assert out.prompt_logprobs is not None
    for j in range(1, len(prompt)):
        assert list(out.prompt_logprobs[j]) == [prompt[j]]
        assert out.prompt_logprobs[j][prompt[j]] == pytest.approx(
            logp[j - 1, prompt[j]].item(), abs=1e-5
        )


@pytest.mark.parametrize("bad", [-1, 21, 1.5])
def test_prompt_logprobs_out_of_range_is_refused(bad) -> None:
    with pytest.raises((ValueError, TypeError), match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=bad)


def test_mixed_batch_only_asking_requests_get_entries(session: ModelSession) -> None:
    # prefill chunks, decodes and prompt-logprob chunks in the same steps
    prompts = [random_token_ids(n, seed=20 + n) for n in (23, 9, 17)]
    plain = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    asking = params(max_tokens=4)
    llm = make_llm(session, max_num_batched_tokens=12, enable_prefix_caching=False)
    outs = llm.generate(prompts, [asking, plain, asking], use_tqdm=False)
    baseline = llm.generate(prompts, plain, use_tqdm=False)
    assert [o.token_ids for o in outs] == [o.token_ids for o in baseline]  # sampling unchanged
    assert outs[1].prompt_logprobs is None and outs[1].prompt_token_ranks is None
    assert_matches_reference(session, prompts[0], outs[0])
    assert_matches_reference(session, prompts[2], outs[2])
