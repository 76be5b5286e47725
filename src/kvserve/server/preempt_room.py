"""Which prompts a full engine may still be fed under the "priority" policy: those that will
take a running request's seat by preempting it (engine/fairness.py), so a chat never waits
outside the engine while a batch holds every seat.

A request group's class is the server's to say: one prompt with n = 1 (a chat turn, a single
completion) is interactive; every prompt of a multi-prompt completion, and any n > 1 request,
is batch. A full engine takes an interactive prompt while batch sequences run that no
interactive request already waiting will take, and a prompt of a tenant whose sequences
(running or waiting) are two or more fewer than another tenant's. So what waits in the engine
stays O(max_num_seqs).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvserve.engine import fairness
from kvserve.engine.request import RequestClass

if TYPE_CHECKING:
    from kvserve.engine.scheduler import Scheduler
    from kvserve.server.request_group import RequestGroup


def group_class(group: RequestGroup) -> RequestClass:
    """Interactive: a group of one prompt with n = 1; every other group's prompts: batch."""
    if len(group.prompts) == 1 and group.prompts[0].params.n == 1:
        return RequestClass.INTERACTIVE
    return RequestClass.BATCH


@dataclass(slots=True)
class PreemptRoom:
    spare_batch: int  # batch sequences running that no waiting interactive request will take
    loads: fairness.TenantLoads  # sequences per tenant, running or waiting in the engine

    @classmethod
    def of(cls, sched: Scheduler) -> PreemptRoom:
        running, waiting = sched.running, sched.waiting
        batch = sum(fairness.sequences(r) for r in running if r.request_class is RequestClass.BATCH)
        interactive = sum(1 for r in waiting if r.request_class is RequestClass.INTERACTIVE)
        return cls(batch - interactive, fairness.tenant_loads([*running, *waiting]))

    @property
    def possible(self) -> bool:
        """Whether any prompt at all may be taken (else the turn is skipped: O(1))."""
        return self.spare_batch > 0 or len(self.loads) > 1

    def take(self, request_class: RequestClass, tenant: str | None, n: int) -> bool:
        """Whether a prompt of this class and tenant (n sequences) may be fed now; if so it
        is counted."""
        mine = self.loads.get(tenant, 0)
        if request_class is RequestClass.INTERACTIVE and self.spare_batch > 0:
            self.spare_batch -= n
        elif not any(t != tenant and mine + 1 < load for t, load in self.loads.items()):
            return False
        self.loads[tenant] = mine + n
        return True
