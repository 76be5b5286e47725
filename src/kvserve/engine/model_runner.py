"""ModelRunner: SchedulerOutput -> input tensors + AttentionMetadata -> logits of sampling rows
(and the prompt logprobs of the chunks of requests that ask for them, engine/prompt_logprobs.py).

Lays the step's tokens out flat, decodes (one query token) first so the attention backend
can batch them, computes each token's slot from its request's block table:

    slot = block_ids[pos // block_size] * block_size + pos % block_size

per cache group (each has its own block table: kv/spec.py ``KVCacheSpec.groups``).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from kvserve.attention.paged import AttentionMetadata, PagedAttention
from kvserve.engine.faults import FaultInjector
from kvserve.engine.fused_decode import FusedDecode
from kvserve.engine.prompt_logprobs import (
    PromptLogprobs,
    compute_prompt_logprobs,
    positions_needed,
)
from kvserve.engine.request import Request
from kvserve.engine.scheduler import ScheduledRequest, SchedulerOutput
from kvserve.kv.storage import KVCacheStorage
from kvserve.models.llama import EAGER_STEPS, LayerSteps, LlamaForCausalLM


class StepLogits(NamedTuple):
    """What one step computed for the engine."""

    logits: dict[str, torch.Tensor]  # next-token logits (vocab,) float32 per sampling request
    prompt_logprobs: dict[str, PromptLogprobs]  # this step's prompt entries, where requested


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        storage: KVCacheStorage,
        steps: LayerSteps = EAGER_STEPS,
        fused: FusedDecode | None = None,
        faults: FaultInjector | None = None,
    ) -> None:
        self.model = model
        self.steps = steps  # the layer halves: eager or compiled (engine/compiled_steps.py)
        # all layers of an all-decode step (every step in batch-invariant mode) in one kernel
        # call (engine/fused_decode.py)
        self.fused = fused
        self.storage = storage
        self.block_size = storage.spec.block_size
        self.device = model.device
        self.faults = faults  # tests: make chosen model steps raise (engine/faults.py)
        # attention sinks turn the query for their keys to its position within the cache
        self.rotary = model.model.rotary_emb if storage.spec.has_sinks else None

    def build_metadata(
        self, order: list[ScheduledRequest], requests: dict[str, Request]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Flat input ids (T,), positions (T,) and the metadata, with no per-token Python.

        Request i owns tokens [q[i], q[i + 1]) of the step, at positions lo[i], lo[i] + 1, ...:

            t       = [0 1 2 | 3 | 4 5]                  arange(T)
            req_of  = [0 0 0 | 1 | 2 2]                  repeat_interleave(arange(B), n)
            pos     = t + (lo - q)[req_of]
            slot    = tables[req_of, pos // bs] * bs + pos % bs
        """
        bs = self.block_size
        dev = self.device
        ids: list[int] = []
        lo = [s.num_computed_tokens for s in order]
        lens = [s.num_new_tokens for s in order]
        seq_lens = [a + n for a, n in zip(lo, lens, strict=True)]
        starts = [0]  # (B + 1,)
        for s, a, hi in zip(order, lo, seq_lens, strict=True):
            ids.extend(requests[s.request_id].all_token_ids[a:hi])  # one slice per request
            starts.append(len(ids))
        num_tokens = starts[-1]
        lens_t = torch.tensor(lens, dtype=torch.long, device=dev)  # (B,)
        shift = [a - q for a, q in zip(lo, starts[:-1], strict=True)]  # position - token index
        shift_t = torch.tensor(shift, dtype=torch.long, device=dev)  # (B,)
        req_of = torch.repeat_interleave(
            torch.arange(len(order), device=dev), lens_t, output_size=num_tokens
        )  # (T,): which request each token belongs to
        pos = torch.arange(num_tokens, device=dev) + shift_t[req_of]  # (T,)
        tables, slots = [], []
        for g in range(len(order[0].block_tables)):  # one table and slot mapping per group
            width = max(len(s.block_tables[g]) for s in order)
            # one tensor from a padded list: no per-request tensor on the step's hot path;
            # entries a window gave back (-1) become 0: they are never read
            padded = [s.block_tables[g] + [0] * (width - len(s.block_tables[g])) for s in order]
            table = torch.tensor(padded, dtype=torch.long, device=dev).clamp_(min=0)
            tables.append(table)  # (B, width)
            slots.append(table[req_of, pos // bs] * bs + pos % bs)  # (T,)
        md = AttentionMetadata(
            slot_mapping=slots[0],
            query_start_loc=starts,
            seq_lens=seq_lens,
            block_tables=tables[0],
            num_decodes=sum(1 for n in lens if n == 1),
            seq_lens_tensor=torch.tensor(seq_lens, dtype=torch.long, device=dev),
            group_slot_mappings=slots,
            group_block_tables=tables,
        )
        input_ids = torch.tensor(ids, dtype=torch.long, device=dev)
        return input_ids, pos, md

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, requests: dict[str, Request]) -> StepLogits:
        """Run one step; returns next-token logits (vocab,) float32 for each sampling request,
        and the prompt logprobs of the prefill chunks that need them."""
        if out.block_copies:
            src, dst = zip(*out.block_copies, strict=True)
            self.storage.copy_blocks(list(src), list(dst))
        if not out.scheduled:
            return StepLogits({}, {})
        # decodes first, shortest context first: the attention backend batches decodes in
        # groups of similar length, so little of each group is padding
        order = sorted(
            out.scheduled,
            key=lambda s: (s.num_new_tokens != 1, s.num_computed_tokens + s.num_new_tokens),
        )
        input_ids, positions, md = self.build_metadata(order, requests)
        if self.faults is not None:
            self.faults.before_model()
        if self.fused is not None and self.fused.fits(md):
            hidden = self.fused(input_ids, positions, md, self.storage)
        else:
            attn = PagedAttention(
                self.storage, md, self.model.config.attention_scale, rotary=self.rotary
            )
            hidden = self.model(input_ids, positions, attn, self.steps)
        prompt = self._prompt_logprobs(order, requests, md.query_start_loc, hidden)
        rows = [i for i, s in enumerate(order) if s.samples]
        if not rows:
            return StepLogits({}, prompt)
        last = torch.tensor([md.query_start_loc[i + 1] - 1 for i in rows], device=self.device)
        logits = self.model.compute_logits(hidden[last])  # (num_sampling, vocab)
        return StepLogits({order[i].request_id: logits[j] for j, i in enumerate(rows)}, prompt)

    def _prompt_logprobs(
        self,
        order: list[ScheduledRequest],
        requests: dict[str, Request],
        starts: list[int],
        hidden: torch.Tensor,  # (T, hidden_size)
    ) -> dict[str, PromptLogprobs]:
        """Logits at every prompt position of the chunks whose requests want prompt logprobs
        (not only at the last one), turned into their entries."""
        result: dict[str, PromptLogprobs] = {}
        for i, s in enumerate(order):
            req = requests[s.request_id]
            needed = positions_needed(req, s.num_computed_tokens, s.num_new_tokens)
            if not needed:
                continue
            shift = starts[i] - s.num_computed_tokens  # row of position p = p + shift
            rows = range(needed.start + shift, needed.stop + shift)
            nxt = req.prompt_token_ids[needed.start + 1 : needed.stop + 1]
            k = req.sampling_params.prompt_logprobs
            assert k is not None
            logprobs, ranks = compute_prompt_logprobs(
                hidden, rows, nxt, k, self.model.compute_logits
            )
            result[s.request_id] = PromptLogprobs(needed.start + 1, logprobs, ranks)
        return result
