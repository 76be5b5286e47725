"""``kvserve verify``: the lesson's demonstration on the user's own model.

Runs the no-cache and the dense-cache decoder greedily on the same prompt and reports whether
they produced the same tokens, how far their logits drifted, and what the cache saved: K/V
projections computed, wall time, and the bytes the cache held.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from kvserve.models.model_session import ModelSession
from kvserve.reference.sessions import generate_once
from kvserve.sampling import SamplingParams


@dataclass(slots=True)
class VerifyReport:
    prompt_tokens: int
    generated_tokens: int
    same_tokens: bool
    first_divergence: int | None  # index of the first differing generated token
    max_abs_logit_diff: float  # over the steps before any divergence
    bitwise_equal: bool  # every compared step's logits identical, bit for bit
    kv_projections_no_cache: int
    kv_projections_cached: int
    wall_s_no_cache: float
    wall_s_cached: float
    cache_bytes: int  # preallocated K/V buffer for prompt + max_tokens

    @property
    def projection_ratio(self) -> float:
        return self.kv_projections_no_cache / max(1, self.kv_projections_cached)

    @property
    def speedup(self) -> float:
        return self.wall_s_no_cache / self.wall_s_cached if self.wall_s_cached > 0 else 0.0

    def as_dict(self) -> dict:
        d = asdict(self)
        d["projection_ratio"] = self.projection_ratio
        d["speedup"] = self.speedup
        return d

    def lines(self) -> list[str]:
        diverged = (
            "" if self.same_tokens else f" (first difference at token {self.first_divergence})"
        )
        return [
            f"prompt tokens:            {self.prompt_tokens}",
            f"generated tokens:         {self.generated_tokens}",
            f"same tokens:              {'yes' if self.same_tokens else 'no'}{diverged}",
            f"max |logit difference|:   {self.max_abs_logit_diff:.3g}",
            f"logits bit for bit:       {'equal' if self.bitwise_equal else 'not equal'}",
            f"K/V projections:          no cache {self.kv_projections_no_cache}, "
            f"cached {self.kv_projections_cached} ({self.projection_ratio:.1f}x fewer)",
            f"wall time:                no cache {self.wall_s_no_cache:.2f} s, "
            f"cached {self.wall_s_cached:.2f} s ({self.speedup:.1f}x faster)",
            f"cache size:               {self.cache_bytes} bytes "
            f"({self.cache_bytes / 2**20:.1f} MiB)",
        ]


def verify(session: ModelSession, prompt: str, max_tokens: int) -> VerifyReport:
    prompt_ids = session.encode_prompt(prompt)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    slow = generate_once(session, prompt_ids, params, no_cache=True, keep_logits=True)
    fast = generate_once(session, prompt_ids, params, no_cache=False, keep_logits=True)
    first = next(
        (i for i, (a, b) in enumerate(zip(slow.token_ids, fast.token_ids, strict=True)) if a != b),
        None,
    )
    compared = len(slow.step_logits) if first is None else first + 1
    diff = max(
        float((a - b).abs().max())
        for a, b in zip(slow.step_logits[:compared], fast.step_logits[:compared], strict=True)
    )
    same_bits = all(
        torch.equal(a, b)
        for a, b in zip(slow.step_logits[:compared], fast.step_logits[:compared], strict=True)
    )
    spec = session.model.kv_cache_spec()
    cache_bytes = spec.bytes_per_token * (len(prompt_ids) + max_tokens)
    return VerifyReport(
        prompt_tokens=len(prompt_ids),
        generated_tokens=len(fast.token_ids),
        same_tokens=first is None,
        first_divergence=first,
        max_abs_logit_diff=diff,
        bitwise_equal=same_bits and first is None,
        kv_projections_no_cache=slow.kv_projections,
        kv_projections_cached=fast.kv_projections,
        wall_s_no_cache=slow.ttft_s + slow.decode_s,
        wall_s_cached=fast.ttft_s + fast.decode_s,
        cache_bytes=cache_bytes,
    )
