"""The suite can run in several pytest-xdist workers (``python -m pytest -n 3 --dist worksteal``), tests
shared one by one. What keeps tests that run at once apart is checked here; docs/testing.md lists the rest."""

from __future__ import annotations

import os
from pathlib import Path

import e2e
import ports


def test_each_pytest_process_gives_its_agents_a_shared_memory_root_of_its_own() -> None:
    """Agents remove dead agents' checkpoint folders beside their own: two workers' agents must never share
    a root (tests/conftest.py, ELASTIC_SHM_ROOT)."""
    root = Path(os.environ["ELASTIC_SHM_ROOT"])
    assert root.parent == Path("/dev/shm") and root.is_dir()
    assert root.name.startswith(f"pytest-shm-{os.getpid()}-"), "a root inherited from another process"
    assert root == e2e.SHM


def test_ports_the_tests_and_their_agents_pick_never_meet_those_of_another_process() -> None:
    """A port picked for a process the test starts must stay free until it binds it: below the kernel's
    ephemeral range (outgoing connections), and in slices no other pytest process draws from (ports.py)."""
    ephemeral_start = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    low, high = (int(p) for p in os.environ["ELASTIC_STORE_PORTS"].split("-"))
    agents = range(low, high + 1)
    tests = ports.share(ports.TEST_PORTS)
    assert agents == ports.share(ports.AGENT_STORE_PORTS)
    assert not set(agents) & set(tests) and max(agents[-1], tests[-1]) < ephemeral_start
    assert e2e.free_port() in tests
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    slices = [ports.TEST_PORTS[i * len(tests) : (i + 1) * len(tests)] for i in range(count)]
    assert sum(tests == s for s in slices) == 1 and len({s.start for s in slices}) == count
