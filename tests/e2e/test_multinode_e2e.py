"""Multi-node end-to-end tests: a real ``elastic-master`` daemon and several real ``elastic-run`` agents,
each a fake node on this machine (distinct ``--node-id``, all on 127.0.0.1), running real gloo workers of
scripts/train_script.py.

Every node gets ``--nproc-per-node 1`` and ``OMP_NUM_THREADS=1`` to keep a 2-core machine responsive, and
all nodes share one ``--ckpt-dir``, so the checkpoint written by global rank 0 is visible to every node
(as a shared file system would make it on a real cluster). Steps are cheap (small batch) and their pace is
set with ``--step-time``; every wait is a poll with a deadline, and the ``launch`` fixture kills every
process tree at teardown.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time

import e2e
import pytest
from e2e import (
    Proc,
    alive,
    elastic_run_argv,
    free_port,
    train_args,
    wait_until,
)
from multinode_cluster import (
    EXIT_S,
    HEARTBEAT_TIMEOUT_S,
    START_LINE,
    START_S,
    STEP_LINE,
    agent_env,
    assert_no_survivors,
    assert_succeeded,
    failed_lines,
    node_rank,
    parse_table,
    remember_workers,
    start_cluster,
    starts,
    unique_job_id,
    wait_for_any,
)

launch = e2e.launch  # the fixture: every process tree a test launches is killed at its teardown

pytestmark = pytest.mark.slow


@pytest.mark.timeout(180)
def test_two_agents_train_at_world_two_and_finish(launch, tmp_path):
    cluster = start_cluster(launch, tmp_path, "2:3")
    script = train_args(steps=6, step_time=0.05)
    agents = [cluster.agent("node-a", script), cluster.agent("node-b", script)]

    ranks = sorted(node_rank(a) for a in agents)
    remember_workers(*agents)
    assert_succeeded(*agents)

    assert ranks == [0, 1]
    rank0 = next(a for a in agents if "node rank 0 of 2" in a.output())
    assert re.findall(STEP_LINE.format(world=2), rank0.output(), re.M) == [str(i) for i in range(1, 7)]
    assert re.search(r"^\[rank0\]:done step=6$", rank0.output(), re.M)
    assert sorted(s[:2] for a in agents for s in starts(a)) == [(0, 2), (1, 2)]
    assert_no_survivors(*agents)


# -- 2 ----------------------------------------------------------------------------------------------------
@pytest.mark.timeout(300)
def test_sigkilled_node_is_dropped_and_survivors_continue_at_world_two(launch, tmp_path):
    cluster = start_cluster(launch, tmp_path, "2:3")
    script = train_args(steps=20, step_time=0.15)
    agents = [cluster.agent(f"node-{i}", script) for i in range(3)]
    by_rank = {node_rank(a): a for a in agents}
    assert sorted(by_rank) == [0, 1, 2]
    # Kill node rank 0: it also hosts the workers' TCPStore, the hardest node to lose.
    victim, survivors = by_rank[0], [by_rank[1], by_rank[2]]
    victim_id = f"node-{agents.index(victim)}"
    victim.wait_for(STEP_LINE.format(world=3), START_S)
    victim_workers = victim.worker_pids()
    assert len(victim_workers) == 1
    remember_workers(*survivors)
    offsets = {a: len(a.output()) for a in survivors}
    master_offset = len(cluster.master.output())

    # SIGKILL the agent's process group. Workers live in their own sessions, so this kills the agent alone,
    # as when a node's agent crashes; its workers must follow it by themselves.
    killed_at = time.monotonic()
    os.killpg(victim.pid, signal.SIGKILL)

    wait_until(lambda: not any(alive(p) for p in victim_workers), 10, "the dead node's workers to die")
    cluster.master.wait_for(r"round_opened: round 2 opened", HEARTBEAT_TIMEOUT_S + 30, after=master_offset)
    new_round_s = time.monotonic() - killed_at
    wait_for_any(survivors, STEP_LINE.format(world=2), HEARTBEAT_TIMEOUT_S + 60, after=offsets)
    recovery_s = time.monotonic() - killed_at
    print(
        f"\nnode loss: round 2 opened {new_round_s:.1f}s and world=2 trained {recovery_s:.1f}s after the kill"
    )
    # The verdict itself does not depend on the machine's load; restarting the workers does.
    assert new_round_s < HEARTBEAT_TIMEOUT_S + 3, f"round 2 opened only {new_round_s:.1f}s after the kill"
    assert recovery_s < HEARTBEAT_TIMEOUT_S + 10, (
        f"world=2 resumed only {recovery_s:.1f}s after the kill (new round after {new_round_s:.1f}s, then "
        f"{recovery_s - new_round_s:.1f}s to restart the workers)"
    )

    assert_succeeded(*survivors)
    assert re.findall(r"node_dead: node (\S+) declared dead", cluster.master.output()) == [victim_id]
    for agent in survivors:
        assert [w for _, w, _, _ in START_LINE.findall(agent.output(), offsets[agent])] == ["2"]
    assert sum("[rank0]:done step=20" in a.output() for a in survivors) == 1
    assert victim.wait(10) == -signal.SIGKILL
    assert_no_survivors(*survivors)


# -- 3 ----------------------------------------------------------------------------------------------------
@pytest.mark.timeout(300)
def test_node_started_later_is_admitted_and_training_continues_from_checkpoint(launch, tmp_path):
    cluster = start_cluster(launch, tmp_path, "2:3")
    # Long enough that the job still runs when the late agent, started at step 3, has imported torch and
    # joins, also on a busy machine (the suite runs 3 tests at once).
    steps = 60
    script = train_args(steps=steps, step_time=0.2, ckpt_every=2)
    first = [cluster.agent("node-a", script), cluster.agent("node-b", script)]
    # Once step 3 is logged, the checkpoint of step 2 is on disk.
    wait_for_any(first, r"^\[rank0\]:step=3 loss=\S+ world=2$", START_S)

    late = cluster.agent("node-c", script)
    agents = [*first, late]
    late.wait_for(r"round 2: node rank 2 of 3", START_S)  # stable ranks: the newcomer is appended
    # The newcomer joins (which stops the running nodes' workers) only once its zygote has imported torch,
    # and its first workers are forked from it.
    out = late.output()
    assert out.index("warm start ready") < out.index("joined: waiting for round"), out
    late.wait_for(r"started 1 workers \(attempt round2, warm\)", START_S)
    wait_for_any(agents, STEP_LINE.format(world=3), START_S)
    remember_workers(*agents)
    assert_succeeded(*agents)

    for agent in first:
        assert [s[1:] for s in starts(agent)][0] == (2, 0, 0)
    rounds2 = [s for a in agents for s in starts(a) if s[1] == 3]
    assert sorted(rank for rank, *_ in rounds2) == [0, 1, 2]
    resumed = {step for *_, step in rounds2}
    assert len(resumed) == 1 and resumed.pop() >= 2, rounds2  # every rank loads the same checkpoint
    # A membership change is not a failure: no restart was counted.
    assert all(restart == 0 for a in agents for _, _, restart, _ in starts(a))
    rank0 = next(a for a in agents if f"[rank0]:done step={steps}" in a.output())
    world3_steps = [int(n) for n in re.findall(STEP_LINE.format(world=3), rank0.output(), re.M)]
    assert world3_steps == list(range(rounds2[0][3] + 1, steps + 1))
    assert_no_survivors(*agents)


# -- 4 ----------------------------------------------------------------------------------------------------
@pytest.mark.timeout(300)
def test_worker_sigkill_restarts_every_node_once(launch, tmp_path):
    cluster = start_cluster(launch, tmp_path, "2")
    script = train_args(steps=12, step_time=0.1)
    agents = [cluster.agent("node-a", script), cluster.agent("node-b", script)]
    by_rank = {node_rank(a): a for a in agents}
    node1 = by_rank[1]
    wait_for_any(agents, STEP_LINE.format(world=2), START_S)
    (worker,) = node1.worker_pids()
    remember_workers(*agents)

    os.kill(worker, signal.SIGKILL)

    for agent in agents:
        agent.wait_for(r"^\[rank\d\]:start rank=\d world=2 restart=1 resumed_step=\d+$", START_S)
    remember_workers(*agents)
    assert_succeeded(*agents)
    for agent in agents:
        assert [restart for _, _, restart, _ in starts(agent)] == [0, 1], agent.output()[-3000:]
    status = cluster.status()
    assert status["restart_count"] == 1 and status["outcome"]["succeeded"]
    # One failure costs one restart of the world, whichever rank reported it first (rank 0 may see the
    # broken connection before node 1's agent reports the SIGKILL).
    assert len(re.findall(r"round_opened: round \d+ opened \(restart: rank \d", cluster.master.output())) == 1
    assert_no_survivors(*agents)


# -- 5 ----------------------------------------------------------------------------------------------------
@pytest.mark.timeout(300)
def test_node_unit_two_admits_pairs_and_third_node_waits_for_a_fourth(launch, tmp_path):
    cluster = start_cluster(launch, tmp_path, "2:4", "--node-unit", "2")
    script = train_args(steps=60, step_time=0.2, ckpt_every=2)  # still running when the fourth has joined
    by_id = {f"node-{i}": cluster.agent(f"node-{i}", script) for i in range(3)}
    agents = list(by_id.values())
    wait_for_any(agents, STEP_LINE.format(world=2), START_S)

    def three_nodes() -> dict | None:
        status = cluster.status()
        return status if len(status["nodes"]) == 3 else None

    status = wait_until(three_nodes, 30, "the master to know all 3 nodes")
    assert (status["phase"], status["nnodes"], status["world_size"]) == ("training", 2, 2)
    members = sorted(n["node_id"] for n in status["nodes"] if n["rank"] is not None)
    (waiter,) = [n for n in status["nodes"] if n["rank"] is None]
    assert waiter["state"] == "waiting" and len(members) == 2
    assert "node rank" not in by_id[waiter["node_id"]].output()  # it was never assigned

    fourth = cluster.agent("node-3", script)
    agents.append(fourth)
    wait_for_any(agents, STEP_LINE.format(world=4), START_S)
    status = cluster.status()
    assert (status["nnodes"], status["world_size"]) == (4, 4)
    assert sorted(n["rank"] for n in status["nodes"]) == [0, 1, 2, 3]
    # Stable ranks: the two members keep ranks 0 and 1; the waiter and the newcomer are appended.
    assert sorted(n["node_id"] for n in status["nodes"] if n["rank"] in (0, 1)) == members
    remember_workers(*agents)
    assert_succeeded(*agents)
    assert re.search(
        r"round 1 closed: 2 nodes, world size 2, members .*; waiting: node-\d", cluster.master.output()
    )
    assert_no_survivors(*agents)


# -- 6 ----------------------------------------------------------------------------------------------------
@pytest.mark.timeout(120)
def test_too_few_nodes_fail_after_the_join_timeout(launch, tmp_path):
    cluster = start_cluster(launch, tmp_path, "2:2", "--join-timeout", "3")
    started = time.monotonic()
    agent = cluster.agent("node-a", train_args(steps=5, step_time=0.0))
    cluster.master.wait_for(r"node_joined: node node-a ", START_S)
    remember_workers(agent)

    code = agent.wait(60)
    elapsed = time.monotonic() - started

    assert code != 0
    assert 3 <= elapsed < 40
    (line,) = failed_lines(agent)
    assert "rendezvous timed out after 3s" in line and "1 node(s) joined, at least 2 needed" in line, line
    assert "Traceback" not in agent.output()
    assert not starts(agent)
    assert_no_survivors(agent)


# -- 7 ----------------------------------------------------------------------------------------------------
@pytest.mark.timeout(300)
def test_exhausted_restart_budget_fails_every_agent_with_the_same_summary(launch, tmp_path):
    # The same failure every time is a crash loop (exit 3 at the second: tests/e2e/test_crash_loop_e2e.py);
    # this test is about spending the budget.
    cluster = start_cluster(launch, tmp_path, "2", "--max-restarts", "1", "--crash-loop-window", "0")
    good = cluster.agent("node-a", train_args(steps=20, step_time=0.1))
    bad = cluster.agent("node-b", train_args(steps=20, step_time=0.1, extra=("--fail-always",)))
    agents = [good, bad]
    assert sorted(node_rank(a) for a in agents) == [0, 1]
    remember_workers(*agents)

    codes = [a.wait(EXIT_S * 2) for a in agents]

    assert all(code != 0 for code in codes), codes
    summaries = [failed_lines(a) for a in agents]
    assert all(len(s) == 1 for s in summaries), summaries
    assert summaries[0] == summaries[1]
    assert "job failed after 2 attempt(s) (max restarts 1); root cause:" in summaries[0][0]
    assert [restart for _, _, restart, _ in starts(bad)] == [0, 1]
    assert cluster.status()["restart_count"] == 1
    assert_no_survivors(*agents)


# -- 8 ----------------------------------------------------------------------------------------------------
@pytest.mark.timeout(180)
def test_status_command_prints_the_node_table_and_rejects_a_wrong_token(launch, tmp_path):
    cluster = start_cluster(launch, tmp_path, "2")
    script = train_args(steps=30, step_time=0.1)
    agents = [cluster.agent("node-a", script), cluster.agent("node-b", script)]
    wait_for_any(agents, STEP_LINE.format(world=2), START_S)

    def both_running() -> subprocess.CompletedProcess[str] | None:
        # A step line of one rank does not mean that both agents have reported "running" yet.
        result = cluster.status_cli(cluster.token_file)
        assert result.returncode == 0, result.stderr
        _, header, *rows = result.stdout.strip().splitlines()
        states = [row["STATE"] for row in parse_table(header, rows[:2])]
        return result if states == ["running", "running"] else None

    result = wait_until(both_running, START_S, "both nodes running in the status table", interval=0.2)

    head, header, *rows = result.stdout.strip().splitlines()
    assert head.startswith(
        f"job {cluster.job_id}: training, round 1, 2 node(s), world size 2, restarts 0/3"
    ), head
    table = sorted(parse_table(header, rows[:2]), key=lambda row: row["NODE"])
    assert [row["NODE"] for row in table] == ["node-a", "node-b"]
    assert sorted(row["RANK"] for row in table) == ["0", "1"]
    for row in table:
        age = row["HEARTBEAT AGE"]
        assert re.fullmatch(r"\d+\.\ds", age) and float(age[:-1]) < HEARTBEAT_TIMEOUT_S, row
        assert (row["STATE"], row["RESTARTS"], row["ROUND"], row["WORLD"]) == ("running", "0", "1", "2"), row

    wrong = tmp_path / "wrong-tok"
    wrong.write_text("not-the-job-token-at-all\n")
    result = cluster.status_cli(wrong)

    assert result.returncode != 0
    assert result.stdout == ""
    assert result.stderr.count("\n") == 1 and result.stderr.startswith("elastic-master: error: "), (
        result.stderr
    )
    assert "token" in result.stderr
    remember_workers(*agents)
    assert_succeeded(*agents)
    assert_no_survivors(*agents)


# -- 9 ----------------------------------------------------------------------------------------------------
@pytest.mark.timeout(300)
def test_torchrun_c10d_command_line_hosts_an_embedded_master_and_checks_nnodes(launch, tmp_path):
    endpoint, job_id = f"127.0.0.1:{free_port()}", unique_job_id()

    def torchrun_style(nnodes: str, name: str) -> Proc:
        # torchrun's own flags and spellings only; the checkpoint folder is the script's own flag.
        argv = elastic_run_argv(
            f"--nnodes={nnodes}",
            "--nproc-per-node=1",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={endpoint}",
            f"--rdzv-id={job_id}",
            *train_args(steps=30, step_time=0.1, extra=("--ckpt-dir", str(tmp_path / "ckpt"))),
        )
        return launch(argv, name=name, env=agent_env())

    agents = [torchrun_style("2", "agent-a"), torchrun_style("2", "agent-b")]
    wait_for_any(agents, STEP_LINE.format(world=2), START_S)
    hosts = [a for a in agents if "this agent hosts it (convenience mode)" in a.output()]
    assert len(hosts) == 1, [a.output()[-2000:] for a in agents]

    mismatched = torchrun_style("3", "agent-mismatch")
    code = mismatched.wait(60)

    assert code == 2, mismatched.output()
    error_lines = [
        line for line in mismatched.output().splitlines() if line.startswith("elastic-run: error:")
    ]
    assert len(error_lines) == 1, mismatched.output()
    assert f"--nnodes 3:3 disagrees with the master of job {job_id}, which runs 2:2" in error_lines[0]
    assert "Traceback" not in mismatched.output()
    remember_workers(*agents)
    assert_succeeded(*agents)
    assert sorted(s[:2] for a in agents for s in starts(a)) == [(0, 2), (1, 2)]
    assert_no_survivors(*agents)
