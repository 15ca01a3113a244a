"""The worker group's value types: what to run (:class:`WorkerSpec`), how a worker ended
(:class:`WorkerExit`, :class:`FailureInfo`) and the group's errors. No behaviour beyond validation.
"""

from __future__ import annotations

import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

from agent.workers.output import OutputPolicy
from elastic import errors


class WorkerGroupError(errors.WorkerError, RuntimeError):
    """The worker group was used wrongly or could not spawn its workers."""


class LauncherUnavailable(errors.WorkerError):
    """A launcher cannot start this worker now (before anything was started); the group uses exec instead."""


@dataclass(frozen=True)
class WorkerSpec:
    """What to run on this node: one process per local rank.

    ``argv`` and ``envs`` are complete: the group adds only ``TORCHELASTIC_ERROR_FILE`` to each environment
    and inherits nothing from the agent. ``global_ranks[i]`` is the global rank of local rank ``i`` and
    names its output prefix, log folder and error file. With ``log_dir`` set, each worker's raw output is
    also written to ``log_dir/<attempt>/rank<global rank>/{stdout,stderr}.log``. ``output`` says which
    streams reach the agent's console and which lines are copied to ``log_dir/<attempt>/filtered_*.log``.
    """

    argv: list[str]
    envs: list[dict[str, str]]
    global_ranks: list[int]
    log_dir: Path | None = None
    attempt: str = "0"
    cwd: str | None = None
    output: OutputPolicy = OutputPolicy()

    def __post_init__(self) -> None:
        if not self.argv:
            raise ValueError("WorkerSpec.argv is empty")
        if not self.envs:
            raise ValueError("WorkerSpec.envs is empty: need one environment per local rank")
        if len(self.envs) != len(self.global_ranks):
            raise ValueError(
                f"WorkerSpec has {len(self.envs)} envs but {len(self.global_ranks)} global_ranks"
            )
        if len(set(self.global_ranks)) != len(self.global_ranks):
            raise ValueError(f"WorkerSpec.global_ranks has duplicates: {self.global_ranks}")
        if not self.attempt or "/" in self.attempt or self.attempt in (".", ".."):
            raise ValueError(f"WorkerSpec.attempt must be a plain folder name, got {self.attempt!r}")

    @property
    def nprocs(self) -> int:
        """Number of local workers."""
        return len(self.envs)


@dataclass(frozen=True)
class WorkerExit:
    """One worker's exit. ``returncode`` is negative when a signal killed it (as in ``Popen``)."""

    local_rank: int
    global_rank: int
    pid: int
    returncode: int
    #: When the watcher thread saw the exit (time.monotonic): a failure's detection starts there.
    seen_at: float = field(default_factory=time.monotonic, compare=False)

    @property
    def succeeded(self) -> bool:
        """True when the worker exited with code 0."""
        return self.returncode == 0

    @property
    def signal_name(self) -> str | None:
        """Name of the signal that killed the worker (``"SIGKILL"``), or None if it exited by itself."""
        return signal_name(self.returncode)


#: Signals a worker raises itself when it crashes (a segfault, abort(), a bus error, a bad instruction...):
#: its last stderr lines (faulthandler's "Fatal Python error", C++'s "terminate called after ...") say why.
#: Any other signal came from outside (the OOM killer, an operator, a scheduler), and what the worker
#: printed before, such as a warning, is no root cause of it.
CRASH_SIGNALS = frozenset({"SIGSEGV", "SIGABRT", "SIGBUS", "SIGFPE", "SIGILL", "SIGSYS", "SIGTRAP"})


@dataclass(frozen=True)
class FailureInfo:
    """Root cause of a failed worker, for the user-facing summary.

    Exactly one of ``exit_code`` (the worker exited) and ``signal`` (a signal killed it) is set.
    """

    local_rank: int
    global_rank: int
    exit_code: int | None
    signal: str | None
    message: str
    #: ``message`` only restates the exit ("killed by SIGKILL", "exited with code 1"): the worker left no
    #: error of its own, so a report leaves the message out (the signal or exit code says it all).
    generic: bool = False


def signal_name(returncode: int) -> str | None:
    """``"SIGKILL"`` for ``-9``; None for a non-negative return code."""
    if returncode >= 0:
        return None
    try:
        return signal.Signals(-returncode).name
    except ValueError:
        return f"SIG{-returncode}"
