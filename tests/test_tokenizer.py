"""The tokenizer: the GGUF fast path equals transformers' AutoTokenizer; streaming deltas add
up to the full decode."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from kvserve.default_model import default_model_path
from kvserve.tokenizer import IncrementalDetokenizer, Tokenizer

TEXTS = [
    "Hello world",
    "  leading spaces and trailing ",
    "Ünïcödé 中文 🤖 emoji",
    "<|im_start|>user\nhi<|im_end|>",
    "def f(x):\n\treturn x ** 2  # code",
]


@pytest.fixture(scope="module")
def tokenizers() -> tuple[Tokenizer, object]:
    path = default_model_path()
    ours = Tokenizer.load(path.parent, path)
    ref = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    return ours, ref


def test_gguf_fast_path_matches_autotokenizer(tokenizers) -> None:
    ours, ref = tokenizers
    for text in TEXTS:
        assert ours.encode(text) == ref.encode(text), text
        ids = ref.encode(text)
        assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True)
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is a KV cache?"},
    ]
    want = ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert ours.apply_chat_template(messages) == ref.encode(want, add_special_tokens=False)
    assert ours.eos_token_id == ref.eos_token_id
    assert ours.vocab_size == len(ref)


def test_incremental_detokenizer_adds_up(tokenizers) -> None:
    ours, _ = tokenizers
    for text in TEXTS:
        ids = ours.encode(text)
        detok = IncrementalDetokenizer(ours)
        streamed = "".join(detok.add(t) for t in ids) + detok.flush()
        assert streamed == ours.decode(ids)


def test_incremental_detokenizer_holds_back_partial_characters(tokenizers) -> None:
    ours, _ = tokenizers
    ids = ours.encode("🤖")
    assert len(ids) > 1  # byte-level BPE splits the emoji into several byte tokens
    detok = IncrementalDetokenizer(ours)
    deltas = [detok.add(t) for t in ids]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) + detok.flush() == "🤖"
