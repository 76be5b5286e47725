"""Fault containment: what a step that raised leaves behind, and the hook that makes one raise.

A step that raises (in the model, the sampler, or the bookkeeping after them) must not take
the engine with it. ``contain_step_failure`` finishes every request that was in the step with
FINISHED_ERROR (its output's ``error`` names the failure) and repairs what the half-done step
left behind:

- blocks ``schedule()`` allocated, copy-on-write copies, ``num_computed_tokens`` advanced or
  not, siblings forked in the step: all belong to the failed requests, and finishing them
  frees it all;
- prefix-cache hashes: a failed request's blocks may hold K/V that were never (or only
  partly) written, so each of its blocks that no live request still holds leaves the hash
  table. A block another live request holds was registered by a step that completed (that
  request hit it, or was forked with it, before this step), so it keeps its hash;
- then ``check_engine_state``; if the scheduler and the KV bookkeeping disagree, every
  request fails and the KV manager starts over (``fail_all``).

Requests not in the step are untouched: they go on and produce the tokens of a fault-free run.
A failed step always finishes at least one request, so a loop over ``step()`` ends.

``FaultInjector`` makes the model raise on chosen steps: tests hand one to the engine, and
``kvserve serve`` builds one from ``KVSERVE_FAULT_STEPS`` (read by the CLI only).
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvserve.engine.output import make_output
from kvserve.engine.request import Request, RequestOutput, RequestStatus

if TYPE_CHECKING:
    from kvserve.engine.engine import LLMEngine

logger = logging.getLogger(__name__)

FAULT_STEPS_ENV = "KVSERVE_FAULT_STEPS"  # e.g. "5,6,10-12": the model steps that raise


class InjectedFault(RuntimeError):
    """Raised by a FaultInjector on one of its steps."""


@dataclass(slots=True)
class FaultInjector:
    """Makes the model raise ``InjectedFault`` on chosen model steps: the k-th step that runs
    the model (1-based; steps with nothing scheduled do not count). Engine-owned, no globals."""

    steps: frozenset[int]
    num_model_steps: int = 0  # model steps seen so far

    def __post_init__(self) -> None:
        bad = [s for s in self.steps if isinstance(s, bool) or not isinstance(s, int) or s < 1]
        if bad:
            raise ValueError(f"fault steps must be integers >= 1, got {sorted(bad, key=str)}")

    @classmethod
    def parse(cls, text: str) -> FaultInjector | None:
        """``"5,6,10-12"`` -> steps {5, 6, 10, 11, 12}; empty -> None (no injection)."""
        steps: set[int] = set()
        for part in (p.strip() for p in text.split(",")):
            if not part:
                continue
            lo, sep, hi = part.partition("-")
            try:
                first, last = int(lo), int(hi if sep else lo)
            except ValueError:
                raise ValueError(
                    f"{FAULT_STEPS_ENV}: {part!r} is not a step or a range like 10-12"
                ) from None
            if first < 1 or last < first:
                raise ValueError(f"{FAULT_STEPS_ENV}: {part!r} must be N or N-M with 1 <= N <= M")
            steps.update(range(first, last + 1))
        return cls(frozenset(steps)) if steps else None

    def before_model(self) -> None:
        """Called by the model runner once per model step, before the forward pass."""
        self.num_model_steps += 1
        if self.num_model_steps in self.steps:
            raise InjectedFault(f"injected fault at model step {self.num_model_steps}")


@dataclass(slots=True)
class StepRecord:
    """What one step has touched so far: enough to contain its failure."""

    requests: list[Request] = field(default_factory=list)  # scheduled, then siblings forked
    forked: list[str] = field(default_factory=list)  # n > 1 parents that forked in this step
    outputs: list[RequestOutput] = field(default_factory=list)  # built before it failed


def describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


def contain_step_failure(
    engine: LLMEngine, record: StepRecord, error: Exception
) -> list[RequestOutput]:
    """Fail the step's requests, repair the state; the outputs the step still owes."""
    message = describe(error)
    in_step = list({id(r): r for r in record.requests}.values())
    logger.error(
        "engine step failed (%s): failing the %d requests in it", message, len(in_step),
        exc_info=error,
    )  # fmt: skip
    outputs = list(record.outputs)  # e.g. requests that finished normally before the raise
    if not in_step:  # it raised in schedule(): no step to blame, only the state
        return outputs + fail_all(engine, message)
    finals = {o.request_id for o in outputs if o.finished}
    try:
        held = [b for r in in_step for b in engine.kv_manager.held_blocks(r.request_id)]
        for req in in_step:
            if not req.status.finished:
                _finish_with_error(engine, req, record, message, outputs)
            elif req.request_id not in finals and req.status is not RequestStatus.FINISHED_ERROR:
                # it finished in this step, but the raise lost its final output: fail it too
                req.status, req.error = RequestStatus.FINISHED_ERROR, message
                outputs.append(make_output(req))  # type: ignore[arg-type]  # finished
        engine.kv_manager.pool.uncache(held)
        check_engine_state(engine)
    except Exception as broken:  # noqa: BLE001 - whatever is wrong, the reset repairs it
        logger.error(
            "engine state inconsistent after the failed step (%s): failing every request and "
            "rebuilding the KV cache state", describe(broken),
        )  # fmt: skip
        outputs.extend(fail_all(engine, f"{message} (engine state rebuilt)"))
    return outputs


def _finish_with_error(
    engine: LLMEngine,
    req: Request,
    record: StepRecord,
    message: str,
    outputs: list[RequestOutput],
) -> None:
    """Finish one request of the failed step, appending its error output to ``outputs``; an
    n > 1 parent whose samples were (being) forked in this step takes them along."""
    req.error = message
    engine.scheduler.finish(req, RequestStatus.FINISHED_ERROR)
    outputs.append(make_output(req))  # type: ignore[arg-type]  # finished: not None
    params, rid = req.sampling_params, req.request_id
    if params.n == 1 or req.parent_id is not None:
        return
    forked_now = rid in record.forked
    if forked_now:  # its siblings were born in this step: they share its fate
        for i in range(1, params.n):
            child = engine.scheduler.requests.get(f"{rid}-{i}")
            if child is not None:
                child.error = message
                engine.scheduler.finish(child, RequestStatus.FINISHED_ERROR)
                outputs.append(make_output(child))  # type: ignore[arg-type]
    if forked_now or not req.forked:
        have = {o.index for o in outputs if rid in (o.request_id, o.parent_request_id)}
        outputs.extend(_unborn_siblings(req, have, message))


def _unborn_siblings(parent: Request, have: set[int], message: str) -> list[RequestOutput]:
    """Error outputs for the samples of an n > 1 request that were never forked, so a caller
    waiting for all n finals gets them."""
    outputs = []
    for i in range(1, parent.sampling_params.n):
        if i in have:
            continue
        child = Request(
            request_id=f"{parent.request_id}-{i}",
            prompt_token_ids=parent.prompt_token_ids,
            sampling_params=parent.sampling_params,
            eos_token_ids=parent.eos_token_ids,
            arrival_time=parent.arrival_time,
            priority=parent.priority,
            status=RequestStatus.FINISHED_ERROR,
            parent_id=parent.request_id,
            sample_index=i,
            finished_time=parent.finished_time,
            error=message,
        )
        outputs.append(make_output(child))  # type: ignore[arg-type]  # finished: not None
    return outputs


def fail_all(engine: LLMEngine, message: str) -> list[RequestOutput]:
    """Fail every request the engine holds and start the KV bookkeeping over (the prefix cache
    too). Raises if the state is still inconsistent afterwards (nothing more to try here)."""
    sched = engine.scheduler
    live: dict[str, Request] = {}
    for req in itertools.chain(sched.requests.values(), sched.running, sched.waiting):
        live.setdefault(req.request_id, req)
    now = time.monotonic()
    outputs: list[RequestOutput] = []
    for req in live.values():
        if req.status.finished:
            continue  # left over by a broken finish(): its final output is already out
        req.status, req.error, req.finished_time = RequestStatus.FINISHED_ERROR, message, now
        try:
            outputs.append(make_output(req))  # type: ignore[arg-type]  # finished: not None
            if req.sampling_params.n > 1 and req.parent_id is None and not req.forked:
                outputs.extend(_unborn_siblings(req, set(), message))
        except Exception:  # noqa: BLE001 - one broken request must not stop the reset
            logger.exception("no error output for request %s", req.request_id)
    sched.running.clear()
    sched.waiting.clear()
    sched.requests.clear()
    engine.kv_manager.reset()
    check_engine_state(engine)
    if live:
        logger.error("failed all %d requests and reset the KV cache: %s", len(live), message)
    return outputs


def check_engine_state(engine: LLMEngine) -> None:
    """The scheduler's queues, its request index and the KV manager's block tables agree
    (plus ``KVCacheManager.check_integrity``). O(requests + blocks): for after a failure."""
    kv, sched = engine.kv_manager, engine.scheduler
    kv.check_integrity()
    running = [r.request_id for r in sched.running]
    waiting = [r.request_id for r in sched.waiting]
    queued = set(running) | set(waiting)
    assert len(queued) == len(running) + len(waiting), "a request is queued twice"
    assert queued == sched.requests.keys(), (
        f"queued and indexed requests differ: {sorted(queued ^ sched.requests.keys())}"
    )
    for req in sched.running:
        assert sched.requests[req.request_id] is req and req.status is RequestStatus.RUNNING, (
            f"running request {req.request_id} is {req.status}"
        )
        held = len(kv.blocks_of(req.request_id)) * kv.block_size
        assert req.num_computed_tokens <= min(held, req.num_tokens), (
            f"request {req.request_id}: {req.num_computed_tokens} computed tokens, "
            f"{req.num_tokens} tokens, blocks for {held}"
        )
    for req in sched.waiting:
        assert sched.requests[req.request_id] is req, f"{req.request_id} is indexed twice"
        assert req.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED), (
            f"waiting request {req.request_id} is {req.status}"
        )
    holders = {rid for rid, blocks in kv.req_to_blocks.items() if blocks}
    assert holders <= set(running), f"blocks held by requests not running: {holders - set(running)}"
