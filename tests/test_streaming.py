"""Attention sinks (StreamingLLM): ``streaming_sinks`` + ``streaming_window`` on any model.

The engine caches keys rotated at their text positions and turns the query back for its sink
scores (attention/window.py); ``reference/streaming.py`` is the paper's rule written out with
no cache (unrotated keys rotated at their positions within the cache, query by query). A stream
of 10x the window, past the model's context, keeps its block count flat and gives the
reference's greedy tokens and logprobs (float32).
"""

from __future__ import annotations

import pytest
import torch
from conftest import make_hf_checkpoint, random_token_ids

from kvserve.engine.llm import LLM
from kvserve.intmath import cdiv
from kvserve.reference.decoders import full_logits
from kvserve.reference.streaming import streaming_logits
from kvserve.sampling import SamplingParams

BS = 4
WINDOW = 16
CONTEXT = 64  # max_position_embeddings: the stream runs well past it


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path, _ = make_hf_checkpoint(
        tmp_path_factory.mktemp("stream"),
        "llama",
        num_key_value_heads=2,
        max_position_embeddings=CONTEXT,
    )
    return path


def run_stream(llm: LLM, prompt: list[int], n: int) -> tuple[object, list[int]]:
    """Generate n greedy tokens step by step; the blocks the request holds after each step."""
    engine = llm.engine
    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=1)
    req = engine.add_request(prompt, params)
    held, final = [], None
    while engine.has_unfinished_requests():
        for out in engine.step():
            final = out if out.finished else final
        held.append(len(engine.kv_manager.held_blocks(req.request_id)))
        engine.check_integrity()
    return final, held


@pytest.mark.parametrize(("sinks", "prompt_len"), [(4, 10), (0, 10), (4, 40), (6, 3)])
def test_stream_matches_reference_in_flat_memory(checkpoint, sinks, prompt_len):
    llm = LLM(
        str(checkpoint),
        dtype="float32",
        num_kv_blocks=48,
        block_size=BS,
        max_num_batched_tokens=12,  # a 40-token prompt prefills in chunks across the window
        streaming_window=WINDOW,
        streaming_sinks=sinks,
    )
    prompt = random_token_ids(prompt_len, seed=sinks + prompt_len)
    n = 10 * WINDOW
    out, held = run_stream(llm, prompt, n)
    assert out.finish_reason == "length" and len(out.token_ids) == n
    assert len(prompt) + n > CONTEXT
    assert out.num_dropped_tokens == len(prompt) + n - sinks - WINDOW
    # flat while decoding: the sinks' blocks + the window's, from early on to the end (a
    # prefill chunk holds its own tokens' blocks beside the window for its step)
    decoding = held[cdiv(prompt_len, 12) : -1]
    bound = cdiv(sinks, BS) + cdiv(WINDOW, BS) + 1
    assert max(decoding) <= bound and min(decoding[2 * WINDOW :]) >= bound - 1
    assert llm.engine.kv_manager.pool.num_used_blocks == 0

    seq = prompt + out.token_ids
    want = torch.log_softmax(streaming_logits(llm.engine.runner.model, seq, sinks, WINDOW), -1)
    want = want[len(prompt) - 1 : -1]
    assert out.token_ids == want.argmax(-1).tolist()
    got = torch.tensor([lp[t] for lp, t in zip(out.logprobs, out.token_ids, strict=True)])
    chosen = want.gather(1, torch.tensor(out.token_ids)[:, None])[:, 0]
    torch.testing.assert_close(got, chosen, atol=2e-3, rtol=0)


def test_reference_with_nothing_dropped_is_the_exact_model(checkpoint):
    """The reference itself: a window covering the sequence drops nothing and re-rotating at
    cache positions (here: the text's) changes nothing, so it equals the plain forward pass;
    a short window does change the logits (the policy is lossy)."""
    llm = LLM(str(checkpoint), dtype="float32", num_kv_blocks=48, block_size=BS)
    model = llm.engine.runner.model
    ids = random_token_ids(40)
    exact = full_logits(model, ids)
    torch.testing.assert_close(streaming_logits(model, ids, 4, 64), exact, atol=1e-4, rtol=0)
    assert not torch.allclose(streaming_logits(model, ids, 4, 8)[-1], exact[-1], atol=1e-3)


def test_exact_engine_reports_nothing_dropped(checkpoint):
    llm = LLM(str(checkpoint), dtype="float32", num_kv_blocks=48, block_size=BS)
    (out,) = llm.generate([random_token_ids(8)], SamplingParams(max_tokens=4), use_tqdm=False)
    assert out.num_dropped_tokens is None
    with pytest.raises(ValueError, match="maximum context length is 64"):
        llm.generate([random_token_ids(8)], SamplingParams(max_tokens=100), use_tqdm=False)


def test_streams_batched_match_the_reference(checkpoint):
    """Decodes of different lengths share one windowed gather (attention/paged_window.py):
    each stream still gives its own reference's greedy tokens."""
    llm = LLM(
        str(checkpoint),
        dtype="float32",
        num_kv_blocks=96,
        block_size=BS,
        streaming_window=WINDOW,
        streaming_sinks=4,
    )
    prompts = [random_token_ids(n, seed=n) for n in (2, 5, 9, 17, 30, 41)]
    params = SamplingParams(max_tokens=4 * WINDOW, temperature=0.0, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    model = llm.engine.runner.model
    for prompt, out in zip(prompts, outs, strict=True):
        want = streaming_logits(model, prompt + out.token_ids, 4, WINDOW)[len(prompt) - 1 : -1]
        assert out.token_ids == want.argmax(-1).tolist()
    assert llm.engine.kv_manager.pool.num_used_blocks == 0


def test_usage_reports_dropped_tokens_only_under_the_policy():
    from types import SimpleNamespace

    from kvserve.server.serving import usage

    on = [SimpleNamespace(token_ids=[1] * 50, num_dropped_tokens=30)]
    off = [SimpleNamespace(token_ids=[1] * 50, num_dropped_tokens=None)]
    assert usage([10], on, 0).kv_dropped_tokens == 30
    assert usage([10], off, 0).kv_dropped_tokens is None
    assert "kv_dropped_tokens" not in usage([10], off, 0).model_dump()
