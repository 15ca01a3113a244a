"""Keeps the garbage collector's full collections off the heartbeat path.

At 10,000 nodes the master holds about 850,000 objects the cyclic collector tracks, and a full
(generation 2) collection walks every one: 20-400 ms in which no heartbeat is answered. CPython starts
them by its own heuristics, in bursts of 3-12, whenever joins, a round's assignments or the renewal of
10,000 long-polls leave many surviving objects (bench/control_plane.py saw its heartbeat p99 on them),
and they free nothing: the job's state is freed by reference counting. :class:`GcPacer` therefore turns
CPython's automatic full collections off (young generations are still collected as usual) and runs one
itself every :data:`FULL_EVERY_S`, so that cyclic garbage that outlived the young collections waits at
most that long instead of leaking."""

from __future__ import annotations

import gc
import logging
import time

log = logging.getLogger(__name__)

#: How often the master collects all generations itself.
FULL_EVERY_S = 600.0
#: The third ``gc.set_threshold`` value that keeps CPython from starting full collections on its own.
NEVER = 1 << 30


class GcPacer:
    """Full collections every ``full_every_s``, none in between. :meth:`start` once, then :meth:`tick`
    from the master's tick (the event loop's thread); :meth:`stop` gives CPython its heuristics back."""

    def __init__(self, full_every_s: float = FULL_EVERY_S) -> None:
        self.full_every_s = full_every_s
        self._full_at = time.monotonic()
        self._saved: tuple[int, int, int] | None = None
        #: Full collections done, and the last one's duration (seconds) and objects freed.
        self.full_collections = 0
        self.last_full_s = 0.0
        self.last_full_freed = 0

    def start(self, now: float | None = None) -> None:
        self._full_at = time.monotonic() if now is None else now
        if self._saved is None:
            self._saved = gc.get_threshold()
            young, middle, _ = self._saved
            gc.set_threshold(young, middle, NEVER)

    def stop(self) -> None:
        if self._saved is not None:
            gc.set_threshold(*self._saved)
            self._saved = None

    def tick(self, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        if self._saved is None or now - self._full_at < self.full_every_s:
            return
        self._full_at = now
        started = time.perf_counter()
        self.last_full_freed = gc.collect()
        self.last_full_s = time.perf_counter() - started
        self.full_collections += 1
        log.debug("full collection: %d objects freed in %.3f s", self.last_full_freed, self.last_full_s)
