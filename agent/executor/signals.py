"""The agent's signal handlers (torchrun's ``--signals-to-handle``).

A shutdown signal (SIGTERM, SIGINT, SIGHUP, SIGQUIT) is handed to ``on_shutdown`` (the loop queues it and
stops the job gracefully). Any other handled signal (SIGUSR1, SIGUSR2: SLURM's warning before a time
limit) is forwarded to every live worker by a thread of its own, so that the handler itself takes no lock
and the agent's main thread is never needed for it: the agent keeps running.
"""

from __future__ import annotations

import logging
import queue
import signal
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

from agent.cli.torchrun_compat import SignalPlan

logger = logging.getLogger(__name__)


class SignalRouter:
    """Installs the handlers of a :class:`SignalPlan` (main thread only); use as a context manager."""

    def __init__(
        self, plan: SignalPlan, on_shutdown: Callable[[int], None], forward: Callable[[int], None]
    ) -> None:
        self._plan = plan
        self._on_shutdown = on_shutdown
        self._forward = forward
        self._pending: queue.SimpleQueue[int | None] = queue.SimpleQueue()  # put() is reentrant
        self._previous: dict[signal.Signals, Any] = {}
        self._thread: threading.Thread | None = None

    def __enter__(self) -> SignalRouter:
        if self._plan.forward:
            self._thread = threading.Thread(target=self._forward_loop, name="signal-forward", daemon=True)
            self._thread.start()
        for sig in sorted(self._plan.handled):
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc_info: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
        if self._thread is not None:
            self._pending.put(None)
            self._thread.join(timeout=5.0)
            self._thread = None

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if signum in self._plan.forward:
            self._pending.put(signum)
        else:
            self._on_shutdown(signum)

    def _forward_loop(self) -> None:
        while True:
            signum = self._pending.get()
            if signum is None:
                return
            try:
                self._forward(signum)
            except Exception:  # a failed forward must not end forwarding
                logger.exception("forwarding %s to the workers failed", signal.Signals(signum).name)
