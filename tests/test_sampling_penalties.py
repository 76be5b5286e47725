"""Presence, frequency and repetition penalties: hand-computed logits, HF's repetition
processor, rows independent of their batch, the neutral path untouched bit for bit; the
engine's and the CLI's greedy tokens against a hand-penalised loop over transformers' logits;
a real `kvserve serve` giving the `LLM` API's tokens for the same penalties."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import hf_logits, make_hf_checkpoint, run_cli
from test_sampling_batch import MIXED, mixed_logits
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

from kvserve.engine.llm import LLM
from kvserve.models.model_session import ModelSession
from kvserve.penalties import History, apply_penalties
from kvserve.sampling import SamplingParams, make_generator, sample, sample_batch, sample_step

# V = 6; prompt [0, 1], output [2, 2, 4]: token 3 and 5 never seen
LOGITS = torch.tensor([[2.0, -1.0, 0.5, 0.0, 3.0, -4.0]])
HISTORY = History.of([0, 1], [2, 2, 4])


@pytest.mark.parametrize(
    ("params", "want"),
    [
        # seen (prompt or output) 0, 1, 2, 4: positive / 2, negative * 2
        (SamplingParams(repetition_penalty=2.0), [1.0, -2.0, 0.25, 0.0, 1.5, -4.0]),
        # p < 1 rewards repeats: positive / 0.5, negative * 0.5
        (SamplingParams(repetition_penalty=0.5), [4.0, -0.5, 1.0, 0.0, 6.0, -4.0]),
        # output counts {2: 2, 4: 1}; the prompt's 0 and 1 are not penalised
        # 2: 0.5 - 0.5 * 2 - 0.25 = -0.75;  4: 3 - 0.5 * 1 - 0.25 = 2.25
        (
            SamplingParams(frequency_penalty=0.5, presence_penalty=0.25),
            [2.0, -1.0, -0.75, 0.0, 2.25, -4.0],
        ),
        # presence alone: once per token, whatever its count
        (SamplingParams(presence_penalty=1.0), [2.0, -1.0, -0.5, 0.0, 2.0, -4.0]),
        # negative frequency: 2: 0.5 + 2 * 2 = 4.5;  4: 3 + 2 = 5
        (SamplingParams(frequency_penalty=-2.0), [2.0, -1.0, 4.5, 0.0, 5.0, -4.0]),
        # repetition first (vLLM's order), then frequency and presence on the result
        # 2: 0.25 - 1.0 - 0.25 = -1.0;  4: 1.5 - 0.5 - 0.25 = 0.75
        (
            SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25),
            [1.0, -2.0, -1.0, 0.0, 0.75, -4.0],
        ),
    ],
)
def test_penalties_by_hand(params: SamplingParams, want: list[float]) -> None:
    got = apply_penalties(LOGITS, [params], [HISTORY])
    assert got.dtype == torch.float32
    assert got[0].tolist() == want
    assert LOGITS[0].tolist() == [2.0, -1.0, 0.5, 0.0, 3.0, -4.0]  # the input is not modified


def test_repetition_penalty_equals_transformers_processor() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 50, generator=gen) * 4  # (B, V)
    ids = torch.randint(0, 50, (3, 12), generator=gen)  # (B, T): prompt 7, output 5
    for p in (1.3, 0.7):
        want = RepetitionPenaltyLogitsProcessor(p)(ids, logits.clone())
        histories = [History.of(row[:7].tolist(), row[7:].tolist()) for row in ids]
        got = apply_penalties(logits, [SamplingParams(repetition_penalty=p)] * 3, histories)
        assert torch.equal(got, want)


def test_greedy_rows_take_the_argmax_of_the_penalised_logits() -> None:
    # unpenalised argmax: token 4 (3.0); with frequency 2: 4 -> 1.0, so token 0 (2.0) wins
    params = SamplingParams(temperature=0.0, frequency_penalty=2.0)
    assert sample(LOGITS[0], SamplingParams(temperature=0.0), history=HISTORY) == 4
    assert sample(LOGITS[0], params, history=HISTORY) == 0
    # sampled rows too: top_k=1 keeps only the penalised argmax
    assert sample(LOGITS[0], SamplingParams(top_k=1, frequency_penalty=2.0), None, HISTORY) == 0


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit (nan and -0.0 included)."""
    return a.dtype == b.dtype == torch.float32 and torch.equal(
        a.view(torch.int32), b.view(torch.int32)
    )


def _histories(rows: int, vocab: int) -> list[History]:
    gen = torch.Generator().manual_seed(1)
    out = []
    for i in range(rows):
        ids = torch.randint(0, vocab, (3 + i,), generator=gen).tolist()
        out.append(History.of(ids[:2], ids[2:]))
    return out


PENALISED = [
    SamplingParams(temperature=0.0, repetition_penalty=1.5),
    SamplingParams(temperature=0.9, seed=21, frequency_penalty=1.0, presence_penalty=-0.5),
    SamplingParams(top_k=5, seed=22, repetition_penalty=0.8, frequency_penalty=2.0),
    SamplingParams(top_p=0.8, seed=23, presence_penalty=2.0),
]


def test_a_row_does_not_depend_on_its_batch() -> None:
    """Mixed neutral and penalised rows (greedy, seeded, every filter, a degenerate row):
    the batch gives each row the logits and tokens it gets alone, for 10 steps."""
    params = [*PENALISED[:2], *MIXED, *PENALISED[2:]]
    batch_gens = [make_generator(p.seed) for p in params]
    alone_gens = [make_generator(p.seed) for p in params]
    for step in range(10):
        logits = mixed_logits(step, len(params))  # (B, V); the last row all -inf but one nan
        histories = _histories(len(params), logits.shape[1])
        batch = apply_penalties(logits, params, histories)
        for i, (p, h) in enumerate(zip(params, histories, strict=True)):
            alone = apply_penalties(logits[i : i + 1], [p], [h])
            assert same_bits(batch[i], alone[0]), (step, i)
        got = sample_batch(logits, params, batch_gens, histories).tolist()
        want = [
            sample(row, p, g, h)
            for row, p, g, h in zip(logits, params, alone_gens, histories, strict=True)
        ]
        assert got == want, step


def test_neutral_rows_are_untouched_bit_for_bit() -> None:
    logits = mixed_logits(0, len(MIXED))
    histories = _histories(len(MIXED), logits.shape[1])
    # no row with penalties: the very same tensor comes back, no copy, no work
    assert apply_penalties(logits, MIXED, histories) is logits
    assert apply_penalties(logits, PENALISED, None) is logits
    # beside penalised rows, the neutral rows keep their exact values (nan, -inf included)
    params = [*MIXED, *PENALISED]
    both = torch.cat([logits, mixed_logits(1, len(PENALISED))])
    out = apply_penalties(both, params, _histories(len(params), logits.shape[1]))
    assert same_bits(out[: len(MIXED)], logits)
    assert not torch.equal(out[len(MIXED) :], both[len(MIXED) :])
    # a penalty of 0 / 1 written out is the neutral path: same tokens, same logprobs
    neutral = SamplingParams(seed=5, presence_penalty=0.0, repetition_penalty=1.0, logprobs=3)
    plain = SamplingParams(seed=5, logprobs=3)
    assert not neutral.has_penalties
    a = sample_step([logits[2]], [neutral], [make_generator(5)], histories[:1])
    b = sample_step([logits[2]], [plain], [make_generator(5)])
    assert a == b


def test_logprobs_are_the_raw_models() -> None:
    """As vLLM's default (raw logprobs): the penalties choose the token, not the logprobs."""
    params = SamplingParams(temperature=0.0, frequency_penalty=2.0, logprobs=1)
    out = sample_step([LOGITS[0]], [params], [None], [HISTORY])
    raw = torch.log_softmax(LOGITS[0], dim=-1)
    assert out.token_ids == [0]
    assert out.logprobs == [{4: raw[4].item(), 0: raw[0].item()}]


@pytest.mark.parametrize(
    ("field", "value", "error", "message"),
    [
        ("presence_penalty", 2.5, ValueError, "presence_penalty must be in [-2.0, 2.0], got 2.5"),
        ("presence_penalty", -2.01, ValueError, "presence_penalty must be in [-2.0, 2.0], got -2.01"),
        ("frequency_penalty", float("nan"), ValueError, "frequency_penalty must be in [-2.0, 2.0], got nan"),
        ("frequency_penalty", "1", TypeError, "frequency_penalty must be a number, got '1'"),
        ("repetition_penalty", 0.0, ValueError, "repetition_penalty must be in (0.0, inf), got 0.0"),
        ("repetition_penalty", -1, ValueError, "repetition_penalty must be in (0.0, inf), got -1"),
        ("repetition_penalty", float("inf"), ValueError, "repetition_penalty must be in (0.0, inf), got inf"),
        ("repetition_penalty", True, TypeError, "repetition_penalty must be a number, got True"),
    ],
)  # fmt: skip
def test_sampling_params_refuse_out_of_range_penalties(field, value, error, message) -> None:
    with pytest.raises(error) as e:
        SamplingParams(**{field: value})
    assert str(e.value) == message


def test_sampling_params_take_the_edges_of_the_ranges() -> None:
    p = SamplingParams(presence_penalty=-2.0, frequency_penalty=2, repetition_penalty=1e-3)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (-2.0, 2, 1e-3)
    assert p.has_penalties
    assert not SamplingParams().has_penalties
    assert SamplingParams(repetition_penalty=1.01).has_penalties


# -- the engine, end to end -------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    return make_hf_checkpoint(tmp_path_factory.mktemp("pen"), "llama")


@pytest.fixture(scope="module")
def tiny(tiny_checkpoint):
    path, model = tiny_checkpoint
    llm = LLM(session=ModelSession.open(path, "float32", "cpu"), num_kv_blocks=64, block_size=4)
    return llm, model


def hand_penalised_greedy(model, prompt: list[int], max_tokens: int, frequency: float) -> list:
    """transformers' logits of the whole sequence at every step, the frequency penalty
    subtracted token by token in Python, then the argmax."""
    out: list[int] = []
    for _ in range(max_tokens):
        logits = hf_logits(model, prompt + out)[-1].clone()  # (V,)
        for t in set(out):
            logits[t] -= frequency * out.count(t)
        out.append(int(logits.argmax()))
    return out


PROMPT = [5, 17, 33, 17, 5, 90]


def test_engine_greedy_with_frequency_penalty_matches_the_hand_loop(tiny) -> None:
    llm, model = tiny
    plain = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    penalised = SamplingParams(
        max_tokens=16, temperature=0.0, ignore_eos=True, frequency_penalty=2.0
    )
    base, pen = llm.generate([PROMPT, PROMPT], [plain, penalised], use_tqdm=False)
    assert base.token_ids == hand_penalised_greedy(model, PROMPT, 16, 0.0)
    assert pen.token_ids == hand_penalised_greedy(model, PROMPT, 16, 2.0)
    # the unpenalised output repeats itself; the penalty changes it
    assert len(set(base.token_ids)) < len(base.token_ids)
    assert pen.token_ids != base.token_ids
    assert len(set(pen.token_ids)) > len(set(base.token_ids))
    llm.engine.check_integrity()


def test_engine_penalties_alone_equal_batched_with_n(tiny) -> None:
    """n = 2 samples fork after the prompt: each sample's penalties read its own output."""
    llm, _ = tiny
    params = SamplingParams(
        max_tokens=10, temperature=0.8, seed=3, n=2, ignore_eos=True, repetition_penalty=1.8
    )
    both = llm.generate(PROMPT, params, use_tqdm=False)
    for i in range(2):
        alone = SamplingParams(
            max_tokens=10, temperature=0.8, seed=3 + i, ignore_eos=True, repetition_penalty=1.8
        )
        assert llm.generate(PROMPT, alone, use_tqdm=False)[0].token_ids == both[i].token_ids


# -- the server ----------------------------------------------------------------------------------


def test_server_penalties_give_the_llm_apis_tokens(server, chat_checkpoint) -> None:
    """presence / frequency as the openai client's top-level fields, repetition_penalty as
    vLLM's extra body field: greedy, the same text as ``LLM`` with the same SamplingParams."""
    client = server.client()
    prompt = [1, 500, 600, 700, 800, 900]
    penalties = {"presence_penalty": 0.5, "frequency_penalty": 1.5}
    got = client.completions.create(
        model=server.model,
        prompt=prompt,
        max_tokens=24,
        temperature=0.0,
        **penalties,
        extra_body={"ignore_eos": True, "repetition_penalty": 1.3},
    )
    got_plain = client.completions.create(
        model=server.model,
        prompt=prompt,
        max_tokens=24,
        temperature=0.0,
        extra_body={"ignore_eos": True},
    )
    llm = LLM(model=str(chat_checkpoint), num_kv_blocks=64)
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    penalised = SamplingParams(
        max_tokens=24,
        temperature=0.0,
        ignore_eos=True,
        repetition_penalty=1.3,
        **penalties,
    )
    want, want_plain = llm.generate([prompt, prompt], [penalised, greedy], use_tqdm=False)
    assert want.token_ids != want_plain.token_ids  # the penalties change this output
    assert got.choices[0].text == want.text
    assert got_plain.choices[0].text == want_plain.text
    assert got.usage.completion_tokens == 24
    # chat takes them too
    chat = client.chat.completions.create(
        model=server.model,
        messages=[{"role": "user", "content": "Say something"}],
        max_tokens=6,
        temperature=0.0,
        **penalties,
        extra_body={"ignore_eos": True, "repetition_penalty": 0.9},
    )
    assert chat.choices[0].finish_reason == "length"
    assert chat.usage.completion_tokens == 6


# -- the command line ----------------------------------------------------------------------------


@pytest.mark.parametrize("no_cache", [False, True], ids=["engine", "reference"])
def test_cli_generate_penalty_flags(capsys, tiny_checkpoint, no_cache: bool) -> None:
    """``generate --frequency-penalty`` on the engine and on the reference decoder
    (``--no-cache``): the hand-penalised greedy tokens."""
    path, model = tiny_checkpoint
    argv = ["generate", "--json", "--model", str(path), "--dtype", "float32"]
    argv += ["--prompt-ids", ",".join(map(str, PROMPT)), "--num-kv-blocks", "32"]
    argv += ["--temperature", "0", "--max-tokens", "16", "--ignore-eos"]
    argv += ["--frequency-penalty", "2.0", *(["--no-cache"] if no_cache else [])]
    code, out, err = run_cli(capsys, *argv)
    assert code == 0, err
    assert json.loads(out.strip().splitlines()[-1])["token_ids"] == hand_penalised_greedy(
        model, PROMPT, 16, 2.0
    )


@pytest.mark.parametrize(
    ("flag", "value", "named"),
    [
        ("--presence-penalty", "2.5", "presence_penalty must be in [-2.0, 2.0], got 2.5"),
        ("--frequency-penalty", "-3", "frequency_penalty must be in [-2.0, 2.0], got -3.0"),
        ("--repetition-penalty", "0", "repetition_penalty must be in (0.0, inf), got 0.0"),
    ],
)
def test_cli_bad_penalties_exit_2(capsys, flag: str, value: str, named: str) -> None:
    code, out, err = run_cli(capsys, "generate", "--json", "--prompt-ids", "1,2", flag, value)
    assert code == 2
    assert err.startswith("error: ") and named in err
    assert out == ""
