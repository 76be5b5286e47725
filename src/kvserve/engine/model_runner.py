"""ModelRunner: SchedulerOutput -> input tensors + AttentionMetadata -> logits of sampling rows.

Lays the step's tokens out flat, decodes (one query token) first so the attention backend
can batch them, computes each token's slot from its request's block table:

    slot = block_ids[pos // block_size] * block_size + pos % block_size
"""

from __future__ import annotations

import torch

from kvserve.engine.request import Request
from kvserve.engine.scheduler import ScheduledRequest, SchedulerOutput
from kvserve.kv.storage import KVCacheStorage
from kvserve.models.llama import LlamaForCausalLM
from kvserve.paged_attention import AttentionMetadata, PagedAttention


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, storage: KVCacheStorage) -> None:
        self.model = model
        self.storage = storage
        self.block_size = storage.spec.block_size
        self.device = model.device

    def build_metadata(
        self, order: list[ScheduledRequest], requests: dict[str, Request]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        bs = self.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        starts = [0]
        seq_lens = []
        for s in order:
            req = requests[s.request_id]
            lo, hi = s.num_computed_tokens, s.num_computed_tokens + s.num_new_tokens
            ids.extend(req.all_token_ids[lo:hi])
            positions.extend(range(lo, hi))
            table = s.block_ids
            slots.extend(table[p // bs] * bs + p % bs for p in range(lo, hi))
            starts.append(len(ids))
            seq_lens.append(hi)
        width = max(len(s.block_ids) for s in order)
        # one tensor from a padded list: no per-request tensor on the step's hot path
        padded = [s.block_ids + [0] * (width - len(s.block_ids)) for s in order]
        tables = torch.tensor(padded, dtype=torch.long)
        dev = self.device
        md = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            query_start_loc=starts,
            seq_lens=seq_lens,
            block_tables=tables.to(dev),
            num_decodes=sum(1 for s in order if s.num_new_tokens == 1),
            seq_lens_tensor=torch.tensor(seq_lens, dtype=torch.long, device=dev),
        )
        input_ids = torch.tensor(ids, dtype=torch.long, device=dev)
        pos = torch.tensor(positions, dtype=torch.long, device=dev)
        return input_ids, pos, md

    @torch.inference_mode()
    def execute(
        self, out: SchedulerOutput, requests: dict[str, Request]
    ) -> dict[str, torch.Tensor]:
        """Run one step; returns next-token logits (vocab,) float32 for each sampling request."""
        if out.block_copies:
            src, dst = zip(*out.block_copies, strict=True)
            self.storage.copy_blocks(list(src), list(dst))
        if not out.scheduled:
            return {}
        # decodes first, shortest context first: the attention backend batches decodes in
        # groups of similar length, so little of each group is padding
        order = sorted(
            out.scheduled,
            key=lambda s: (s.num_new_tokens != 1, s.num_computed_tokens + s.num_new_tokens),
        )
        input_ids, positions, md = self.build_metadata(order, requests)
        hidden = self.model(input_ids, positions, PagedAttention(self.storage, md))
        rows = [i for i, s in enumerate(order) if s.samples]
        if not rows:
            return {}
        last = torch.tensor([md.query_start_loc[i + 1] - 1 for i in rows], device=self.device)
        logits = self.model.compute_logits(hidden[last])  # (num_sampling, vocab)
        return {order[i].request_id: logits[j] for j, i in enumerate(rows)}
