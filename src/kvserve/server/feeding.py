"""How the AsyncEngine's loop thread feeds the engine (a mixin of ``AsyncEngine``, whose state
it uses; split out so each file stays one idea).

Groups wait in the AsyncEngine, not in the engine. Each loop iteration hands the engine what
its next step can admit, round-robin, one prompt per group per turn: free ``max_num_seqs``
seats, and prompt tokens fed but not yet started under one step's budget. Each prompt's
priority is its index in its group (a single request: 0), which the "priority" scheduling
policy orders by, so batches yield to single requests; under that policy each prompt also
carries its class (interactive: a group of one prompt with n = 1; else batch) and its tenant,
and a full engine is still fed the prompts that will preempt a running one for their seat
(server/preempt_room.py, engine/fairness.py).
"""

from __future__ import annotations

import bisect
from typing import TYPE_CHECKING

from kvserve.server.engine_records import ErrorEvent
from kvserve.server.preempt_room import PreemptRoom, group_class

if TYPE_CHECKING:
    from kvserve.server.async_engine import AsyncEngine


class Feeding:
    """``_feed``: the engine's admission from the AsyncEngine's pending groups."""

    def _feed(self: AsyncEngine) -> None:
        """Hand the engine what its next step can admit, one prompt per group per turn.

        A prompt is fed while the prompt tokens fed ahead of it and not yet started stay under
        one step's budget. "Ahead" is every such prompt under fcfs/lpm, but only those of
        equal or better priority under "priority": the engine will schedule this prompt before
        the rest, so a batch's unstarted prompts never hold a single request out here."""
        sched = self.engine.scheduler
        seats = sched.config.max_num_seqs - len(sched.running) - len(sched.waiting)
        budget = sched.config.max_num_batched_tokens
        by_priority = sched.config.scheduling_policy == "priority"
        # ((class, priority), prompt tokens) of what was fed and has not started, best first
        queued = sorted(
            ((r.request_class, r.priority), r.num_prompt_tokens) for r in self._not_started.values()
        )
        if not by_priority:
            queued = [((0, 0), sum(n for _, n in queued))]
        if _tokens_ahead(queued, (0, 0)) >= budget:
            return  # not even a group's first prompt fits: skip the O(groups) turn
        room: PreemptRoom | None = None  # a full engine's: what will preempt for its seat
        turn = len(self._pending)  # groups not yet offered a prompt this turn
        while self._pending and turn > 0:
            if seats <= 0 and room is None:
                room = PreemptRoom.of(sched) if by_priority else None
                if room is None or not room.possible:
                    break
            group = self._pending.popleft()
            turn -= 1
            if group.done:
                continue  # aborted while waiting here; its count is already returned
            # a batch's k-th prompt gets priority k: under the "priority" policy batches
            # yield to single requests, and batches interleave prompt by prompt
            i = group.num_fed
            klass = group_class(group)
            ahead = (klass, i) if by_priority else (0, 0)
            spec = group.prompts[i]
            if _tokens_ahead(queued, ahead) >= budget or (
                room is not None and not room.take(klass, spec.tenant, spec.params.n)
            ):
                self._pending.append(group)  # its turn comes again next step
                continue
            rid = group.request_ids[i]
            try:
                req = self.engine.add_request(
                    spec.prompt_token_ids,
                    spec.params,
                    rid,
                    group.cache_salt,
                    priority=i,
                    explain_cache=spec.explain_cache,
                    request_class=klass,
                    tenant=spec.tenant,
                )
            except ValueError as e:  # checked by the handler already; a last line of defence
                self._abort_group(group, f"refused by the engine: {e}")
                group.put(ErrorEvent(str(e), 400))
                continue
            group.num_fed += 1
            self._groups[rid] = group
            self._not_started[rid] = req
            seats -= spec.params.n
            if by_priority:
                bisect.insort(queued, (ahead, len(spec.prompt_token_ids)))
            else:
                queued[0] = ((0, 0), queued[0][1] + len(spec.prompt_token_ids))
            if group.num_fed < len(group.prompts):
                self._pending.append(group)
                turn += 1  # round-robin: offered again after every other group


def _tokens_ahead(queued: list[tuple[tuple[int, int], int]], priority: tuple[int, int]) -> int:
    """Prompt tokens of the sorted ``queued`` ((class, priority), tokens) at ``priority`` or
    better."""
    total = 0
    for p, n in queued:
        if p > priority:
            break
        total += n
    return total
