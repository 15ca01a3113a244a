"""The reaper sentinel process: kills registered worker process groups when its pipe closes.

This file is run as ``python -I -S -c <this source>`` by :class:`agent.workers.reaper.Reaper`, so it must use
the standard library only and start fast. Protocol on stdin, one ASCII line per message:

* ``+<pgid>`` or ``+<pgid>:<ticks>`` — a worker process group to kill if the agent goes away; ``ticks``: its
  leader's start time (``/proc/<pgid>/stat`` field 22): the group is spared when another process holds
  that PID by then (the worker was reaped and its PID reused: the group of that id is the newcomer's);
* ``-<pgid>`` — the agent stopped that group itself; forget it;
* ``=<path>`` — a temp folder of the agent (its progress socket, worker error files) to remove.

On EOF (the agent exited, was SIGKILLed, or closed the pipe on purpose) every registered group gets SIGKILL,
twice with a short pause between to catch processes forked while the first signal was delivered; then the
registered folders are removed (a SIGKILLed agent cannot remove them itself) and the reaper exits.
"""

import contextlib
import os
import shutil
import signal
import time

_SECOND_PASS_DELAY_S = 0.2
_START_TIME_FIELD = 19  # field 22 of /proc/PID/stat, counted after the ")" that ends the command name


def start_ticks(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks since boot), or None when no process holds ``pid``."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return int(f.read().rsplit(b")", 1)[1].split()[_START_TIME_FIELD])
    except (OSError, ValueError, IndexError):
        return None


def _kill_groups(pgids: dict[int, int | None]) -> None:
    for pgid, ticks in sorted(pgids.items()):
        now = start_ticks(pgid)
        if ticks is not None and now is not None and now != ticks:
            continue  # the worker's PID is another process's now: so is a group of that id
        # The group may be empty already (or no longer ours): nothing to do then.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)


def _apply(line: bytes, pgids: dict[int, int | None], folders: set[str]) -> None:
    text = line.strip().decode("ascii", errors="replace")
    if text.startswith("=/"):
        folders.add(text[1:])
        return
    number, _, ticks = text[1:].partition(":")
    if not number.isdigit() or (ticks and not ticks.isdigit()):
        return
    pgid = int(number)
    if pgid <= 1:
        # Never killpg(0) (our own group) or killpg(1).
        return
    if text[0] == "+":
        pgids[pgid] = int(ticks) if ticks else None
    elif text[0] == "-":
        pgids.pop(pgid, None)


def main() -> None:
    # We live in our own session, but be explicit: a terminal's Ctrl-C or hangup is for the agent, and the
    # agent's death is exactly the moment this process has work to do.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    # A batch system's warning to every process of the job step (SLURM's --signal=USR1@90) is for the
    # agent; this process must outlive the agent, and USR1/USR2 would otherwise end it.
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    signal.signal(signal.SIGUSR2, signal.SIG_IGN)
    pgids: dict[int, int | None] = {}
    folders: set[str] = set()
    buffer = b""
    while True:
        try:
            chunk = os.read(0, 4096)
        except InterruptedError:
            continue
        if not chunk:
            break
        buffer += chunk
        *lines, buffer = buffer.split(b"\n")
        for line in lines:
            _apply(line, pgids, folders)
    if pgids:
        _kill_groups(pgids)
        time.sleep(_SECOND_PASS_DELAY_S)
        _kill_groups(pgids)
    for folder in sorted(folders):  # after the kills: no worker writes there any more
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
