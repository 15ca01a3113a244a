"""``elastic-master --event-log FILE``: every job event as one JSON line, append-only, rotated by size.

The server calls :meth:`EventLog.write` from its persist path, after the job's state holding the events was
stored: a line is only ever written for an event the store has, so a master that takes over (which
continues the file from the stored events, :meth:`EventLog.resume`) never writes a sequence number twice.
A line is the job's incarnation (``incarnation``: which submission of the job wrote it) and
:meth:`master.job.events.Event.record`: ``seq, time, kind, round, node, cause, durations, data, message``.
Sequence numbers are per incarnation: a new submission of the job (or a memory-store master that lost its
state) writing to the same file starts again at 1 after the earlier lines, which it never skips over.
When a line would take the file past ``max_bytes``, the file is renamed ``FILE.1`` (``FILE.1``
to ``FILE.2``, ... up to ``backups`` files; the oldest is deleted) and a new ``FILE`` begins.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable

from master.job.events import Event

log = logging.getLogger(__name__)

DEFAULT_MAX_BYTES = 64 * 1024 * 1024
DEFAULT_BACKUPS = 3
_TAIL_BYTES = 64 * 1024  # enough for the last complete line (an event's message is bounded)


class EventLog:
    """Appends events to ``path`` in sequence order, skipping those it (or a previous leader) wrote."""

    def __init__(self, path: str, max_bytes: int = DEFAULT_MAX_BYTES, backups: int = DEFAULT_BACKUPS) -> None:
        if max_bytes <= 0:
            raise ValueError("the event log's size bound must be positive")
        self.path, self.max_bytes, self.backups = path, max_bytes, backups
        self.last_seq = 0
        self.incarnation = ""  # the job incarnation whose events this log continues (resume)
        self.errors = 0  # failed writes (exported as a metric; also logged)
        self._failing = False

    def resume(self, incarnation: str = "") -> int:
        """Read the newest sequence number already in the log for the job incarnation ``incarnation``
        (called on becoming the leader): a previous leader's of the same incarnation is continued; the
        last line of another incarnation (an earlier submission, a master that lost its state) means this
        one starts at 1. A line without an incarnation (an older master's) counts as the same job."""
        self.last_seq, self.incarnation = 0, incarnation
        for candidate in [self.path, *(f"{self.path}.{i}" for i in range(1, self.backups + 1))]:
            last = _last_line(candidate)
            if last is not None:
                seq, written_by = last
                same = not written_by or not incarnation or written_by == incarnation
                self.last_seq = seq if same else 0
                break
        return self.last_seq

    def write(self, events: Iterable[Event]) -> int:
        """Append the events newer than :attr:`last_seq` (in order); the number written. A failing disk is
        logged (once until it works again) and counted, never raised: the job goes on without its log."""
        lines: list[tuple[int, str]] = []  # (seq, line)
        for event in events:
            if event.seq <= self.last_seq:
                continue
            if self.last_seq and event.seq != self.last_seq + 1 and not lines:
                log.warning(
                    "event log %s: events %d-%d are missing (not kept in the stored state)",
                    self.path,
                    self.last_seq + 1,
                    event.seq - 1,
                )
            record = {"incarnation": self.incarnation, **event.record()}
            lines.append((event.seq, json.dumps(record, separators=(",", ":")) + "\n"))
            self.last_seq = event.seq
        if not lines:
            return 0
        try:
            self._append([line.encode() for _, line in lines])
        except OSError as exc:
            self.errors += 1
            if not self._failing:
                log.error("cannot write the event log %s: %s", self.path, exc)
            self._failing = True
            return 0
        self._failing = False
        return len(lines)

    def _append(self, lines: list[bytes]) -> None:
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o640)
        try:
            size = os.fstat(fd).st_size
            for data in lines:
                if size and size + len(data) > self.max_bytes:
                    os.close(fd)
                    fd = -1
                    self._rotate()
                    fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o640)
                    size = 0
                os.write(fd, data)
                size += len(data)
        finally:
            if fd >= 0:
                os.close(fd)

    def _rotate(self) -> None:
        if self.backups <= 0:
            os.remove(self.path)
            return
        for i in range(self.backups - 1, 0, -1):
            older = f"{self.path}.{i}"
            if os.path.exists(older):
                os.replace(older, f"{self.path}.{i + 1}")
        os.replace(self.path, f"{self.path}.1")


def _last_line(path: str) -> tuple[int, str] | None:
    """``(seq, incarnation)`` of the last complete line of ``path`` (incarnation "" where the line has
    none); None when it has no line (missing or empty)."""
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            size = fh.tell()
            fh.seek(max(0, size - _TAIL_BYTES))
            tail = fh.read()
    except FileNotFoundError:
        return None
    for line in reversed(tail.splitlines()):
        try:
            record = json.loads(line)
            return int(record["seq"]), str(record.get("incarnation") or "")
        except (ValueError, KeyError, TypeError, AttributeError):
            continue  # a line torn by a crash, or the cut-off first line of the tail
    return None
