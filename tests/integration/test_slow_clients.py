"""The master stays up under slow clients (docs/security.md, "Slow and hostile clients"): the short version
of bench/slow_clients.py. A real ``elastic-master`` process, two fake nodes heartbeating over HTTP from
127.0.0.1, and one client process holding 2,000 slow connections for 20 s spread over 127.0.0.2 to
127.0.0.17 (idle ones, trickled heads, one byte of a next head after a 404, trickled login and wrong-token
bodies); then both nodes report success and the job finishes. Before the deadlines and the per-address cap,
such connections stayed open and the master's descriptors and memory went to them; before connections
broke their transports' reference cycles, every closed one stayed in memory until the daemon's 10-minute
full collection (tests/integration/test_conn_guard.py checks that one directly)."""

from __future__ import annotations

import argparse

import pytest

from bench.slow_clients import run

pytestmark = pytest.mark.slow

CONNECTIONS = 2000
SECONDS = 20.0
#: The issue's bound on the master's memory growth under the flood.
MAX_RSS_GROWTH_MIB = 64


@pytest.mark.timeout(240)
def test_2000_slow_connections_leave_every_heartbeat_answered_and_the_masters_memory_bounded() -> None:
    args = argparse.Namespace(connections=CONNECTIONS, seconds=SECONDS, procs=1, spread=[16])
    [result] = run(args)
    # Every heartbeat answered 200 within a fake node's deadline (bench.slow_clients.HEARTBEAT_DEADLINE_S:
    # a later answer is a ReadTimeout in other_answers), and they kept coming during the flood.
    assert result.other_answers == {}, result
    assert result.heartbeats == result.answered_200 and result.heartbeats >= 2 * SECONDS / 4, result
    assert result.rss_peak_mib - result.rss_before_mib <= MAX_RSS_GROWTH_MIB, result
    assert result.job_finished, result  # both nodes reported success after the flood: the job is over
    [attack] = result.attacks
    assert attack["connects"] >= CONNECTIONS and attack["connect_errors"] == 0, attack
    # The deadlines closed the slow connections of every kind, each slot's more than once over the flood
    # (before, a next head after a 404 and a trickled login body held their connections throughout).
    for kind, slots in attack["kinds"].items():
        assert attack["closed_kinds"].get(kind, 0) >= 2 * slots, (kind, attack)
