"""The ecosystem's fields against a real float32 `kvserve serve`: ``echo`` with ``logprobs``
on /v1/completions (as OpenAI and vLLM: the prompt's rows first, the first one null;
``max_tokens: 0`` for the prompt alone), vLLM's ``prompt_logprobs`` on both routes, and
/tokenizer_info, /version. Logprobs are judged against a full no-cache forward of the same
checkpoint (``kvserve.reference.decoders.full_logits``)."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

import httpx
import pytest
import torch
from server_helpers import MAX_MODEL_LEN, ServerProcess, start_server

from kvserve.models.model_session import ModelSession
from kvserve.reference.decoders import full_logits
from kvserve.tokenizer import Tokenizer

TOL = 1e-4  # the engine's paged, chunked float32 forward vs the dense one


@pytest.fixture(scope="module")
def f32_server(chat_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory):
    # small chunks: long prompts are prefilled over several steps
    proc = start_server(
        chat_checkpoint, tmp_path_factory.mktemp("logs"), "--dtype", "float32",
        "--max-num-batched-tokens", "16", "--enforce-eager",
    )  # fmt: skip
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def reference(chat_checkpoint: Path):
    session = ModelSession.open(chat_checkpoint, "float32", "cpu")

    def logprobs(ids: list[int]) -> torch.Tensor:  # (P, vocab)
        return torch.log_softmax(full_logits(session.model, ids), dim=-1)

    return logprobs


@pytest.fixture(scope="module")
def tokenizer(chat_checkpoint: Path) -> Tokenizer:
    return Tokenizer.load(chat_checkpoint)


def text_of(tok: Tokenizer, t: int) -> str:
    return tok.decode([t], skip_special_tokens=False)


def complete(server: ServerProcess, **body) -> httpx.Response:
    return server.http().post("/v1/completions", json={"model": server.model, **body})


def test_echo_logprobs_over_token_id_batches(f32_server, reference, tokenizer) -> None:
    # what lm-evaluation-harness's local-completions sends for a loglikelihood
    prompts = [tokenizer.encode("The cat sat on the mat because it was"), [5, 6, 7, 8, 9] * 5]
    body = {"prompt": prompts, "echo": True, "logprobs": 1, "max_tokens": 1, "temperature": 0}
    r = complete(f32_server, **body)
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1]
    for ids, choice in zip(prompts, choices, strict=True):
        lp = choice["logprobs"]
        n = len(ids)
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == n + 1
        assert lp["tokens"][:n] == [text_of(tokenizer, t) for t in ids]
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        ref = reference(ids)
        for j in range(1, n):
            assert lp["token_logprobs"][j] == pytest.approx(ref[j - 1, ids[j]].item(), abs=TOL)
            # logprobs 1: the most likely token, and the prompt's own when it is not that one
            best = int(ref[j - 1].argmax())
            expected = {text_of(tokenizer, best), text_of(tokenizer, ids[j])}
            assert set(lp["top_logprobs"][j]) == expected, j
        # the generated token continues: greedy, its logprob the last position's best
        generated = int(ref[n - 1].argmax())
        assert lp["tokens"][n] == text_of(tokenizer, generated)
        assert lp["token_logprobs"][n] == pytest.approx(ref[n - 1].max().item(), abs=TOL)
        offsets = lp["text_offset"]
        assert offsets[0] == 0
        assert [b - a for a, b in zip(offsets[:-1], offsets[1:], strict=True)] == [
            len(t) for t in lp["tokens"][:-1]
        ]
        # the echoed prompt shows its special tokens; the completion's text skips them
        prompt_text = tokenizer.decode(ids, skip_special_tokens=False)
        assert choice["text"] == prompt_text + tokenizer.decode([generated])


def test_echo_with_max_tokens_zero_returns_the_prompt_alone(f32_server, reference, tokenizer):
    ids = tokenizer.encode("Hello world, this is a test of echo")
    r = complete(f32_server, prompt=ids, echo=True, logprobs=0, max_tokens=0)
    assert r.status_code == 200, r.text
    body = r.json()
    (choice,) = body["choices"]
    assert choice["text"] == tokenizer.decode(ids, skip_special_tokens=False)
    assert choice["finish_reason"] == "length"
    lp = choice["logprobs"]
    assert len(lp["token_logprobs"]) == len(ids)
    ref = reference(ids)
    expected = [None] + [ref[j - 1, ids[j]].item() for j in range(1, len(ids))]
    assert lp["token_logprobs"][0] is None
    assert lp["token_logprobs"][1:] == pytest.approx(expected[1:], abs=TOL)
    assert body["usage"]["completion_tokens"] == 0
    assert body["usage"]["prompt_tokens"] == body["usage"]["total_tokens"] == len(ids)


def test_echo_text_prompt_keeps_its_text(f32_server) -> None:
    prompt = "Once upon a time"
    plain = complete(f32_server, prompt=prompt, max_tokens=6, temperature=0).json()
    echoed = complete(f32_server, prompt=prompt, max_tokens=6, temperature=0, echo=True).json()
    assert echoed["choices"][0]["text"] == prompt + plain["choices"][0]["text"]
    assert echoed["choices"][0]["logprobs"] is None
    for name in ("prompt_tokens", "completion_tokens", "total_tokens"):
        assert echoed["usage"][name] == plain["usage"][name]


def test_echo_with_n_echoes_every_sample(f32_server) -> None:
    r = complete(f32_server, prompt="Hi there", max_tokens=3, n=2, seed=3, echo=True).json()
    assert [c["index"] for c in r["choices"]] == [0, 1]
    assert all(c["text"].startswith("Hi there") for c in r["choices"])


def test_completion_prompt_logprobs_are_vllm_shaped(f32_server, reference, tokenizer) -> None:
    ids = [11, 22, 33, 44, 55, 66, 77, 88, 99, 111, 222, 333, 444, 555, 666, 777, 888, 999, 1234]
    r = complete(f32_server, prompt=ids, max_tokens=1, prompt_logprobs=2)
    assert r.status_code == 200, r.text
    (choice,) = r.json()["choices"]
    pl = choice["prompt_logprobs"]
    assert len(pl) == len(ids) and pl[0] is None
    ref = reference(ids)
    for j in range(1, len(ids)):
        row = ref[j - 1]
        top2 = torch.topk(row, 2).indices.tolist()
        entry = pl[j]
        assert list(entry)[:2] == [str(t) for t in top2]
        assert set(entry) == {str(t) for t in top2} | {str(ids[j])}
        for t, lp in entry.items():
            assert lp["logprob"] == pytest.approx(row[int(t)].item(), abs=TOL)
            assert lp["decoded_token"] == text_of(tokenizer, int(t))
        assert entry[str(ids[j])]["rank"] == int((row > row[ids[j]]).sum()) + 1
        assert [entry[str(t)]["rank"] for t in top2 if t != ids[j]] == [
            i + 1 for i, t in enumerate(top2) if t != ids[j]
        ]


def test_chat_prompt_logprobs_cover_the_templated_prompt(f32_server, reference) -> None:
    messages = [{"role": "user", "content": "Tell me a joke"}]
    ids = f32_server.http().post("/tokenize", json={"messages": messages}).json()["tokens"]
    body = {"model": f32_server.model, "messages": messages, "max_tokens": 2, "prompt_logprobs": 0}
    r = f32_server.http().post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    pl = r.json()["prompt_logprobs"]
    assert len(pl) == len(ids) and pl[0] is None
    ref = reference(ids)
    for j in range(1, len(ids)):
        assert list(pl[j]) == [str(ids[j])]
        assert pl[j][str(ids[j])]["logprob"] == pytest.approx(ref[j - 1, ids[j]].item(), abs=TOL)


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"echo": True, "stream": True}, "echo"),
        ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
        ({"prompt_logprobs": 21}, "prompt_logprobs"),
        ({"prompt_logprobs": -1}, "prompt_logprobs"),
        ({"max_tokens": 0}, "max_tokens"),  # only with echo
        ({"max_tokens": -1, "echo": True}, "max_tokens"),
        ({"suffix": "the end"}, "suffix"),
        ({"best_of": 3}, "best_of"),
    ],
)
def test_unsupported_combinations_are_400_naming_the_field(f32_server, fields, param) -> None:
    r = complete(f32_server, prompt="Hello", **{"max_tokens": 2, **fields})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_chat_prompt_logprobs_with_stream_is_400(f32_server) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "stream": True, "prompt_logprobs": 1}
    r = f32_server.http().post("/v1/chat/completions", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs"


def test_tokenizer_info_is_what_a_remote_tokenizer_reads(f32_server, tokenizer) -> None:
    info = f32_server.http().get("/tokenizer_info").json()
    hf = tokenizer.hf
    assert info == {
        "tokenizer_class": type(hf).__name__,
        "bos_token": hf.bos_token,
        "eos_token": hf.eos_token,
        "pad_token": hf.pad_token,
        "unk_token": hf.unk_token,
        "model_max_length": MAX_MODEL_LEN,
        "vocab_size": 49152,
        "chat_template": hf.chat_template,
    }
    assert info["eos_token"] == "<|im_end|>" and "{%" in info["chat_template"]


def test_version_is_the_installed_package(f32_server) -> None:
    r = f32_server.http().get("/version")
    assert r.status_code == 200
    assert r.json() == {"version": importlib.metadata.version("kvserve")}
