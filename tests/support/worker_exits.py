"""The exits a worker group reports to its ``on_exit`` callback (the agent loop's path), read in order."""

from __future__ import annotations

import queue

from agent.workers.group import WorkerExit


class Exits:
    """Pass as a group's ``on_exit``; :meth:`next` reads the reported exits in order.

    ``timeout_s`` is how long :meth:`next` waits by default (a warm start's zygote may still be importing
    torch, so those tests wait longer)."""

    def __init__(self, timeout_s: float = 10.0) -> None:
        self._queue: queue.Queue[WorkerExit] = queue.Queue()
        self._timeout_s = timeout_s

    def __call__(self, exit_: WorkerExit) -> None:
        self._queue.put(exit_)

    def next(self, timeout: float | None = None) -> WorkerExit:
        """The next exit reported; fails the test when none comes within ``timeout`` seconds."""
        wait = self._timeout_s if timeout is None else timeout
        try:
            return self._queue.get(timeout=wait)
        except queue.Empty:
            raise AssertionError(f"no worker exit within {wait}s") from None

    def empty(self) -> bool:
        """True when every exit reported so far has been read."""
        return self._queue.empty()
