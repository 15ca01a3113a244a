"""The one exit-code table of ``elastic-run`` and ``elastic-master``.

Pod failure policies and SLURM scripts act on these codes, so each has one meaning on both commands; a
job's :class:`elastic.control.protocol.Outcome` carries one of them from the master to every agent.
Standard library only: the agent's command line imports it before anything heavy.
"""

from __future__ import annotations

from enum import IntEnum


class ExitCode(IntEnum):
    """What an exit status tells whoever starts the command again (a scheduler, a script, a person)."""

    SUCCESS = 0
    """The job succeeded (every worker exited 0)."""

    FAILED = 1
    """A retryable failure: started again, the job may succeed (the restart budget spent on transient
    faults, a master that never answered)."""

    USAGE = 2
    """A usage or settings error (a bad flag, a refused token, settings that disagree with the master's):
    final until the command is fixed."""

    FAILED_FOR_GOOD = 3
    """A deterministic failure (a crash loop, a recurring NaN or loss spike): do not start it again."""

    NODE_UNHEALTHY = 4
    """This node is excluded as unhealthy (suspect hardware, an evicted straggler, flapping, a failed
    health check): replace the node; the job may go on without it."""


#: A command stopped by signal N exits ``SIGNAL_BASE + N`` (the shell's convention).
SIGNAL_BASE = 128


def for_signal(signum: int) -> int:
    """The exit status of a command stopped by signal ``signum``: ``128 + signum``."""
    return SIGNAL_BASE + signum
