"""RequestOutput kinds on the engine: a DELTA stream costs O(T) (its non-final outputs carry
no whole lists) and its final output has everything; CUMULATIVE keeps the per-step snapshots;
FINAL_ONLY gives one output; stop strings are held back in a DELTA stream.

A tiny random Llama with the default model's tokenizer (``chat_checkpoint``), greedy.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvserve.engine.llm import LLM
from kvserve.engine.request import RequestOutput
from kvserve.sampling import RequestOutputKind, SamplingParams

PROMPT = [1, 500, 600, 700, 800, 900]
T = 200


@pytest.fixture(scope="module")
def llm(chat_checkpoint: Path) -> LLM:
    return LLM(model=str(chat_checkpoint), num_kv_blocks=64, block_size=16)


def params(kind: RequestOutputKind, max_tokens: int = T, **kw) -> SamplingParams:
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=0.0,
        ignore_eos=True,
        logprobs=2,
        output_kind=kind,
        **kw,
    )


def run(llm: LLM, p: SamplingParams, prompt: list[int] = PROMPT) -> list[RequestOutput]:
    """Every output the engine gives this request, one engine step at a time."""
    engine = llm.engine
    req = engine.add_request(prompt, p)
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.request_id == req.request_id]
    return outs


def size(out: RequestOutput) -> int:
    """Elements of every list field and characters of every text field."""
    lists = (out.new_token_ids, out.new_logprobs, out.token_ids, out.logprobs)
    return sum(len(x) for x in lists if x is not None) + len(out.new_text) + len(out.text or "")


def joined(outs: list[RequestOutput]) -> tuple[list[int], str, list[dict[int, float]]]:
    tokens = [t for o in outs for t in o.new_token_ids]
    logprobs = [lp for o in outs for lp in o.new_logprobs or []]
    return tokens, "".join(o.new_text for o in outs), logprobs


@pytest.fixture(scope="module")
def delta(llm: LLM) -> list[RequestOutput]:
    return run(llm, params(RequestOutputKind.DELTA))


def test_delta_outputs_carry_only_the_step_and_cost_linear(delta: list[RequestOutput]) -> None:
    assert len(delta) == T
    *steps, final = delta
    for out in steps:
        assert not out.finished
        assert out.token_ids is None and out.text is None and out.logprobs is None
        assert len(out.new_token_ids) == 1 and len(out.new_logprobs) == 1
    assert final.finished and final.finish_reason == "length"
    tokens, text, logprobs = joined(delta)
    assert final.token_ids == tokens and len(tokens) == T
    assert final.text == text
    assert final.logprobs == logprobs
    # O(T): every step's one token and one logprobs dict, then the whole lists once at the end
    assert sum(size(o) for o in delta) == 4 * T + 2 * len(text)


def test_cumulative_outputs_are_the_snapshots_so_far(llm: LLM, delta: list[RequestOutput]) -> None:
    cumulative = run(llm, params(RequestOutputKind.CUMULATIVE))
    assert len(cumulative) == T
    tokens, text, logprobs = joined(delta)
    for t, out in enumerate(cumulative, start=1):
        assert out.new_token_ids == tokens[t - 1 : t]
        assert out.token_ids == tokens[:t] and out.logprobs == logprobs[:t]
        assert text.startswith(out.text)
    assert cumulative[-1].text == text
    # the quadratic cost DELTA avoids: step t carries t tokens and t logprobs
    assert sum(size(o) - len(o.new_text) - len(o.text) for o in cumulative) == T * (T + 1) + 2 * T


def test_final_only_is_one_output_with_everything(llm: LLM, delta: list[RequestOutput]) -> None:
    (out,) = run(llm, params(RequestOutputKind.FINAL_ONLY))
    tokens, text, logprobs = joined(delta)
    assert out.finished and out.token_ids == tokens and out.text == text
    assert out.logprobs == logprobs
    # nothing was handed out before: the "new" fields are the whole output
    assert out.new_token_ids == tokens and out.new_text == text and out.new_logprobs == logprobs


def test_generate_and_stream_ask_for_no_more_than_they_return(
    llm: LLM, delta: list[RequestOutput]
) -> None:
    p = params(RequestOutputKind.CUMULATIVE, max_tokens=20)
    (final,) = llm.generate([PROMPT], p, use_tqdm=False)
    assert final.token_ids == joined(delta)[0][:20]
    streamed = list(llm.stream(PROMPT, p))
    assert len(streamed) == 20 and all(o.token_ids is None for o in streamed[:-1])
    assert streamed[-1].token_ids == final.token_ids and streamed[-1].text == final.text


def test_stop_string_is_held_back_in_a_delta_stream(llm: LLM, delta: list[RequestOutput]) -> None:
    """A stop string that begins in one token's text and ends in the next: the stream never
    shows its beginning, and stops with the text cut before it."""
    text = joined(delta)[1]
    pieces = [o.new_text for o in delta]  # no stop strings: each token's text, unheld
    pos = 0
    for k in range(len(pieces) - 1):
        a, b = pieces[k], pieces[k + 1]
        stop = a[-2:] + b[:2]
        if len(a) >= 2 and len(b) >= 2 and text.find(stop) == pos + len(a) - 2:
            break
        pos += len(a)
    else:
        pytest.fail("no token boundary to put a stop string across")
    outs = run(llm, params(RequestOutputKind.DELTA, stop=(stop,)))
    want = text[: text.index(stop)]
    assert outs[-1].finished and outs[-1].finish_reason == "stop"
    assert outs[-1].text == want and len(outs) == k + 2
    shown = ""
    for out in outs:
        shown += out.new_text
        assert want.startswith(shown)  # nothing shown is ever taken back
    assert shown == want
