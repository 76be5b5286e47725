"""Attention of windowed layers: a query at q sees keys q - window < k <= q (HF's sliding
window rule), plus the first ``sinks`` tokens (StreamingLLM's attention sinks).

Positions. A checkpoint's own window (``sinks == 0``) is HF's: keys are rotated at their
positions in the text, as the exact path caches them. With sinks, StreamingLLM gives every
cached token its position *within the cache*: sinks at 0 .. S - 1, the window's W keys at
S .. S + W - 1, the query (the window's last key) at S + W - 1. Rotary scores depend only on
the difference of the two positions, so:

- window keys: cache distance (S + W - 1) - (S + k - (q - W + 1)) = q - k, the text distance:
  the keys as cached (rotated at their text positions) with the query rotated at q are exact;
- sink key i: cache distance S + W - 1 - i, while the cached key sits at i: the query is
  turned back by delta = q - (S + W - 1) for its sink scores (``R(-delta) R(q) = R(q - delta)``).

So the cache keeps rotated keys, exactly as the exact path does; only the query takes one extra
rotation for the sink columns (while q >= S + W, when sinks and window have parted; before
that every key is visible at its own position). ``tests/test_streaming.py`` checks this against
a reference that rotates unrotated keys at their cache positions, per query.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvserve.models.layers import apply_rotary

Rotary = Callable[[torch.Tensor, torch.dtype], tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True, slots=True)
class WindowRule:
    """Which keys a query sees: the last ``window`` (itself included) and the first ``sinks``."""

    window: int
    sinks: int = 0

    @classmethod
    def of(cls, spec) -> WindowRule | None:
        """The rule of a layer spec (kv/spec.py), None for full attention."""
        if spec.sliding_window is None:
            return None
        return cls(spec.sliding_window, spec.num_sinks)

    def visible(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        """q_pos (t,), k_pos (S,) -> (t, S) bool: key j is visible to query i."""
        q, k = q_pos[:, None], k_pos[None, :]
        return (k <= q) & ((k > q - self.window) | (k < self.sinks))

    def sink_delta(self, q_pos: torch.Tensor) -> torch.Tensor:
        """(t,) how far each query is turned back for its sink scores (0: not yet parted)."""
        return (q_pos - (self.sinks + self.window - 1)).clamp(min=0)


def layer_rules(spec) -> list[WindowRule | None]:
    """Per layer of a ``KVCacheSpec``, its window rule (None: full attention)."""
    return [WindowRule.of(layer) for layer in spec.layers]


def window_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    rule: WindowRule,
    scale: float,
    rotary: Rotary | None = None,
) -> torch.Tensor:
    """q (t, heads, D) rotated at q_pos (t,); k, v (S, kv_heads, D) rotated at k_pos (S,) ->
    (t, heads, D). Keys the rule hides are masked; ``rotary`` (the model's rotary embedding)
    is needed when the rule has sinks."""
    t, heads, d = q.shape
    kvh = k.shape[1]
    mask = rule.visible(q_pos, k_pos)  # (t, S)
    parted = None
    if rule.sinks:
        delta = rule.sink_delta(q_pos)
        # sink columns a query sees only as a sink (outside its window)
        parted = (k_pos[None, :] < rule.sinks) & (k_pos[None, :] <= q_pos[:, None] - rule.window)
        if not bool(parted.any()):
            parted = None
    if parted is None:
        # the full-attention path's arithmetic, so that a window that drops nothing gives its
        # numbers: prefill chunks in the model's dtype (causal_attention's SDPA), a decode in
        # float32 (as the C++ decode kernels accumulate)
        dt = torch.float32 if t == 1 else q.dtype
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None].to(dt),
            k.transpose(0, 1)[None].to(dt),
            v.transpose(0, 1)[None].to(dt),
            attn_mask=mask,
            scale=scale,
            enable_gqa=heads != kvh,
        )  # (1, heads, t, D)
        return out[0].transpose(0, 1).to(q.dtype)
    assert rotary is not None, "attention sinks need the model's rotary embedding"
    cos, sin = rotary(delta, torch.float32)  # (t, 1, D)
    qf = q.float()
    q_sink = apply_rotary(qf, cos, -sin)  # turned back by delta: R(q - delta)
    g = heads // kvh
    kf, vf = k.float(), v.float()
    main = torch.einsum("tkgd,skd->kgts", qf.view(t, kvh, g, d), kf)
    sink = torch.einsum("tkgd,skd->kgts", q_sink.view(t, kvh, g, d), kf)
    scores = torch.where(parted, sink, main) * scale  # (kvh, g, t, S)
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("kgts,skd->tkgd", probs, vf)  # (t, kvh, g, D)
    return out.reshape(t, heads, d).to(q.dtype)
