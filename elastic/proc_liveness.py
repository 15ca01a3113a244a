"""Is the process that wrote a file still alive? Standard library only (workers and the agent use it).

A temp file names its writer's pid (see :func:`elastic.checkpoint.layout.temp_path`). The writer is alive when
a process with that pid exists, is not a zombie, and started no later than the file's last modification: a
pid reused by a younger process cannot be the writer. Process start times come from ``/proc`` (Linux);
elsewhere only the pid's existence is checked.
"""

from __future__ import annotations

import os
from functools import cache

#: Clock slack when comparing a process's start time with a file's modification time: the kernel's boot
#: time is given in whole seconds.
SLACK_S = 1.0


@cache
def _boot_time() -> float | None:
    try:
        with open("/proc/stat") as f:
            for line in f:
                if line.startswith("btime "):
                    return float(line.split()[1])
    except (OSError, ValueError):
        pass
    return None


def _state_and_start(pid: int) -> tuple[str, float | None] | None:
    """``(state letter, start time in epoch seconds or None)`` from ``/proc/<pid>/stat``; None without it."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except FileNotFoundError:
        return ("X", None)  # gone between the existence check and here
    except OSError:
        return None
    # The command name (field 2) is in parentheses and may hold spaces: split after the last ')'.
    fields = text[text.rfind(")") + 2 :].split()
    boot = _boot_time()
    try:
        state, ticks = fields[0], int(fields[19])  # fields 3 and 22 of proc(5)
    except (IndexError, ValueError):
        return None
    started = None if boot is None else boot + ticks / os.sysconf("SC_CLK_TCK")
    return state, started


def alive_since(pid: int, before: float) -> bool:
    """True when the process ``pid`` is alive (not a zombie) and started no later than ``before`` (epoch
    seconds, e.g. a file's mtime, give or take :data:`SLACK_S`): it may be the one that wrote the file."""
    if pid <= 0:
        return False  # not a process id (0 and negatives address process groups in kill)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, owned by another user
    info = _state_and_start(pid)
    if info is None:
        return True  # cannot tell more than that the pid exists
    state, started = info
    if state in ("Z", "X"):
        return False
    return started is None or started <= before + SLACK_S
