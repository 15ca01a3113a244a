"""Crash-only supervision of the master's background tasks.

Every long-running task of a master (the run loop, the tick, the persist loop) is started through
:meth:`Supervisor.spawn`. Such a task never ends on its own while the master runs: an exception (or an
unexpected return) is a failure of the master. The supervisor records the first one and calls
``on_failure`` once; the master then resigns its leadership (revokes its lease, so that a standby leads
at once) and exits non-zero, so that a standby or the process supervisor takes over instead of a master
that renews its lease while doing nothing.

A :class:`StateFormatError` (a stored state this master cannot read) is an operator's problem: it is
logged as one line naming the key. Anything else is a bug: it is logged with its traceback.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import Any

from elastic.errors import ElasticRunError
from master.store.base import StateFormatError

log = logging.getLogger(__name__)


class MasterFailure(ElasticRunError):
    """The master stopped because one of its tasks failed; the message is one line for the operator."""


class Supervisor:
    """Starts tasks and turns the first failure among them into one :class:`MasterFailure`."""

    def __init__(self, on_failure: Callable[[MasterFailure], None]) -> None:
        self._on_failure = on_failure
        self.failure: MasterFailure | None = None
        self._tasks: set[asyncio.Task] = set()

    def spawn(self, coro: Coroutine[Any, Any, None], name: str) -> asyncio.Task:
        """Run ``coro`` as a supervised task; cancel it to stop it (a cancellation is no failure)."""
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if task.cancelled():
            return
        exc = task.exception()
        if isinstance(exc, StateFormatError):
            log.error("%s", exc)  # one line: the operator fixes or removes the stored state
            failure = MasterFailure(str(exc))
        elif exc is not None:
            log.error(
                "the master's %s task crashed; resigning the leadership and exiting",
                task.get_name(),
                exc_info=exc,
            )
            failure = MasterFailure(
                f"the master's {task.get_name()} task crashed ({type(exc).__name__}: {exc}); "
                "see the traceback above"
            )
        else:
            log.error("the master's %s task ended unexpectedly; resigning the leadership", task.get_name())
            failure = MasterFailure(f"the master's {task.get_name()} task ended unexpectedly")
        if self.failure is None:
            self.failure = failure
            self._on_failure(failure)
