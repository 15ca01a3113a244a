"""The range the agent draws its workers' store port from (agent.executor.net): ``ELASTIC_STORE_PORTS``, by
default below the kernel's ephemeral range; a bad value is refused on the command line (exit 2)."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest
from e2e import base_env

from agent.executor.net import STORE_PORTS_ENV, STORE_PORTS_FLOOR, free_port, store_ports

REPO = Path(__file__).resolve().parents[3]


def test_the_variable_names_an_inclusive_range_or_one_port() -> None:
    assert store_ports({STORE_PORTS_ENV: "30000-30010"}) == range(30000, 30011)
    assert store_ports({STORE_PORTS_ENV: " 29500 "}) == range(29500, 29501)


@pytest.mark.parametrize("value", ["abc", "30010-30000", "0-10", "1-70000", "5-", "-5", "1-2-3"])
def test_a_bad_range_is_refused_with_its_value(value: str) -> None:
    with pytest.raises(ValueError, match=f"{STORE_PORTS_ENV}={value}"):
        store_ports({STORE_PORTS_ENV: value})


def test_by_default_the_range_ends_where_the_ephemeral_range_begins() -> None:
    ephemeral_start = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    assert store_ports({}) == range(STORE_PORTS_FLOOR, ephemeral_start)


def test_a_port_is_drawn_from_the_range_and_a_taken_one_is_skipped() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert free_port("127.0.0.1", range(port, port + 1)) != port, "a taken one: any free port"
        with socket.socket() as other:
            other.bind(("127.0.0.1", 0))
            free = other.getsockname()[1]
        assert free_port("127.0.0.1", range(free, free + 1)) == free


@pytest.mark.timeout(60)
def test_a_bad_value_stops_elastic_run_with_a_usage_error(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text("print('never')\n")
    argv = [sys.executable, "-m", "agent", "--standalone", "--nproc-per-node", "1", str(script)]
    result = subprocess.run(
        argv, env=base_env(**{STORE_PORTS_ENV: "9-1"}), cwd=REPO, capture_output=True, text=True, timeout=50
    )
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert f"{STORE_PORTS_ENV}=9-1 is not a port range" in result.stderr
    assert "never" not in result.stdout
