"""Shared pytest fixtures, and CI's rule that a test never passes by skipping for a missing tool."""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from etcd_server import EtcdNotFoundError, EtcdServer
from ports import agent_store_ports
from tools import MISSING_TOOL

# The suite runs in parallel processes (pytest-xdist, `-n` in pyproject.toml). Every agent removes the
# checkpoint folders of dead agents it finds beside its own, so agents of two tests running at once must
# not share a root: each pytest process (a worker, or the whole run without xdist) gives the agents it
# starts a root folder of its own in /dev/shm (ELASTIC_SHM_ROOT, docs/checkpointing.md), removed when it
# ends. Set before any test module imports tests/support/e2e.py, whose SHM follows it.
_SHM_ROOT = Path("/dev/shm") / f"pytest-shm-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def _remove_dead_roots() -> None:
    """The roots of pytest processes that were killed (no teardown ran): their PID is gone."""
    for root in Path("/dev/shm").glob("pytest-shm-*-*"):
        pid = root.name.split("-")[2]
        if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            shutil.rmtree(root, ignore_errors=True)


# A root set by the user is kept; one inherited from the pytest process that started this one (xdist's
# controller starts its workers with its own environment) is replaced.
_OWNER_ENV = "ELASTIC_TEST_SHM_ROOT_OWNER"
if Path("/dev/shm").is_dir() and ("ELASTIC_SHM_ROOT" not in os.environ or _OWNER_ENV in os.environ):
    _remove_dead_roots()
    _SHM_ROOT.mkdir(mode=0o700)
    os.environ["ELASTIC_SHM_ROOT"] = str(_SHM_ROOT)
    os.environ[_OWNER_ENV] = str(os.getpid())

# The workers' store ports of the agents this process starts: a slice of their range of its own (ports.py),
# apart from what parallel pytest processes and the tests themselves pick. One set by the user is kept.
if "ELASTIC_STORE_PORTS" not in os.environ or _OWNER_ENV in os.environ:
    os.environ["ELASTIC_STORE_PORTS"] = agent_store_ports()

# The test process runs etcd clients (gRPC) in-process and also starts workers and agents (fork + exec).
# gRPC's fork handlers are for children that go on using gRPC; with its threads busy at the moment of a
# fork they may leave the child broken before its exec (a worker once died of SIGABRT that way). Set
# before any gRPC import; gRPC's own advice for programs that always exec after fork.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")


def _under_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[None]:
    """Under CI, a skip for a missing system tool is a failure: CI installs every tool the tests use."""
    outcome = yield
    report = outcome.get_result()
    if not (report.skipped and _under_ci() and isinstance(report.longrepr, tuple)):
        return
    reason = str(report.longrepr[2])
    if MISSING_TOOL in reason:
        report.outcome = "failed"
        report.longrepr = f"{reason.removeprefix('Skipped: ')} (CI=true: a missing tool fails the run)"


def _start_etcd(base_dir) -> EtcdServer:
    try:
        return EtcdServer(base_dir).start()
    except EtcdNotFoundError as exc:  # CI must never skip etcd tests: a missing binary is a failure
        pytest.fail(str(exc), pytrace=False)


@pytest.fixture(scope="session")
def etcd_endpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """``127.0.0.1:PORT`` of an etcd shared by the session; tests use distinct job ids and never stop it."""
    server = _start_etcd(tmp_path_factory.mktemp("etcd-shared"))
    try:
        yield server.endpoint
    finally:
        server.stop()


@pytest.fixture
def etcd_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdServer]:
    """A private etcd that the test may ``stop()``, ``kill()``, ``start()`` or ``restart()`` (same endpoint
    and data); stopped by PID at teardown."""
    server = _start_etcd(tmp_path_factory.mktemp("etcd"))
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def agent_tmpdir() -> Iterator[Path]:
    """A short TMPDIR for an agent a test SIGKILLs without its reaper: what it leaves (worker error files,
    its progress socket folder) goes with the test. Short, because unix socket paths are limited to 108
    bytes."""
    folder = Path(tempfile.mkdtemp(prefix="et-"))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


_SHM = Path(os.environ.get("ELASTIC_SHM_ROOT") or "/dev/shm")


def pytest_unconfigure(config: pytest.Config) -> None:
    """The process's shared-memory root goes with it (whatever a test left there, should one fail)."""
    if _SHM_ROOT.is_dir():
        shutil.rmtree(_SHM_ROOT, ignore_errors=True)


def _kept_copies() -> set[str]:
    """The copies agents kept of a step they could not persist (``elastic-unpersisted-...``), now."""
    if not _SHM.is_dir():
        return set()
    return {p.name for p in _SHM.iterdir() if p.name.startswith("elastic-unpersisted-")}


@pytest.fixture(autouse=True)
def _remove_kept_copies() -> Iterator[None]:
    """An agent that ends with its newest step not on disk keeps that step's shared-memory copy for the
    user on purpose (docs/checkpointing.md). A test whose job ends that way (a master killed for good, a
    failure injected after the last persist) must not leave the copy behind: remove the copies it made."""
    before = _kept_copies()
    yield
    for name in _kept_copies() - before:
        shutil.rmtree(_SHM / name, ignore_errors=True)
