"""The StreamingLLM policy as the paper states it, with no cache: the reference the engine's
sinks-and-window path (attention/window.py) is tested against.

For every query position q the kept tokens are the first ``sinks`` and the last ``window``
(q itself included); each kept token gets its position *within that cache* (0, 1, ...), the
query the last one, and keys and query are rotated at those positions before attending. The
model runs with every position 0 (the identity rotation), so the backend receives q and k
unrotated and does the rotation itself, query by query. Quadratic and slow on purpose; it shares
no code with the engine's path but the model's rotary embedding.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from kvserve.models.layers import apply_rotary
from kvserve.models.llama import LlamaForCausalLM


class StreamingReferenceAttention:
    """q: (T, heads, D), k, v: (T, kv_heads, D) of the whole sequence, q and k unrotated."""

    def __init__(self, model: LlamaForCausalLM, sinks: int, window: int) -> None:
        self.rotary = model.model.rotary_emb
        self.sinks, self.window = sinks, window
        self.scale = model.config.attention_scale

    def kept(self, q: int) -> list[int]:
        """The positions the cache holds when the query at ``q`` runs, in order."""
        return sorted(
            set(range(min(self.sinks, q + 1))) | set(range(max(0, q - self.window + 1), q + 1))
        )

    def __call__(
        self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        t, heads, d = q.shape
        kvh = k.shape[1]
        out = torch.empty_like(q)
        for j in range(t):
            kept = self.kept(j)
            cos, sin = self.rotary(torch.arange(len(kept), device=q.device), q.dtype)
            kj = apply_rotary(k[kept], cos, sin)  # (n, kv_heads, D) at cache positions
            qj = apply_rotary(q[j : j + 1], cos[-1:], sin[-1:])  # the last cache position
            o = F.scaled_dot_product_attention(
                qj.transpose(0, 1)[None],  # (1, heads, 1, D)
                kj.transpose(0, 1)[None],
                v[kept].transpose(0, 1)[None],
                scale=self.scale,
                enable_gqa=heads != kvh,
            )
            out[j] = o[0, :, 0]
        return out


@torch.inference_mode()
def streaming_logits(
    model: LlamaForCausalLM, token_ids: Sequence[int], sinks: int, window: int
) -> torch.Tensor:
    """(T, vocab) float32 logits of every position under the policy (teacher-forced: the same
    as decoding token by token, since each query's attention depends only on earlier tokens)."""
    ids = torch.as_tensor(list(token_ids), dtype=torch.long, device=model.device)
    zeros = torch.zeros_like(ids)  # rotation by 0: the backend rotates at cache positions
    hidden = model(ids, zeros, StreamingReferenceAttention(model, sinks, window))
    return model.compute_logits(hidden)
