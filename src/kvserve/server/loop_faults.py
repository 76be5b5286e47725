"""How the AsyncEngine's loop thread answers faults (a mixin of ``AsyncEngine``, whose state
it uses; split out so each file stays one idea).

A step that raises is contained by the engine itself (``engine/faults.py``): its requests end
with finish reason ``error``, and ``_fail_group`` ends their groups with an ``ErrorEvent``.
What the engine cannot contain -- an exception escaping the loop, or
``max_consecutive_step_failures`` failed steps in a row -- restarts the loop (``_restart``):
every group in flight gets an ``ErrorEvent``, ``LLMEngine.fail_all`` rebuilds the KV state,
and the loop serves again. More than ``max_restarts`` restarts within ``restart_window_s``, a
restart that fails, or KeyboardInterrupt / SystemExit kill it (``_die``): ``alive`` turns False
and /health answers 503.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import TYPE_CHECKING

from kvserve.engine.faults import describe
from kvserve.engine.request import RequestOutput
from kvserve.server.engine_records import ErrorEvent
from kvserve.server.request_group import RequestGroup

if TYPE_CHECKING:
    from kvserve.server.async_engine import AsyncEngine

logger = logging.getLogger(__name__)


class RepeatedStepFailure(RuntimeError):
    """Engine steps keep failing: the loop restarts to rebuild the engine's state."""


class LoopFaults:
    """The loop thread's entry point (``_run``) and its fault paths."""

    def _run(self: AsyncEngine) -> None:
        """Serve; restart on an exception that escaped the engine's containment or on steps
        failing in a row; die past ``max_restarts`` restarts within ``restart_window_s``, on a
        restart that fails, or on KeyboardInterrupt / SystemExit."""
        restarts: deque[float] = deque()  # monotonic times of the recent restarts
        while True:
            try:
                self._serve()
                return  # shut down
            except Exception as e:  # noqa: BLE001 - every failure restarts or kills the loop
                now = time.monotonic()
                while restarts and now - restarts[0] > self.restart_window_s:
                    restarts.popleft()
                if len(restarts) >= self.max_restarts:
                    logger.error(
                        "the engine loop failed %d times within %.0f s; giving up",
                        len(restarts) + 1, self.restart_window_s,
                    )  # fmt: skip
                    self._die(e)
                    return
                restarts.append(now)
                try:
                    self._restart(e)
                except Exception as broken:  # noqa: BLE001 - a loop that cannot restart dies
                    self._die(broken)
                    return
            except BaseException as e:  # noqa: BLE001 - whatever killed the loop goes to every stream
                self._die(e)
                return

    def _check_step_failures(self: AsyncEngine) -> None:
        failures = self.engine.consecutive_step_failures
        if failures >= self.max_consecutive_step_failures:
            raise RepeatedStepFailure(f"{failures} engine steps in a row failed")

    def _restart(self: AsyncEngine, error: Exception) -> None:
        """Fail every group in flight (fed or waiting here), rebuild the engine's KV state,
        serve again. Commands not drained yet (adds, aborts) stay queued and run after."""
        message = f"the engine loop restarted after: {describe(error)}"
        groups = {id(g): g for g in [*self._groups.values(), *self._pending] if not g.done}
        logger.error(
            "%s; failing %d request groups in flight", message, len(groups), exc_info=error
        )
        for group in groups.values():
            # the engine's own requests go in fail_all below: its state may be what broke
            self._abort_group(group, "the engine loop restarted", in_engine=False)
            group.put(ErrorEvent(message, 500))
        self._pending.clear()
        self.engine.fail_all(message)  # their outputs are not needed: the groups have the error
        self.num_restarts += 1
        self._snapshot()

    def _die(self: AsyncEngine, e: BaseException) -> None:
        self.error = e
        logger.error("the engine loop died", exc_info=e)
        self._fail_all(ErrorEvent(f"the engine loop died: {e!r}", 500))

    def _fail_group(self: AsyncEngine, group: RequestGroup, out: RequestOutput) -> None:
        """A sample failed in the engine (its step raised): the whole group ends with an
        ErrorEvent naming the failure (in-band on a stream, a JSON 500 otherwise) and its other
        prompts are aborted."""
        logger.warning("request %s failed: %s", out.request_id, out.error)
        self._abort_group(group, f"request {out.request_id} failed in the engine")
        group.put(ErrorEvent(f"request {out.request_id} failed in the engine: {out.error}", 500))
