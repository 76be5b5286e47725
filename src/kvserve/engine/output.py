"""After sampling: append the token, grow the text, decide whether the request stops, and
snapshot it as a RequestOutput (with the text delta a stream may show)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvserve.engine.request import Request, RequestOutput, RequestStatus
from kvserve.sampling import top_logprobs


def find_stop(text: str, stops: Sequence[str]) -> int:
    """Index where the earliest stop string starts in text, or -1."""
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(hits) if hits else -1


def append_token(
    req: Request, token: int, logits: torch.Tensor, max_model_len: int
) -> RequestStatus | None:
    """Append one sampled token; returns the finished status, or None to keep going."""
    params = req.sampling_params
    req.all_token_ids.append(token)
    if req.logprobs is not None:
        req.logprobs.append(top_logprobs(logits, params.logprobs, token))
    if req.detokenizer is not None:
        before = len(req.text)
        req.text += req.detokenizer.add(token)
        if params.stop:
            # a stop string can only end in the new text; start looking just early enough
            longest = max(len(s) for s in params.stop)
            start = max(0, before - longest + 1)
            cut = find_stop(req.text[start:], params.stop)
            if cut >= 0:
                req.text = req.text[: start + cut]
                return RequestStatus.FINISHED_STOPPED
    if token in params.stop_token_ids or (not params.ignore_eos and token in req.eos_token_ids):
        return RequestStatus.FINISHED_STOPPED
    if req.num_output_tokens >= params.max_tokens or req.num_tokens >= max_model_len:
        if req.detokenizer is not None:
            req.text += req.detokenizer.flush()
        return RequestStatus.FINISHED_LENGTH
    return None


def make_output(req: Request, new_token_ids: list[int]) -> RequestOutput:
    finished = req.status.finished
    # hold back text that might still become the start of a stop string
    holdback = 0 if finished else max((len(s) for s in req.sampling_params.stop), default=1) - 1
    visible = max(req.num_emitted_chars, len(req.text) - holdback)
    new_text = req.text[req.num_emitted_chars : visible]
    req.num_emitted_chars = visible
    arrival = req.arrival_time
    return RequestOutput(
        request_id=req.request_id,
        prompt_token_ids=req.prompt_token_ids,
        token_ids=req.output_token_ids,
        text=req.text,
        new_token_ids=new_token_ids,
        new_text=new_text,
        finished=finished,
        finish_reason=req.status.value if finished else None,
        num_cached_tokens=max(req.num_cached_tokens, 0),
        # a copy: the snapshot may be read on another thread while the request goes on
        logprobs=None if req.logprobs is None else list(req.logprobs),
        queue_time_s=None
        if req.first_scheduled_time is None
        else req.first_scheduled_time - arrival,
        ttft_s=None if req.first_token_time is None else req.first_token_time - arrival,
        decode_time_s=(
            None
            if req.finished_time is None or req.first_token_time is None
            else req.finished_time - req.first_token_time
        ),
        num_preemptions=req.num_preemptions,
        kv_projections=req.kv_projections,
        parent_request_id=req.parent_id,
        index=req.sample_index,
    )
