"""The suite can run in several pytest-xdist workers (``python -m pytest -n 3 --dist worksteal``), tests
shared one by one. What keeps tests that run at once apart is checked here; docs/testing.md lists the rest."""

from __future__ import annotations

import os
from pathlib import Path

import e2e


def test_each_pytest_process_gives_its_agents_a_shared_memory_root_of_its_own() -> None:
    """Agents remove dead agents' checkpoint folders beside their own: two workers' agents must never share
    a root (tests/conftest.py, ELASTIC_SHM_ROOT)."""
    root = Path(os.environ["ELASTIC_SHM_ROOT"])
    assert root.parent == Path("/dev/shm") and root.is_dir()
    assert root.name.startswith(f"pytest-shm-{os.getpid()}-"), "a root inherited from another process"
    assert root == e2e.SHM
