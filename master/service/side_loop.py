"""``SideLoop``: a second asyncio loop on its own thread, for work that must not queue behind the agents.

The master serves every agent on its main loop. A standby that takes over a job of 10,000 nodes meets all
of them reconnecting at once, while its election (a few etcd calls) and its reading of the job's state
(thousands of records) are what decides when it can answer them; on the main loop those calls waited
behind the refusals it was still sending. Coroutines run here share only the GIL with the main loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class SideLoop:
    """An event loop on a daemon thread, started on first use; :meth:`aclose` stops and joins it."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    @property
    def loop(self) -> asyncio.AbstractEventLoop | None:
        """The side loop, once started."""
        return self._loop

    def _started(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            loop = asyncio.new_event_loop()
            self._thread = threading.Thread(target=loop.run_forever, name=self._name, daemon=True)
            self._thread.start()
            self._loop = loop
        return self._loop

    async def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the side loop and await its result here; cancelling this cancels it there."""
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self._started()))

    async def aclose(
        self, last: Callable[[], Awaitable[object]] | None = None, timeout_s: float = 5.0
    ) -> None:
        """Cancel what still runs on the side loop and wait for it to finish, then run ``last()`` there
        (closing what those tasks used), stop the loop and join the thread."""
        loop, thread, self._loop, self._thread = self._loop, self._thread, None, None
        if loop is None or thread is None:
            return

        async def cancel_the_rest() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            if last is not None:
                await last()

        with contextlib.suppress(Exception):
            await asyncio.wait_for(
                asyncio.wrap_future(asyncio.run_coroutine_threadsafe(cancel_the_rest(), loop)), timeout_s
            )
        loop.call_soon_threadsafe(loop.stop)
        deadline = time.monotonic() + timeout_s
        while thread.is_alive() and time.monotonic() < deadline:  # no executor thread just to join one
            await asyncio.sleep(0.005)
        if not thread.is_alive():
            loop.close()
