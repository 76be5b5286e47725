"""DeepSeek's mixture-of-experts MLP: a router over ``n_routed_experts`` gated MLPs, plus
``n_shared_experts`` worth of always-on MLP, as transformers' DeepseekV2Moe / DeepseekV3MoE.

Module names equal the Hugging Face checkpoint names (``mlp.gate.weight``,
``mlp.gate.e_score_correction_bias``, ``mlp.experts.{e}.gate_proj.weight``, ...), so loading
is a lookup and every expert is a plain linear that weight_formats.py may pack or quantize.

Routing is vectorized (scores, group mask and top-k for all T tokens at once, in float32 as
HF); the experts then run once each over the tokens routed to them (one sort of the T x k
assignments, no per-token Python), their outputs weighted and added with ``index_add_``.
"""

from __future__ import annotations

import torch
from torch import nn

from kvserve.models.deepseek_config import DeepseekConfig
from kvserve.models.layers import GatedMLP


class DeepseekGate(nn.Module):
    """Top-k routing. ``weight`` (experts, hidden) and the V3 bias stay float32 (HF keeps
    them so: ``_keep_in_fp32_modules_strict``)."""

    def __init__(self, config: DeepseekConfig) -> None:
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.num_experts = config.n_routed_experts
        self.scoring = config.scoring_func
        self.method = config.topk_method
        self.n_group, self.topk_group = config.n_group, config.topk_group
        self.scaling = config.routed_scaling_factor
        self.norm_topk_prob = config.norm_topk_prob
        self.weight = nn.Parameter(torch.empty(self.num_experts, config.hidden_size))
        if self.scoring == "sigmoid":
            self.e_score_correction_bias = nn.Parameter(torch.empty(self.num_experts))
        else:
            self.e_score_correction_bias = None

    def _group_mask(self, group_scores: torch.Tensor) -> torch.Tensor:
        """group_scores (T, n_group) -> (T, experts) bool: experts of the best topk_group."""
        idx = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False)[1]
        mask = torch.zeros_like(group_scores).scatter_(1, idx, 1).bool()
        per_group = self.num_experts // self.n_group
        return mask[:, :, None].expand(-1, -1, per_group).reshape(-1, self.num_experts)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (T, hidden) -> weights (T, k) float32, expert ids (T, k)."""
        logits = torch.nn.functional.linear(x.float(), self.weight.float())  # (T, experts)
        t, per_group = x.shape[0], self.num_experts // self.n_group
        if self.scoring == "softmax":  # V2
            scores = logits.softmax(dim=-1, dtype=torch.float32)
            if self.method == "group_limited_greedy":
                groups = scores.view(t, self.n_group, per_group).max(dim=-1).values
                scores = scores.masked_fill(~self._group_mask(groups), 0.0)
            weights, ids = torch.topk(scores, k=self.top_k, dim=-1, sorted=False)
            return weights * self.scaling, ids
        # V3: sigmoid; the bias moves the choice, never the weights
        scores = logits.sigmoid()
        assert self.e_score_correction_bias is not None
        choice = scores + self.e_score_correction_bias.float()
        groups = choice.view(t, self.n_group, per_group).topk(2, dim=-1)[0].sum(dim=-1)
        choice = choice.masked_fill(~self._group_mask(groups), float("-inf"))
        ids = torch.topk(choice, k=self.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, ids)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.scaling, ids


class DeepseekMoE(nn.Module):
    def __init__(self, config: DeepseekConfig) -> None:
        super().__init__()
        hidden, inter = config.hidden_size, config.moe_intermediate_size
        self.gate = DeepseekGate(config)
        self.experts = nn.ModuleList(
            GatedMLP(hidden, inter) for _ in range(config.n_routed_experts)
        )
        self.shared_experts = (
            GatedMLP(hidden, inter * config.n_shared_experts) if config.n_shared_experts else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (T, hidden) -> (T, hidden)."""
        weights, ids = self.gate(x)  # (T, k)
        k = ids.shape[1]
        flat = ids.reshape(-1)  # (T * k,): assignment a is token a // k's choice a % k
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=len(self.experts)).tolist()  # one sync
        tokens = order // k
        w = weights.reshape(-1)[order]
        out = torch.zeros_like(x)
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            rows = tokens[start : start + n]
            y = self.experts[e](x[rows])  # (n, hidden)
            # HF: the float32 weight promotes the product, then back to the activation dtype
            out.index_add_(0, rows, (y * w[start : start + n, None]).to(x.dtype))
            start += n
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out
