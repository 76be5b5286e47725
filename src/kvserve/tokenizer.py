"""Tokenizer, chat template and incremental detokenization, on Hugging Face transformers.

A GGUF file carries its own tokenizer (vocabulary, merges, chat template); transformers
rebuilds a fast tokenizer from it. A Hugging Face directory has tokenizer.json /
tokenizer_config.json.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)


class Tokenizer:
    """Text <-> token ids, and chat messages -> prompt ids with the model's own template."""

    def __init__(self, hf_tokenizer: Any) -> None:
        self.hf = hf_tokenizer

    @classmethod
    def load(cls, path: Path, gguf_file: Path | None = None) -> Tokenizer:
        from transformers import AutoTokenizer  # heavy import, kept off the module import path

        try:
            if gguf_file is not None:
                tok = _gguf_bpe_tokenizer(gguf_file) or AutoTokenizer.from_pretrained(
                    gguf_file.parent, gguf_file=gguf_file.name
                )
            else:
                tok = AutoTokenizer.from_pretrained(path)
        except (OSError, ValueError, KeyError) as e:
            raise ValueError(f"could not load a tokenizer from {gguf_file or path}: {e}") from e
        return cls(tok)

    @property
    def vocab_size(self) -> int:
        return len(self.hf)

    @property
    def eos_token_id(self) -> int | None:
        return self.hf.eos_token_id

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.hf, "chat_template", None))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self, messages: Sequence[dict[str, str]], add_generation_prompt: bool = True
    ) -> list[int]:
        """Prompt ids for a conversation. The template writes the special tokens itself."""
        if not self.has_chat_template:
            raise ValueError("this model's tokenizer has no chat template")
        text = self.hf.apply_chat_template(
            list(messages), tokenize=False, add_generation_prompt=add_generation_prompt
        )
        return self.encode(text, add_special_tokens=False)


def _gguf_bpe_tokenizer(gguf_file: Path) -> Any | None:
    """A byte-level BPE (``tokenizer.ggml.model = gpt2``) tokenizer straight from the GGUF file.

    AutoTokenizer also parses the whole file to build a model config (6-12 s for the default
    model); transformers' GGUF tokenizer converter alone takes about 1 s. Other tokenizer kinds
    (sentencepiece, with their BOS rules) go through AutoTokenizer. Returns None when this fast
    path does not apply; ``test_tokenizer`` holds it equal to AutoTokenizer on the default model.
    """
    try:
        from transformers import PreTrainedTokenizerFast
        from transformers.integrations.gguf.gguf_tokenizer_mapping import (
            convert_gguf_tokenizer,
            get_gguf_tokenizer,
        )
    except ImportError:  # another transformers version: the slow, public path still works
        return None
    arch, tokenizer_dict, tokenizer_config = get_gguf_tokenizer(str(gguf_file))
    if tokenizer_dict.get("tokenizer_type") != "gpt2":
        return None
    backend, extra = convert_gguf_tokenizer(arch, tokenizer_dict)
    return PreTrainedTokenizerFast(tokenizer_object=backend, **tokenizer_config, **extra)


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas for streaming.

    Decoding token by token breaks multi-byte characters and word-joining spaces, so (as vLLM)
    we decode a short window [prefix_offset, len) and emit only the text past what the window
    [prefix_offset, read_offset) already produced, holding back while the tail is an
    incomplete UTF-8 sequence (U+FFFD).
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_id: int) -> str:
        """Append one token; returns the new text it completes (possibly '')."""
        self.token_ids.append(int(token_id))
        prefix = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.token_ids[self.prefix_offset :])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
            return full[len(prefix) :]
        return ""

    def flush(self) -> str:
        """Text still held back (an incomplete character at the very end), emitted as is."""
        prefix = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.token_ids[self.prefix_offset :])
        self.prefix_offset = self.read_offset = len(self.token_ids)
        return full[len(prefix) :]
