"""Helpers for end-to-end tests: start real ``elastic-run``/``elastic-master`` processes, read their
output, wait for lines with deadlines, and make sure nothing they started survives the test."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from ports import free_port as free_port  # the helper the tests import from here

SUPPORT = Path(__file__).resolve().parent  # tests/support: the helpers and the worker scripts
REPO = SUPPORT.parents[1]
TRAIN_SCRIPT = REPO / "scripts" / "train_script.py"


def base_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH", "")]))
    env.pop("OMP_NUM_THREADS", None)
    env.update(extra)
    return env


class Proc:
    """A launched command whose combined output goes to a file we can search while it runs."""

    def __init__(
        self, argv: list[str], log: Path, env: dict[str, str] | None = None, cwd: Path | None = None
    ):
        self.argv = argv
        self.log = log
        self._fh = open(log, "wb")  # noqa: SIM115 - closed in wait()/kill()
        self.popen = subprocess.Popen(
            argv,
            stdout=self._fh,
            stderr=subprocess.STDOUT,
            env=env or base_env(),
            cwd=cwd or REPO,
            start_new_session=True,
        )
        self.pid = self.popen.pid
        self._known: set[int] = set()

    # -- output -----------------------------------------------------------------------------------
    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_for(self, pattern: str, timeout: float, *, after: int = 0) -> re.Match[str]:
        """Wait until ``pattern`` (a regex) appears in the output past offset ``after``."""
        regex = re.compile(pattern, re.M)
        deadline = time.monotonic() + timeout
        while True:
            match = regex.search(self.output(), after)
            if match:
                return match
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"{pattern!r} not seen within {timeout}s; output:\n{self.output()[-4000:]}"
                )
            if self.popen.poll() is not None:
                match = regex.search(self.output(), after)
                if match:
                    return match
                raise AssertionError(
                    f"process exited ({self.popen.returncode}) before {pattern!r}; output:\n"
                    f"{self.output()[-4000:]}"
                )
            time.sleep(0.05)  # polling a log file with a deadline; there is no event to wait on

    def wait(self, timeout: float) -> int:
        try:
            return self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"{self.argv[:3]} did not exit within {timeout}s; output:\n{self.output()[-4000:]}"
            ) from None
        finally:
            if self.popen.returncode is not None:
                self._fh.close()

    # -- processes --------------------------------------------------------------------------------
    def descendants(self) -> list[psutil.Process]:
        """Live descendants (also remembered, so that they are checked after the launcher dies)."""
        try:
            children = psutil.Process(self.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []
        self._known.update(c.pid for c in children)
        return children

    def worker_pids(self, script: str = "train_script.py") -> list[int]:
        out = []
        for proc in self.descendants():
            try:
                if any(script in part for part in proc.cmdline()):
                    out.append(proc.pid)
            except psutil.Error:
                continue
        return out

    def survivors(self) -> list[int]:
        """PIDs we saw as descendants that are still alive (zombies count as gone)."""
        alive = []
        for pid in self._known:
            try:
                if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    alive.append(pid)
            except psutil.NoSuchProcess:
                continue
        return alive

    def kill(self) -> None:
        """Kill the launcher and everything it started (by PID and by process group)."""
        self.descendants()
        for pid in [self.pid, *self._known]:
            for kill in (lambda p: os.killpg(p, signal.SIGKILL), lambda p: os.kill(p, signal.SIGKILL)):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    kill(pid)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(10)
        self._fh.close()


def wait_until(predicate, timeout: float, what: str, interval: float = 0.05):
    """Poll ``predicate`` until it returns something true (returned); fail the test after ``timeout`` seconds
    naming ``what``. The one waiting helper of the suite: a poll with a deadline, never a bare sleep."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def alive(pid: int) -> bool:
    """True while ``pid`` runs; a zombie waiting for its parent to reap it no longer counts."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def gone(pid: int) -> bool:
    """True when ``pid`` no longer runs (a zombie waiting for its new parent counts as gone)."""
    return not alive(pid)


def elastic_run_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "agent", *args]


def elastic_master_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "master", *args]


def train_args(steps: int, step_time: float, ckpt_every: int = 5, extra: tuple[str, ...] = ()) -> list[str]:
    """The example training script (scripts/train_script.py) and its arguments, for an agent's argv."""
    return [
        str(TRAIN_SCRIPT),
        "--steps",
        str(steps),
        "--ckpt-every",
        str(ckpt_every),
        "--step-time",
        str(step_time),
        "--batch-size",
        "32",
        *extra,
    ]


@pytest.fixture
def launch(tmp_path):
    """``launch(argv, name=..., env=...) -> Proc``; every launched process tree is killed at teardown.

    Processes run in a working folder of the test's own (``tmp_path/cwd``), so relative paths a script
    writes by default (the example's ``./checkpoints``) never land in, or get read from, the repository.
    """
    procs: list[Proc] = []
    cwd = tmp_path / "cwd"
    cwd.mkdir(exist_ok=True)
    # A TMPDIR of the test's own: what a killed agent leaves there (its progress socket folder, worker
    # error files) goes with the test. Short, in /tmp, because unix socket paths are limited to 108 bytes.
    temp = Path(tempfile.mkdtemp(prefix="et-"))

    def _launch(argv: list[str], name: str = "proc", env: dict[str, str] | None = None) -> Proc:
        env = dict(env if env is not None else base_env())
        if env.get("TMPDIR") == os.environ.get("TMPDIR"):  # unless the test chose one itself
            env["TMPDIR"] = str(temp)
        proc = Proc(argv, tmp_path / f"{name}-{len(procs)}.log", env=env, cwd=cwd)
        procs.append(proc)
        return proc

    yield _launch
    for proc in procs:
        proc.kill()
    shutil.rmtree(temp, ignore_errors=True)


# -- flash checkpoint jobs ----------------------------------------------------------------------------------
#: Where the agents of this test process keep their checkpoint folders (tests/conftest.py sets it).
SHM = Path(os.environ.get("ELASTIC_SHM_ROOT") or "/dev/shm")


def unique_job(prefix: str) -> str:
    """A job id of its own for each test: shared-memory folders are named after it."""
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def shm_folders(job: str) -> list[Path]:
    """The agents' shared-memory checkpoint folders of ``job`` that exist now."""
    return [p for p in SHM.iterdir() if p.name.startswith(f"elastic-{job}-")]


@pytest.fixture
def jobs() -> Iterator[list[str]]:
    """Job ids of the test; their shared-memory folders, and the copies an agent kept of a step it could not
    persist (``elastic-unpersisted-<job>-...``), are removed at teardown should the test fail."""
    names: list[str] = []
    yield names
    for job in names:
        kept = [p for p in SHM.iterdir() if p.name.startswith(f"elastic-unpersisted-{job}-")]
        for folder in shm_folders(job) + kept:
            shutil.rmtree(folder, ignore_errors=True)


def worker_pid(agent: Proc, rank: int, marker: str) -> int:
    """PID of the agent's descendant of global ``rank`` whose command line contains ``marker``."""

    def find():
        for proc in agent.descendants():
            try:
                if any(marker in part for part in proc.cmdline()) and proc.environ().get("RANK") == str(rank):
                    return proc.pid
            except psutil.Error:
                continue
        return None

    return wait_until(find, 30, f"the worker of rank {rank}")
