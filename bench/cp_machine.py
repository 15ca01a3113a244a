"""The machine side of bench/control_plane.py: which core runs what (``os.sched_setaffinity``: the master on
one core, the load generator on the others), a CPU limit for a master (a cgroup v1 ``cpu`` child group with
``cpu.cfs_period_us`` / ``cpu.cfs_quota_us``), and the core-speed micro-benchmark printed at the start of
every run, so that a reader can compare their machine with the one that made a table.

The CPU limit needs root and a writable cgroup v1 ``cpu`` hierarchy (``/sys/fs/cgroup/cpu``); the group is
removed when the run ends (its processes are gone by then). Without them ``--master-cpu`` is a usage error
with one line saying why."""

from __future__ import annotations

import contextlib
import math
import os
import time
import uuid
from pathlib import Path

#: The cgroup v1 cpu controller's mount point.
CPU_CGROUP_ROOT = Path("/sys/fs/cgroup/cpu")
#: The quota's period: short, so that a master at its limit is held back for at most a few milliseconds at a
#: time (a 100 ms period would stop it for 60 ms at 40 %, which alone would break a 50 ms p99).
CFS_PERIOD_US = 10_000
#: The smallest quota the kernel takes (microseconds).
MIN_QUOTA_US = 1000
#: Iterations of the fixed loop of :func:`core_speed` per measurement.
SPEED_LOOPS = 200_000


def cpus() -> list[int]:
    """The cores this process may run on, in order."""
    return sorted(os.sched_getaffinity(0))


def split_cores(master_core: int | None = None) -> tuple[set[int], set[int]]:
    """(the master's core, the load generator's cores): the master gets ``master_core`` (default the first
    core this process may use), the load generator the others; on a one-core machine both share it."""
    mine = cpus()
    master = mine[0] if master_core is None else master_core
    if master not in mine:
        raise ValueError(f"core {master} is not one this process may use ({mine})")
    rest = {c for c in mine if c != master}
    return {master}, rest or {master}


def pin(pid: int, cores: set[int]) -> bool:
    """Pin process ``pid`` (its threads keep the affinity it had at their start: pin before they start, or
    see :func:`pin_tree`) to ``cores``; False when the process is gone."""
    try:
        os.sched_setaffinity(pid, cores)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def pin_tree(pid: int, cores: set[int]) -> None:
    """Pin every thread of process ``pid`` (``/proc/PID/task``) to ``cores``."""
    with contextlib.suppress(OSError):
        for task in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError):
                os.sched_setaffinity(int(task), cores)


def cgroup_unusable() -> str | None:
    """Why ``--master-cpu`` cannot work here (one line), or None."""
    if not (CPU_CGROUP_ROOT / "cpu.cfs_quota_us").exists():
        return f"--master-cpu needs the cgroup v1 cpu controller at {CPU_CGROUP_ROOT} (not mounted here)"
    if not os.access(CPU_CGROUP_ROOT, os.W_OK):
        return f"--master-cpu needs write access to {CPU_CGROUP_ROOT} (run as root)"
    return None


def quota_of(share: float) -> tuple[int, int]:
    """(cfs_period_us, cfs_quota_us) holding a group to ``share`` of one core: a 10 ms period, longer for a
    share so small that its quota would be under the kernel's 1 ms minimum."""
    period = max(CFS_PERIOD_US, math.ceil(MIN_QUOTA_US / share))
    return period, round(share * period)


class CpuLimit:
    """One cgroup v1 ``cpu`` child group holding processes to ``share`` of one core (``share`` 0.4: 4 ms of
    CPU every 10 ms period); :meth:`close` removes it (the processes must have exited or been moved)."""

    def __init__(self, share: float, name: str | None = None) -> None:
        if not 0.01 <= share <= 64:
            raise ValueError(f"a CPU share of {share:g} cores is out of range (0.01-64)")
        self.share = share
        self.period_us, self.quota_us = quota_of(share)
        self.path = CPU_CGROUP_ROOT / (name or f"elastic-bench-{uuid.uuid4().hex[:8]}")
        self.path.mkdir()
        try:
            (self.path / "cpu.cfs_period_us").write_text(f"{self.period_us}\n")
            (self.path / "cpu.cfs_quota_us").write_text(f"{self.quota_us}\n")
        except OSError:
            self.path.rmdir()
            raise

    def add(self, pid: int) -> None:
        """Move process ``pid`` (every thread: cgroup.procs) into the group."""
        (self.path / "cgroup.procs").write_text(f"{pid}\n")

    def throttled(self) -> dict[str, int]:
        """The group's ``cpu.stat``: nr_periods, nr_throttled, throttled_time (ns)."""
        out: dict[str, int] = {}
        with contextlib.suppress(OSError):
            for line in (self.path / "cpu.stat").read_text().splitlines():
                key, _, value = line.partition(" ")
                with contextlib.suppress(ValueError):
                    out[key] = int(value)
        return out

    def close(self) -> None:
        """Remove the group, moving any process still in it back to the root group first."""
        if not self.path.exists():
            return
        with contextlib.suppress(OSError):
            for pid in (self.path / "cgroup.procs").read_text().split():
                with contextlib.suppress(OSError):
                    (CPU_CGROUP_ROOT / "cgroup.procs").write_text(f"{pid}\n")
        for _ in range(50):  # a killed process leaves the group once it is reaped
            try:
                self.path.rmdir()
                return
            except OSError:
                time.sleep(0.1)


def _loop(n: int) -> int:
    """A fixed mix of what the master's hot path does (integer arithmetic, dict and list work, string
    formatting), deterministic and allocation-bound like it."""
    table: dict[int, int] = {}
    acc = 0
    for i in range(n):
        key = (i * 2654435761) & 0xFFFF
        table[key] = table.get(key, 0) + i
        acc ^= len(f"{key}:{i}") + (acc >> 3)
        if i % 64 == 0:
            acc += len([k for k in range(8)])
    return acc + len(table)


def core_speed(cores: set[int] | None = None, repeats: int = 5) -> float:
    """Millions of :func:`_loop` iterations per second on one core (best of ``repeats``), measured pinned to
    ``cores`` when given (this process's affinity is restored after)."""
    before = os.sched_getaffinity(0)
    if cores:
        os.sched_setaffinity(0, cores)
    try:
        best = float("inf")
        for _ in range(repeats):
            t0 = time.process_time()
            _loop(SPEED_LOOPS)
            best = min(best, time.process_time() - t0)
    finally:
        os.sched_setaffinity(0, before)
    return SPEED_LOOPS / best / 1e6


class Placement:
    """Where bench/control_plane.py runs what: the masters on ``master_cores`` (each in its own
    :class:`CpuLimit` of ``master_cpu`` cores when given), the load generator, etcd and the benchmark's own
    process on ``load_cores``; ``pinned`` False: no affinity set (one core, or ``--no-pin``)."""

    def __init__(self, pinned: bool, master_cpu: float | None, master_core: int | None = None) -> None:
        self.master_cpu = master_cpu
        self.master_cores, self.load_cores = split_cores(master_core)
        self.pinned = pinned and self.master_cores != self.load_cores
        self.limits: list[CpuLimit] = []

    def describe(self) -> str:
        """One line for the report: the cores and the limit."""
        where = (
            f"master on core {sorted(self.master_cores)}, load generator on cores {sorted(self.load_cores)} "
            "(os.sched_setaffinity)"
            if self.pinned
            else "master and load generator not pinned (they share every core)"
        )
        if self.master_cpu is not None:
            period, quota = quota_of(self.master_cpu)
            where += (
                f"; each master limited to {self.master_cpu:g} of a core (cgroup v1 cpu.cfs_quota_us "
                f"{quota} per {period} us period)"
            )
        return where

    def enter(self) -> None:
        """This process (and what it starts from now on: etcd, the fake fleet) on the load cores."""
        if self.pinned:
            os.sched_setaffinity(0, self.load_cores)

    def master(self, pid: int) -> CpuLimit | None:
        """Place a master just started (before its threads start: they inherit the affinity); its limit."""
        if self.pinned:
            pin_tree(pid, self.master_cores)
        if self.master_cpu is None:
            return None
        limit = CpuLimit(self.master_cpu)
        self.limits.append(limit)
        limit.add(pid)
        return limit

    def load(self, pid: int) -> None:
        if self.pinned:
            pin_tree(pid, self.load_cores)

    def close(self) -> None:
        """Remove every CPU limit made (call once the masters are gone)."""
        for limit in self.limits:
            limit.close()
        self.limits.clear()
