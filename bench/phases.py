"""Recovery phases from the master's event log, compared with a benchmark's own timings: the
per-run phase durations from the event log agree with the recovery benchmark's own timings within
max(10 %, 30 ms).

The event log (``elastic-master --event-log``) ends a recovery with a ``first_step`` event whose
``durations`` are ``detect`` (the worker exit the agent saw -> the master's verdict), ``rendezvous``
(-> the round's close), ``restart`` (-> the last worker started, as its agent saw) and ``first_step``
(-> every worker reported a step). The benchmark sees three moments of its own: its SIGKILL, the kernel's
creation time of each new worker process (``/proc/PID/stat``, 10 ms ticks) and each new worker's first
``step`` line. So the comparison maps:

================================  =========================================================
event log                          benchmark
================================  =========================================================
detect + rendezvous + restart      kill -> the last new worker process created
first_step                         the last new worker process created -> every rank's first step line
total                              kill -> every rank's first step line
================================  =========================================================

Every row is checked. Both sides date "workers created" from the same record: the agent reports as its
workers' start the kernel's creation time of the last one (``agent.workers.launchers.last_created_at``, the
same ``/proc/PID/stat`` field the benchmark reads), not the moment its start call returned (with warm starts
that is after the zygote's fork *and* its hand-shake with the agent, tens of milliseconds later under
load). What still differs, by a few milliseconds on an idle host: the event log's ``detect`` starts at the
exit the agent's watcher thread saw (after the kill), and the master turns each moment the agent reports
as an age into its own time on the heartbeat's arrival, so each boundary is late by that heartbeat's
transit (the transits of the failure report, the heartbeat after the start and the one after the first
steps partly cancel in the differences). On a host loaded far beyond its cores (the master, the agent
and the workers waiting for a CPU) a transit can reach tens of milliseconds and a row of a single run
can then miss the 30 ms.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

#: Agreement: within max(TOLERANCE_REL of the benchmark's value, TOLERANCE_ABS seconds).
TOLERANCE_REL = 0.10
TOLERANCE_ABS = 0.030
#: The event log's recovery phases (master.job.accounting.PHASES).
PHASES = ("detect", "rendezvous", "restart", "first_step")
#: (name, event-log phases summed, the benchmark's own interval, checked) per compared row.
MAPPING = (
    ("detect+rendezvous+restart", ("detect", "rendezvous", "restart"), "kill -> workers created", True),
    ("first_step", ("first_step",), "workers created -> every rank stepped", True),
    ("total", ("total",), "kill -> every rank stepped", True),
)


def read_event_log(path: Path) -> list[dict]:
    """The JSON lines of an ``--event-log`` file (none when it does not exist)."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def recovery_durations(path: Path) -> dict[str, float] | None:
    """The phases of the first finished recovery in the event log at ``path``, or None (not yet)."""
    for event in read_event_log(path):
        if event["kind"] == "first_step" and event.get("cause"):
            return dict(event["durations"])
    return None


def process_created_at(pid: int) -> float | None:
    """When process ``pid`` was created, in ``time.time()`` seconds (the kernel's start time, 10 ms
    ticks), or None when it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    ticks = int(stat.rsplit(")", 1)[1].split()[19])  # field 22, counted after the command name
    since_boot = ticks / os.sysconf("SC_CLK_TCK")
    return time.time() - time.clock_gettime(time.CLOCK_BOOTTIME) + since_boot


def agrees(event_log: float, bench: float) -> bool:
    """Within max(10 %, 30 ms) of the benchmark's own value."""
    return abs(event_log - bench) <= max(TOLERANCE_REL * abs(bench), TOLERANCE_ABS)


def compare(durations: dict[str, float], to_created: float, to_stepped: float) -> list[dict]:
    """One row per :data:`MAPPING` entry: ``{"what", "event_log", "bench", "agrees", "checked"}`` (seconds;
    ``checked``: the row is part of the check; a row shown for information only would say False)."""
    bench = {
        "kill -> workers created": to_created,
        "workers created -> every rank stepped": to_stepped - to_created,
        "kill -> every rank stepped": to_stepped,
    }
    rows = []
    for name, phases, own, checked in MAPPING:
        logged = sum(durations[p] for p in phases)
        rows.append(
            {
                "what": f"{name} vs {own}",
                "event_log": round(logged, 4),
                "bench": round(bench[own], 4),
                "agrees": agrees(logged, bench[own]),
                "checked": checked,
            }
        )
    return rows
