"""Fairness under the "priority" scheduling policy: interactive requests before batches, and
tenants by the sequences they run.

Order of the waiting queue, each step: (class, the tenant's projected share, priority,
arrival). Class first: an interactive request (the server's request group of one prompt with
n = 1) before any batch member (a prompt of a multi-prompt completion, or an n > 1 request).
The projected share of a tenant's k-th waiting request is the sequences its tenant runs plus
those of its k - 1 waiting before it, so tenants are admitted round-robin, least running
first; with one tenant (no API keys) the order is vLLM's (priority, arrival).

Preemption for admission (the scheduler's ``_admit``): a waiting request with no seat or no
KV takes them from a running request it *outranks*: it is interactive and the running one
batch, or both are of one class, of different tenants, and its tenant runs at least two
sequences fewer (``load(W) + 1 < load(V)``: moving one seat never makes the other tenant the
smaller by more, so two tenants never take a seat back and forth). The preempted request is
recomputed later (its blocks stay in the prefix cache until evicted). Nothing else preempts
for admission: a batch never preempts its own tenant's batch, and an interactive request
never preempts another's of a tenant at or under its share.

Victims, for admission and for a running request's growth alike: the worst-ranked running
request, by (class, its tenant's load, priority, arrival, admission order), the max; so batch
members go first, the most recently admitted of the tenant running most (vLLM's priority
policy preempts the max of (priority, arrival)).

Pure Python over requests; no KV, no tensors.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from kvserve.engine.request import Request

TenantLoads = dict[str | None, int]  # tenant -> sequences it runs (None: no tenants)


def sequences(req: Request) -> int:
    """Seats ``req`` takes: an n > 1 request not yet forked brings its n - 1 samples with its
    first token; a forked sample (or parent) is one."""
    return 1 if req.forked else req.sampling_params.n


def tenant_loads(running: Iterable[Request]) -> TenantLoads:
    loads: TenantLoads = {}
    for req in running:
        loads[req.tenant] = loads.get(req.tenant, 0) + sequences(req)
    return loads


def rank(req: Request) -> tuple[int, int, float]:
    """The order within one tenant: interactive first, then lower priority, then arrival."""
    return (req.request_class, req.priority, req.arrival_time)


def order_fairly(waiting: Iterable[Request], loads: TenantLoads) -> list[Request]:
    """The waiting queue in (class, projected tenant share, priority, arrival) order."""
    order = sorted(waiting, key=rank)
    if len({r.tenant for r in order} | loads.keys()) <= 1:
        return order  # one tenant: the share grows with the rank, the order is the rank's
    projected = dict(loads)
    keys = []
    for req in order:
        share = projected.get(req.tenant, 0)
        projected[req.tenant] = share + sequences(req)
        keys.append((req.request_class, share))
    idx = sorted(range(len(order)), key=keys.__getitem__)  # stable: ties keep the rank
    return [order[i] for i in idx]


def outranks(waiting: Request, running: Request, loads: TenantLoads) -> bool:
    """May ``waiting`` preempt ``running`` to be admitted?"""
    if waiting.request_class != running.request_class:
        return waiting.request_class < running.request_class
    if waiting.tenant == running.tenant:
        return False
    return loads.get(waiting.tenant, 0) + 1 < loads.get(running.tenant, 0)


def victim(
    running: Sequence[Request],
    loads: TenantLoads,
    eligible: Callable[[Request], bool] | None = None,
) -> Request | None:
    """The running request to preempt (the worst-ranked ``eligible`` one), or None."""
    worst: Request | None = None
    worst_key: tuple[int, int, int, float, int] | None = None
    for i, req in enumerate(running):
        if eligible is not None and not eligible(req):
            continue
        key = (req.request_class, loads.get(req.tenant, 0), req.priority, req.arrival_time, i)
        if worst_key is None or key > worst_key:
            worst, worst_key = req, key
    return worst
