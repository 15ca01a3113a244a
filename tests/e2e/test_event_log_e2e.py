"""The event log of a real job that loses a worker and then a whole node.

Two fake nodes (agents with real workers) under a real ``elastic-master --event-log``: a worker of node a
is SIGKILLed, then node b dies (its agent and workers SIGKILLed), and the job finishes on node a. The
JSON lines hold both recoveries in order, each with its phases, and each phase agrees with the times of
the events that bound it (docs/observability.md, "Recovery phases")."""

from __future__ import annotations

import json
import os
import signal
import uuid
from pathlib import Path

import pytest
from e2e import base_env, elastic_master_argv, elastic_run_argv, launch, train_args, wait_until  # noqa: F401

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

TOKEN = "event-log-e2e-token"
HEARTBEAT_INTERVAL_S = 0.5
HEARTBEAT_TIMEOUT_S = 3.0
START_S = 120.0
PHASES = ("detect", "rendezvous", "restart", "first_step")
#: Event times and durations are written rounded to microseconds.
EPS = 1e-4


def read_events(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def recoveries(events: list[dict]) -> list[dict]:
    return [e for e in events if e["kind"] == "first_step" and e["cause"]]


def agent_argv(address: str, job_id: str, token_file: Path, node: str, ckpt: Path) -> list[str]:
    return elastic_run_argv(
        "--nnodes",
        "1:2",
        "--nproc-per-node",
        "1",
        "--master",
        address,
        "--job-id",
        job_id,
        "--token-file",
        str(token_file),
        "--node-id",
        node,
        "--ckpt-dir",
        str(ckpt),
        "--stop-grace",
        "2",
        "--quiet",
        *train_args(300, 0.05),
    )


def check_phases(window: list[dict], recovery: dict) -> float:
    """Assert the recovery's phases against the events of its ``window`` (from its verdicts to its
    first step); returns the moment the world broke."""
    durations = recovery["durations"]
    assert set(durations) == {*PHASES, "total"}, durations
    assert all(durations[p] >= 0 for p in PHASES), durations
    assert durations["total"] == pytest.approx(sum(durations[p] for p in PHASES), abs=EPS)
    stepped_at = recovery["data"]["training_at"]  # every member had stepped: the recovery's end
    broke_at = stepped_at - durations["total"]
    closed = [e for e in window if e["kind"] == "round_closed"][-1]
    started = [e for e in window if e["kind"] == "workers_started"][-1]
    assert closed["round"] == started["round"] == recovery["round"]
    assert durations["detect"] + durations["rendezvous"] == pytest.approx(closed["time"] - broke_at, abs=EPS)
    # Later heartbeats may date the start earlier than the workers_started event did (recovery_phases).
    started_at = recovery["data"]["workers_started_at"]
    assert started_at <= started["data"]["at"] + EPS
    assert durations["restart"] == pytest.approx(started_at - closed["time"], abs=EPS)
    assert durations["first_step"] == pytest.approx(stepped_at - started_at, abs=EPS)
    verdicts = [e for e in window if e["kind"] in ("worker_failed", "node_dead", "node_left")]
    assert verdicts, window
    assert broke_at <= verdicts[0]["time"] + EPS
    assert durations["detect"] == pytest.approx(verdicts[0]["time"] - broke_at, abs=EPS)
    return broke_at


def test_a_worker_kill_and_a_node_loss_are_in_the_event_log_in_order_with_their_phases(launch, tmp_path):  # noqa: F811
    job_id = f"evlog-{uuid.uuid4().hex[:8]}"
    token_file = tmp_path / "tok"
    token_file.write_text(TOKEN + "\n")
    os.chmod(token_file, 0o600)
    log_path = tmp_path / "events.jsonl"
    master = launch(
        elastic_master_argv(
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--job-id",
            job_id,
            "--nnodes",
            "1:2",
            "--token-file",
            str(token_file),
            "--heartbeat-interval",
            str(HEARTBEAT_INTERVAL_S),
            "--heartbeat-timeout",
            str(HEARTBEAT_TIMEOUT_S),
            "--last-call",
            "1",
            "--event-log",
            str(log_path),
        ),
        name="master",
    )
    address = "127.0.0.1:" + master.wait_for(r"listening on 127\.0\.0\.1:(\d+)", START_S).group(1)
    env = base_env(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    node_a = launch(agent_argv(address, job_id, token_file, "a", tmp_path / "ckpt"), name="agent-a", env=env)
    node_b = launch(agent_argv(address, job_id, token_file, "b", tmp_path / "ckpt"), name="agent-b", env=env)

    def trained_at_2() -> int | None:
        """Index of the first step of a round of both nodes (the first round may be node a's alone, b
        then joins as a scale-up), once there is one."""
        events = read_events(log_path)
        closed = {
            e["round"] for e in events if e["kind"] == "round_closed" and e["data"].get("world_size") == 2
        }
        found = [i for i, e in enumerate(events) if e["kind"] == "first_step" and e["round"] in closed]
        return found[0] + 1 if found else None  # + 1: never 0, which wait_until takes for "not yet"

    training = wait_until(trained_at_2, START_S, "both nodes to train together", interval=0.2) - 1

    def recovered(count: int) -> bool:
        return len(recoveries(read_events(log_path)[training + 1 :])) == count

    (worker,) = node_a.worker_pids()
    os.kill(worker, signal.SIGKILL)
    wait_until(lambda: recovered(1), START_S, "the first recovery", interval=0.2)
    node_b.descendants()  # remembered: the node dies whole, workers included
    node_b.kill()
    wait_until(lambda: recovered(2), START_S, "the second recovery", interval=0.2)
    assert node_a.wait(START_S) == 0, node_a.output()[-3000:]
    wait_until(lambda: any(e["kind"] == "job_succeeded" for e in read_events(log_path)), 30, "job_succeeded")

    events = read_events(log_path)
    assert [e["seq"] for e in events] == list(range(1, len(events) + 1)), "every event once, in order"
    times = [e["time"] for e in events]
    assert times == sorted(times)
    assert events[0]["kind"] == "job_started" and events[-1]["kind"] == "job_succeeded"
    first, second = recoveries(events[training + 1 :])
    i_first, i_second = events.index(first), events.index(second)

    # 1: the worker kill. Its verdict, the round it opened, the close, the starts, the first step.
    window = events[training + 1 : i_first + 1]
    kinds = [e["kind"] for e in window]
    assert kinds.index("worker_failed") < kinds.index("round_opened") < kinds.index("round_closed")
    assert kinds.index("round_closed") < kinds.index("workers_started") < len(kinds) - 1
    failed = window[kinds.index("worker_failed")]
    assert (failed["node"], failed["cause"]) == ("a", "worker_failure")
    assert window[kinds.index("round_opened")]["cause"] == "worker_failure"
    assert first["cause"] == "worker_failure"
    assert failed["durations"]["detect"] == pytest.approx(first["durations"]["detect"], abs=EPS)
    check_phases(window, first)

    # 2: the node loss. Node b declared dead, a round without it, node a alone stepping again.
    window = events[i_first + 1 : i_second + 1]
    kinds = [e["kind"] for e in window]
    dead = [e for e in window if e["kind"] in ("node_dead", "node_left") and e["node"] == "b"]
    assert len(dead) == 1, kinds
    assert kinds.index("round_opened") < kinds.index("round_closed") < kinds.index("workers_started")
    assert events.index(dead[0]) < events.index(window[-1])
    assert second["cause"] == "node_loss"
    closed = [e for e in window if e["kind"] == "round_closed"][-1]
    assert closed["data"].get("world_size") == 1, closed
    broke_at = check_phases(window, second)
    # Dated from b's last heartbeat (its verdict's own detect), also when a's worker failed first, but not
    # before the world it broke began (master.job.accounting): b's last heartbeat may precede the first
    # recovery's end by a hair when b is killed right after it.
    last_heartbeat = dead[0]["time"] - dead[0]["durations"]["detect"]
    world_began = first["data"].get("training_at", float("-inf"))
    assert broke_at == pytest.approx(max(last_heartbeat, world_began), abs=EPS)
    assert broke_at > first["time"] - HEARTBEAT_TIMEOUT_S
    assert second["durations"]["total"] > 0 and first["durations"]["total"] > 0
    assert node_a.wait(10) == 0
