"""The lesson as code: two decoders over the same model, slow on purpose and obviously correct.

- ``NoCacheDecoder`` recomputes K and V for the whole sequence at every step.
- ``DenseCacheDecoder`` keeps K and V (never Q) in buffers preallocated to ``max_len`` and
  written at a fill pointer; a new token's position is the number of tokens already cached.
  Given a new token sequence it keeps the longest common prefix of what it holds and prefills
  only the rest (edit reuse; multi-turn chat).

Both count what they do, so the saving is something a user can see: K/V projections computed
(a token counts once however many layers), cache rows read, cache bytes held. They are the
truth that every faster path (the paged engine) is tested against.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvserve.attention.dense import DenseAttention
from kvserve.attention.no_cache import NoCacheAttention
from kvserve.attention.window import layer_rules
from kvserve.kv.storage import KVCacheStorage
from kvserve.models.llama import LlamaForCausalLM


@dataclass(slots=True)
class DecodeCounters:
    kv_projections: int = 0  # tokens whose K/V were computed (once per token, not per layer)
    cache_rows_read: int = 0  # cached token rows attention read, summed over steps
    last_rows_read: int = 0  # cached token rows the last step read
    steps: int = 0  # forward passes
    reused_tokens: int = 0  # prompt tokens whose K/V came from the cache (last prefill)
    computed_tokens: int = 0  # prompt tokens computed (last prefill)


def _as_ids(token_ids: Sequence[int] | torch.Tensor, device: torch.device) -> torch.Tensor:
    return torch.as_tensor(token_ids, dtype=torch.long, device=device).reshape(-1)


@torch.inference_mode()
def full_logits(model: LlamaForCausalLM, token_ids: Sequence[int] | torch.Tensor) -> torch.Tensor:
    """Logits (T, vocab) float32 of every position of one sequence, no cache at all."""
    ids = _as_ids(token_ids, model.device)
    positions = torch.arange(ids.numel(), device=model.device)
    return model.compute_logits(
        model(ids, positions, NoCacheAttention(model.config.attention_scale))
    )


class NoCacheDecoder:
    """Every step runs the whole sequence through the model again."""

    def __init__(self, model: LlamaForCausalLM) -> None:
        self.model = model
        self.tokens: list[int] = []
        self.counters = DecodeCounters()

    @property
    def cache_bytes(self) -> int:
        return 0

    def prefill(self, token_ids: Sequence[int]) -> torch.Tensor:
        """Start a sequence; returns the next-token logits (vocab,)."""
        if len(token_ids) == 0:
            raise ValueError("prefill needs at least one token")
        self.tokens = list(token_ids)
        self.counters.reused_tokens, self.counters.computed_tokens = 0, len(self.tokens)
        return self._run()

    def decode(self, token_id: int) -> torch.Tensor:
        self.tokens.append(int(token_id))
        return self._run()

    def _run(self) -> torch.Tensor:
        self.counters.kv_projections += len(self.tokens)
        self.counters.steps += 1
        self.counters.last_rows_read = 0
        hidden_last = self._forward_last()
        return self.model.compute_logits(hidden_last)[0]

    @torch.inference_mode()
    def _forward_last(self) -> torch.Tensor:
        ids = _as_ids(self.tokens, self.model.device)
        positions = torch.arange(ids.numel(), device=self.model.device)
        attn = NoCacheAttention(
            self.model.config.attention_scale, layer_rules(self.model.kv_cache_spec())
        )
        return self.model(ids, positions, attn)[-1:]


class DenseCacheDecoder:
    """One sequence, K/V in preallocated buffers written at a fill pointer.

    Invariant: ``len(self.tokens)`` is the fill pointer; rows [0, fill) of every layer's K/V
    hold exactly the K/V of ``self.tokens`` at positions 0 .. fill-1; rows past it are stale
    and never read.
    """

    def __init__(self, model: LlamaForCausalLM, max_len: int) -> None:
        cfg = model.config
        if max_len <= 0 or max_len > cfg.max_model_len:
            raise ValueError(f"max_len must be in [1, {cfg.max_model_len}], got {max_len}")
        self.model = model
        self.max_len = max_len
        # the lesson's preallocated buffer: one block of max_len positions, K and V in the
        # model's dtype (the exact cache), through the same storage the engine pages
        spec = model.kv_cache_spec(block_size=max_len)
        # one block: every group its own tensors (groups sharing tensors need distinct blocks)
        self.storage = KVCacheStorage(spec, 1, model.device, model.dtype, share_tensors=False)
        self.rules = layer_rules(spec)
        self.tokens: list[int] = []
        self.counters = DecodeCounters()

    @property
    def cache_bytes(self) -> int:
        """Bytes allocated for K and V (the whole preallocated buffer)."""
        return self.storage.nbytes

    @property
    def used_cache_bytes(self) -> int:
        """Bytes of K/V rows that hold a token."""
        return self.cache_bytes * len(self.tokens) // self.max_len

    def prefill(self, token_ids: Sequence[int]) -> torch.Tensor:
        """Make the cache hold ``token_ids``, reusing the longest common prefix it already has.

        The last token is always recomputed (its logits are the output), so at most
        len(token_ids) - 1 tokens are reused. Returns next-token logits (vocab,).
        """
        new = list(token_ids)
        if not new:
            raise ValueError("prefill needs at least one token")
        if len(new) > self.max_len:
            raise ValueError(f"{len(new)} tokens do not fit the cache of {self.max_len} positions")
        keep = 0
        for a, b in zip(self.tokens, new[:-1], strict=False):
            if a != b:
                break
            keep += 1
        self.tokens = self.tokens[:keep]  # moving the fill pointer back drops the rest
        self.counters.reused_tokens, self.counters.computed_tokens = keep, len(new) - keep
        return self._extend(new[keep:])

    def decode(self, token_id: int) -> torch.Tensor:
        if len(self.tokens) >= self.max_len:
            raise ValueError(f"the cache is full ({self.max_len} positions)")
        return self._extend([int(token_id)])

    @torch.inference_mode()
    def _extend(self, new_tokens: list[int]) -> torch.Tensor:
        start = len(self.tokens)
        ids = _as_ids(new_tokens, self.model.device)
        positions = torch.arange(start, start + ids.numel(), device=self.model.device)
        backend = DenseAttention(self.storage, start, self.model.config.attention_scale, self.rules)
        hidden = self.model(ids, positions, backend)
        self.tokens.extend(new_tokens)
        self.counters.kv_projections += len(new_tokens)
        self.counters.steps += 1
        self.counters.last_rows_read = start  # rows that came from the cache, not this step
        self.counters.cache_rows_read += start
        return self.model.compute_logits(hidden[-1:])[0]
