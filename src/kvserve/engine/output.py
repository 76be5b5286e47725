"""After sampling: append the token, grow the text, decide whether the request stops, and
describe it as a RequestOutput.

An output carries what the request's earlier outputs did not (``new_token_ids``,
``new_text``, ``new_logprobs``: O(1) per step). The whole lists so far (``token_ids``,
``text``, ``logprobs``) cost O(tokens so far), so they are built only for the final output,
or at every step for a request whose ``output_kind`` is CUMULATIVE; a stream of T tokens
then costs O(T), not O(T^2).
"""

from __future__ import annotations

from collections.abc import Sequence

from kvserve.engine.request import Request, RequestOutput, RequestStatus
from kvserve.sampling import RequestOutputKind


def find_stop(text: str, stops: Sequence[str]) -> int:
    """Index where the earliest stop string starts in text, or -1."""
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(hits) if hits else -1


def append_token(
    req: Request, token: int, logprobs: dict[int, float] | None, max_model_len: int
) -> RequestStatus | None:
    """Append one sampled token and its logprobs (from ``batch_logprobs``; ignored unless the
    request asked for logprobs); returns the finished status, or None to keep going."""
    params = req.sampling_params
    req.all_token_ids.append(token)
    if req.logprobs is not None:
        assert isinstance(logprobs, dict), "a request with logprobs needs this token's"
        req.logprobs.append(logprobs)
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


def take_text_delta(req: Request) -> str:
    """The text not handed out yet, marked as handed out. Until the request finishes, text
    that might still become the start of a stop string is held back."""
    finished = req.status.finished
    holdback = 0 if finished else max((len(s) for s in req.sampling_params.stop), default=1) - 1
    visible = max(req.num_emitted_chars, len(req.text) - holdback)
    new_text = req.text[req.num_emitted_chars : visible]
    req.num_emitted_chars = visible
    return new_text


def make_output(req: Request) -> RequestOutput | None:
    """The request's output after a step; None for a FINAL_ONLY request still running."""
    finished = req.status.finished
    kind = req.sampling_params.output_kind
    if kind is RequestOutputKind.FINAL_ONLY and not finished:
        return None
    # the delta: output tokens [num_emitted_tokens, num_output_tokens), one for a step
    lo = req.num_emitted_tokens
    new_token_ids = req.all_token_ids[req.num_prompt_tokens + lo :]
    req.num_emitted_tokens = req.num_output_tokens
    new_logprobs = None if req.logprobs is None else req.logprobs[lo:]
    whole = finished or kind is RequestOutputKind.CUMULATIVE
    # a running request's lists go on growing, maybe read on another thread: copies.
    # A finished one's never change again: its logprobs list is handed over as it is
    logprobs = None
    if whole and req.logprobs is not None:
        logprobs = req.logprobs if finished else list(req.logprobs)
    arrival = req.arrival_time
    return RequestOutput(
        request_id=req.request_id,
        prompt_token_ids=req.prompt_token_ids,
        new_token_ids=new_token_ids,
        new_text=take_text_delta(req),
        new_logprobs=new_logprobs,
        finished=finished,
        finish_reason=req.status.value if finished else None,
        token_ids=req.output_token_ids if whole else None,
        text=req.text if whole else None,
        logprobs=logprobs,
        num_cached_tokens=max(req.num_cached_tokens, 0),
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
        kv_cache=req.cache_explanation,
        num_dropped_tokens=None
        if req.streaming_keep is None
        else max(0, req.num_tokens - req.streaming_keep),
        parent_request_id=req.parent_id,
        index=req.sample_index,
        error=req.error,
        # complete once a token was sampled, and never changed again: shared, not copied
        prompt_logprobs=req.prompt_logprobs,
        prompt_token_ranks=req.prompt_token_ranks,
    )
