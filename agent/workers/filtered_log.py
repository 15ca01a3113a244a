"""Filtered copies of worker output: torchrun's ``--duplicate-stdout-filters`` and ``-stderr-filters``.

A :class:`FilteredLog` is one file per stream and attempt, ``LOG_DIR/<attempt>/filtered_<stream>.log``
(torchrun's names), shared by all workers of the attempt: every line of any worker that contains one of
the filter substrings is appended, with the console's ``[rank<R>]:`` prefix. Filters match the worker's
line itself, never the prefix.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from pathlib import Path
from typing import TextIO

logger = logging.getLogger(__name__)


class FilteredLog:
    """A file that receives the lines containing any of ``needles``; thread-safe, closed by its owner."""

    def __init__(self, path: Path, needles: tuple[str, ...]) -> None:
        self.path = path
        self.needles = needles
        self._lock = threading.Lock()
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file: TextIO | None = open(path, "w", encoding="utf-8", errors="replace")  # noqa: SIM115 - close() closes it

    def matches(self, line: str) -> bool:
        """True when ``line`` contains one of the filter substrings."""
        return any(needle in line for needle in self.needles)

    def write_line(self, text: str) -> None:
        """Append ``text`` (one whole line, newline included) and flush; dropped once closed or broken."""
        with self._lock:
            if self._file is None:
                return
            try:
                self._file.write(text)
                self._file.flush()
            except (OSError, ValueError) as e:
                logger.warning("cannot write %s (%s); filtering to it stops", self.path, e)
                with contextlib.suppress(OSError, ValueError):
                    self._file.close()
                self._file = None

    def close(self) -> None:
        """Close the file; later lines are dropped. Idempotent."""
        with self._lock:
            if self._file is not None:
                with contextlib.suppress(OSError):
                    self._file.close()
                self._file = None


def open_filtered_logs(
    log_dir: Path | None, attempt: str, stdout_filters: tuple[str, ...], stderr_filters: tuple[str, ...]
) -> dict[str, FilteredLog]:
    """The filtered logs of one attempt, by stream name; none without ``log_dir`` or filters."""
    logs: dict[str, FilteredLog] = {}
    if log_dir is None:
        return logs
    try:
        for stream, needles in (("stdout", stdout_filters), ("stderr", stderr_filters)):
            if needles:
                logs[stream] = FilteredLog(log_dir / attempt / f"filtered_{stream}.log", needles)
    except OSError:
        for log in logs.values():
            log.close()
        raise
    return logs
