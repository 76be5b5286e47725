"""ModelSession: a loaded checkpoint (config, model, weights report), its tokenizer and EOS ids."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from kvserve.engine.limits import RequestLimits
from kvserve.models.config import ModelConfig
from kvserve.models.llama import LlamaForCausalLM
from kvserve.models.loader import load_model
from kvserve.models.weight_formats import WeightsReport
from kvserve.platform import default_device
from kvserve.sampling import SamplingParams
from kvserve.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class ModelSession:
    config: ModelConfig
    model: LlamaForCausalLM
    tokenizer: Tokenizer | None
    path: Path
    weights: WeightsReport | None = None

    @classmethod
    def open(
        cls,
        model: str | Path | None = None,
        dtype: str = "auto",
        device: str | None = None,
        show_progress: bool = False,
        quantization: str | None = None,
    ) -> ModelSession:
        """``dtype`` "auto": bfloat16 on CUDA and native-bf16 CPUs, else float32."""
        loaded = load_model(
            model,
            dtype,
            device or default_device(),
            show_progress=show_progress,
            quantization=quantization,
        )
        try:
            tokenizer = Tokenizer.load(loaded.path, loaded.gguf_file)
        except ValueError as e:
            logger.warning("no tokenizer (%s); only --prompt-ids prompts will work", e)
            tokenizer = None
        return cls(loaded.config, loaded.model, tokenizer, loaded.path, loaded.weights)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        ids = list(self.config.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.append(self.tokenizer.eos_token_id)
        return tuple(dict.fromkeys(ids))

    def require_tokenizer(self) -> Tokenizer:
        if self.tokenizer is None:
            raise ValueError(f"{self.path} has no tokenizer: pass token ids instead of text")
        return self.tokenizer

    def encode_prompt(self, text: str, chat: bool = False) -> list[int]:
        tok = self.require_tokenizer()
        if chat:
            return tok.apply_chat_template([{"role": "user", "content": text}])
        return tok.encode(text)

    def check_prompt(self, prompt_ids: Sequence[int], params: SamplingParams) -> None:
        """The engine's check (``RequestLimits``) for the reference decoders' dense cache."""
        limits = RequestLimits.dense(
            self.config.vocab_size, self.config.max_model_len, self.tokenizer is not None
        )
        limits.check(prompt_ids, params)
