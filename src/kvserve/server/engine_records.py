"""The typed records that cross the AsyncEngine boundary: what a caller submits, the events
each request group receives, the refusals, and the loop's health verdict."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from kvserve.engine.request import RequestOutput
from kvserve.sampling import SamplingParams


class QueueFullError(Exception):
    """The bounded waiting queue has no room for this request now; retry later."""


class EngineDeadError(Exception):
    """The engine loop has stopped; nothing more will run."""


@dataclass(frozen=True, slots=True)
class PromptSpec:
    """One prompt of a group, already tokenized and checked."""

    prompt_token_ids: list[int]
    params: SamplingParams


@dataclass(frozen=True, slots=True)
class OutputEvent:
    prompt_index: int  # which prompt of the group
    output: RequestOutput


@dataclass(frozen=True, slots=True)
class ErrorEvent:
    message: str
    status: int  # the HTTP status it would have had before streaming began


Event = OutputEvent | ErrorEvent


class Health(enum.Enum):
    OK = "ok"
    WEDGED = "wedged"  # alive, but no step has finished for too long while work waits
    DEAD = "dead"  # the loop thread has stopped


@dataclass(frozen=True, slots=True)
class HealthStatus:
    state: Health
    message: str = ""

    @property
    def ok(self) -> bool:
        return self.state is Health.OK
