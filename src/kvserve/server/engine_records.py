"""The typed records that cross the AsyncEngine boundary: what a caller submits, the events
each request group receives, the refusals, the loop's health verdict, and what a replica tells
a router about itself."""

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
    explain_cache: bool = False  # outputs carry kv_cache (kv/cache_explain.py)
    tenant: str | None = None  # the caller's (API key's); the scheduler is fair among them


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


@dataclass(frozen=True, slots=True)
class WorkerInfo:
    """What a replica tells a router about itself; fixed once the model is loaded."""

    model_path: str
    served_model_name: str
    model_type: str
    architectures: tuple[str, ...]
    tokenizer_path: str | None
    dtype: str  # activations and the KV cache
    max_model_len: int
    num_kv_blocks: int
    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    scheduling_policy: str
    version: str
