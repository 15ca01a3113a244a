"""Forwarding of worker output: one reader thread per pipe prefixes each line with the worker's rank.

Lines go to the agent's own stdout/stderr as ``[rank<global rank>]:<line>`` (torchrun's tee prefix; a line
that already starts with it, as torch's excepthook writes tracebacks, is not prefixed twice), one whole line
per write and flushed, so ranks interleave by line, never mid-line, unless an
:class:`OutputPolicy` keeps the stream off the console. The raw bytes are also teed to a log file when one
is given, lines matching a filter are copied to a :class:`~agent.workers.filtered_log.FilteredLog`, and the
last lines of stderr are kept in memory for failure summaries.
"""

import contextlib
import logging
import sys
import threading
from collections import deque
from dataclasses import dataclass
from enum import IntFlag
from typing import BinaryIO, Literal

from agent.workers.filtered_log import FilteredLog

logger = logging.getLogger(__name__)

# A worker that prints without newlines (progress bars) must not grow a line without bound.
MAX_LINE_BYTES = 64 * 1024
#: stderr lines kept for the failure summary (agent.workers.errors_file): a traceback whose exception
#: message carries torch's C++ frame list (dozens of lines) still has its exception line in there.
STDERR_TAIL_LINES = 200
#: Characters of one line kept in the tail: the summary is cut to 2,000 anyway.
TAIL_LINE_CHARS = 4000

StreamName = Literal["stdout", "stderr"]


class Std(IntFlag):
    """Streams of a worker, as torchrun's ``--redirects``/``--tee`` name them."""

    NONE = 0
    OUT = 1
    ERR = 2
    ALL = OUT | ERR


@dataclass(frozen=True)
class StdSpec:
    """A ``--redirects``/``--tee`` value (parsed by :func:`agent.cli.torchrun.parse_std_spec`): ``default``
    for every local rank not in ``by_rank``."""

    default: Std = Std.NONE
    by_rank: tuple[tuple[int, Std], ...] = ()

    def for_rank(self, local_rank: int) -> Std:
        """The streams this spec names for ``local_rank``."""
        return dict(self.by_rank).get(local_rank, self.default)

    @property
    def empty(self) -> bool:
        """True when the spec names no stream of any rank."""
        return self.default is Std.NONE and all(s is Std.NONE for _, s in self.by_rank)


@dataclass(frozen=True)
class OutputPolicy:
    """Which worker streams reach the agent's console, and which lines are copied to filtered logs.

    ``console_ranks``: the local ranks shown on the console (torchrun's ``--local-ranks-filter``), None for
    all. ``redirects``: streams that go to the log files only (torchrun's ``--redirects``), unless ``tee``
    names them too (torchrun's ``--tee``: file and console); honoured only when the worker's output is
    logged, so that no output is lost. ``stdout_filters``/``stderr_filters``:
    substrings whose lines are also copied to ``filtered_<stream>.log`` (needs a log folder).
    """

    console_ranks: frozenset[int] | None = None
    redirects: StdSpec = StdSpec()
    tee: StdSpec = StdSpec()
    stdout_filters: tuple[str, ...] = ()
    stderr_filters: tuple[str, ...] = ()

    def shows(self, local_rank: int, stream: StreamName, logged: bool) -> bool:
        """True when ``stream`` of ``local_rank`` goes to the console (``logged``: it is also in a file)."""
        if self.console_ranks is not None and local_rank not in self.console_ranks:
            return False
        flag = Std.OUT if stream == "stdout" else Std.ERR
        redirected = flag in self.redirects.for_rank(local_rank) and flag not in self.tee.for_rank(local_rank)
        return not (logged and redirected)


def rank_prefix(global_rank: int) -> str:
    """The prefix put before every forwarded line of the worker with ``global_rank``."""
    return f"[rank{global_rank}]:"


class RankLabel:
    """The prefix of one worker's forwarded lines; it follows the worker's global rank, which changes when
    in-process recovery keeps the worker into a round where it has another rank."""

    def __init__(self, global_rank: int) -> None:
        self.prefix = rank_prefix(global_rank)

    def set(self, global_rank: int) -> None:
        self.prefix = rank_prefix(global_rank)  # one reference swap: the reader threads see old or new


class _AgentStream:
    """The agent's ``sys.stdout`` or ``sys.stderr``, looked up at each write.

    Looked up late because the stream object can be replaced after start (test capture, log redirection).
    """

    def __init__(self, name: StreamName) -> None:
        self._name = name
        self._lock = threading.Lock()

    def write_line(self, text: str) -> None:
        with self._lock:
            stream = getattr(sys, self._name)
            if stream is None:
                return
            try:
                try:
                    stream.write(text)
                except UnicodeEncodeError:
                    # The agent's stream cannot encode the replacement character (e.g. an ASCII locale).
                    encoding = stream.encoding or "ascii"
                    stream.write(text.encode(encoding, errors="backslashreplace").decode(encoding))
                stream.flush()
            except (OSError, ValueError):
                # The agent's stream is closed or broken (EPIPE). Drop the line, but keep draining the
                # worker's pipe: a full pipe would block the worker.
                return


_AGENT_STREAMS: dict[StreamName, _AgentStream] = {
    "stdout": _AgentStream("stdout"),
    "stderr": _AgentStream("stderr"),
}


def start_forwarder(
    pipe: BinaryIO,
    *,
    global_rank: int,
    stream: StreamName,
    log_file: BinaryIO | None = None,
    tail: "deque[str] | None" = None,
    console: bool = True,
    filtered: FilteredLog | None = None,
    label: RankLabel | None = None,
) -> threading.Thread:
    """Start a daemon thread that forwards ``pipe`` line by line until EOF.

    The thread owns ``pipe`` and ``log_file`` and closes both at EOF. Decoding is UTF-8 with replacement
    characters, so binary output cannot break forwarding; the log file receives the raw bytes. Non-empty
    lines are appended to ``tail`` (a bounded deque) when given. ``console``: False keeps the lines off the
    agent's stream. ``filtered`` (shared, not owned) receives the prefixed lines that match its filters.
    ``label``: the prefix, shared with the worker's other stream (default: one for ``global_rank``).
    """
    sink = _AGENT_STREAMS[stream] if console else None
    thread = threading.Thread(
        target=_forward,
        args=(pipe, label or RankLabel(global_rank), sink, log_file, tail, filtered),
        name=f"worker-rank{global_rank}-{stream}",
        daemon=True,
    )
    thread.start()
    return thread


def _forward(
    pipe: BinaryIO,
    label: RankLabel,
    sink: _AgentStream | None,
    log_file: BinaryIO | None,
    tail: "deque[str] | None",
    filtered: FilteredLog | None,
) -> None:
    try:
        while True:
            raw = pipe.readline(MAX_LINE_BYTES)
            if not raw:
                return
            if log_file is not None:
                log_file = _write_log(log_file, raw)
            line = raw.decode("utf-8", errors="replace").removesuffix("\n").removesuffix("\r")
            if tail is not None and line.strip():
                tail.append(line[:TAIL_LINE_CHARS])
            # torch's excepthook already prefixes a distributed worker's traceback with "[rank<R>]:":
            # that line is shown as it is, not as "[rank0]:[rank0]: ...".
            prefix = "" if line.startswith(label.prefix) else label.prefix
            if sink is not None:
                sink.write_line(f"{prefix}{line}\n")
            if filtered is not None and filtered.matches(line):
                filtered.write_line(f"{prefix}{line}\n")
    finally:
        pipe.close()
        if log_file is not None:
            log_file.close()


def _write_log(log_file: BinaryIO, raw: bytes) -> BinaryIO | None:
    """Append ``raw`` to the log; on a write error (disk full) warn once and stop logging this stream."""
    try:
        log_file.write(raw)
        log_file.flush()
    except OSError as e:
        logger.warning("cannot write worker log %s (%s); logging to it stops", log_file.name, e)
        with contextlib.suppress(OSError):  # closing flushes again, which fails for the same reason
            log_file.close()
        return None
    return log_file
