"""Sharded flash checkpoints end to end: real agents (``python -m agent``) as two fake
nodes of two workers, a real ``elastic-master``, scripts/train_sharded.py (FSDP2 on gloo) saving its
sharded state every step into the agents' shared memory, no ``--ckpt-dir``. The agents replicate each
node's newest save to the other (``--replicas 1``, the default); a SIGKILLed node's shards then come back
from the replica its peer holds.

Waiting is polling with a deadline; the e2e harness kills every process tree it started.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import e2e
import pytest
import torch
from e2e import (
    REPO,
    base_env,
    elastic_master_argv,
    elastic_run_argv,
    free_port,
    shm_folders,
    unique_job,
    wait_until,
)

from agent.checkpoints.shm_folder import folder_name
from elastic.checkpoint import shard_layout as sl

launch = e2e.launch
jobs = e2e.jobs

SCRIPT = REPO / "scripts" / "train_sharded.py"
RUN_TIMEOUT_S = 180  # four torch workers and two agents share two cores with other suites
LAG_BOUND = 1  # --replication-lag's default


def steps_in(output: str) -> list[tuple[int, int]]:
    """``(step, world)`` of every step line of rank 0."""
    return [
        (int(s), int(w)) for s, w in re.findall(r"^\[rank0\]:step=(\d+) loss=\S+ world=(\d+)$", output, re.M)
    ]


def resumed_in(output: str, world: int) -> list[int]:
    """The steps rank 0 resumed from in the starts at ``world``."""
    pattern = rf"^\[rank0\]:start rank=0 world={world} restart=\d+ resumed_step=(\d+)$"
    return [int(s) for s in re.findall(pattern, output, re.M)]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_killed_nodes_shards_are_restored_from_its_peers_memory(launch, jobs, tmp_path: Path) -> None:
    job = unique_job("sharded")
    jobs.append(job)
    token = tmp_path / "tok"
    token.write_text("sharded-test-token\n")
    token.chmod(0o600)
    master = launch(
        elastic_master_argv(
            *("--host", "127.0.0.1", "--port", "0", "--job-id", job, "--nnodes", "1:2"),
            *("--token-file", str(token), "--heartbeat-interval", "0.5", "--heartbeat-timeout", "3"),
            *("--last-call", "3", "--max-restarts", "5"),
        ),
        name="master",
    )
    port = master.wait_for(r"listening on 127\.0\.0\.1:(\d+)", RUN_TIMEOUT_S).group(1)
    steps, batch = 150, 64
    script = [str(SCRIPT), "--steps", str(steps), "--batch-size", str(batch), "--step-time", "0.1"]

    def agent(node: str):
        argv = elastic_run_argv(
            *("--nnodes", "1:2", "--nproc-per-node", "2", "--master", f"127.0.0.1:{port}"),
            *("--job-id", job, "--token-file", str(token), "--node-id", node, "--stop-grace", "2"),
            *script,
            *("--final-weights", str(tmp_path / "elastic.pt")),
        )
        return launch(argv, name=f"agent-{node}")

    def world_steps(world: int, *procs) -> list[int]:
        return [s for p in procs for s, w in steps_in(p.output()) if w == world]

    nodes = {"a": agent("a"), "b": agent("b")}
    wait_until(lambda: len(world_steps(4, *nodes.values())) >= 10, RUN_TIMEOUT_S, "10 steps at world 4")
    # The node of rank 0 survives (its step lines are the record); the other one is lost.
    survivor = next(n for n, p in nodes.items() if world_steps(4, p))
    lost = next(n for n in nodes if n != survivor)
    held = e2e.SHM / folder_name(job, survivor) / sl.REPLICAS_SUBDIR / lost / sl.SHARDED_SUBDIR
    wait_until(lambda: sl.committed(held), RUN_TIMEOUT_S, f"node {survivor} to hold node {lost}'s replica")
    nodes[lost].kill()  # agent and workers SIGKILLed: its shared memory is out of reach
    last_at_4 = max(world_steps(4, nodes[survivor]))

    keeper = nodes[survivor]
    wait_until(lambda: len(world_steps(2, keeper)) >= 5, RUN_TIMEOUT_S, "5 steps at world 2")
    (resumed,) = resumed_in(keeper.output(), 2)
    assert 0 < resumed <= last_at_4, keeper.output()[-4000:]
    assert last_at_4 - resumed <= LAG_BOUND, f"step {last_at_4} was done, the restore went back to {resumed}"

    # The lost node comes back (same node id: it takes over its dead predecessor's folder): world 4 again,
    # its ranks receive the survivor's world-2 shards over the process group.
    before = len(world_steps(4, keeper))
    back = nodes[lost] = agent(lost)
    wait_until(lambda: len(world_steps(4, keeper, back)) > before, RUN_TIMEOUT_S, "world 4 again")
    assert keeper.wait(2 * RUN_TIMEOUT_S) == 0, keeper.output()[-4000:]
    assert back.wait(RUN_TIMEOUT_S) == 0, back.output()[-4000:]
    assert f"[rank0]:done step={steps}" in keeper.output() + back.output()
    done = [s for p in (keeper, back) for s, _ in steps_in(p.output())]
    redone = sorted({s for s in done if done.count(s) > 1})
    assert len(redone) <= LAG_BOUND, f"steps trained twice: {redone}"
    # A worker stopped at the resize between its save and its step line leaves a step unprinted; the next
    # round's start names it.
    resumed_from = {s for p in (keeper, back) for w in (2, 4) for s in resumed_in(p.output(), w)}
    missing = sorted(set(range(1, steps + 1)) - set(done) - resumed_from)
    assert missing == [], f"steps neither reported nor resumed from: {missing}"
    assert shm_folders(job) == []

    # The same global batches without any fault, at world 2: the same weights but for float rounding.
    alone = launch(
        elastic_run_argv(
            *("--standalone", "--no-warm-start", "--nproc-per-node", "2"),
            *script,
            *("--final-weights", str(tmp_path / "alone.pt")),
        ),
        name="uninterrupted",
    )
    assert alone.wait(2 * RUN_TIMEOUT_S) == 0, alone.output()[-4000:]
    resized, expected = (torch.load(tmp_path / f, weights_only=True) for f in ("elastic.pt", "alone.pt"))
    assert resized.keys() == expected.keys()
    for name, tensor in expected.items():
        relative = float((resized[name] - tensor).abs().max() / tensor.abs().max())
        assert relative <= 1e-5, f"{name} differs from the uninterrupted run by {relative:.2e} (relative)"


def run_without_agent(world: int, args: list[str], log_dir: Path) -> None:
    """scripts/train_sharded.py on ``world`` ranks with torchrun's environment and no agent (gloo)."""
    port = free_port()
    log_dir.mkdir(parents=True, exist_ok=True)
    procs = []
    try:
        for rank in range(world):
            env = base_env(
                RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world)
            )
            env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
            for name in ("ELASTIC_SHM_DIR", "ELASTIC_CKPT_DIR", "ELASTIC_AGENT_SOCKET"):
                env.pop(name, None)
            with (log_dir / f"rank{rank}.log").open("wb") as out:
                argv = [sys.executable, str(SCRIPT), *args]
                procs.append(
                    subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=log_dir)
                )
        codes = [p.wait(RUN_TIMEOUT_S) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    logs = "\n".join((log_dir / f"rank{r}.log").read_text(errors="replace")[-3000:] for r in range(world))
    assert codes == [0] * world, logs


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_sharded_saves_persisted_by_the_agents_load_at_another_world_size_without_an_agent(
    launch, jobs, tmp_path: Path
) -> None:
    job = unique_job("shpersist")
    jobs.append(job)
    token = tmp_path / "tok"
    token.write_text("sharded-test-token\n")
    token.chmod(0o600)
    ckpt = tmp_path / "ckpt"  # one folder both fake nodes share (a shared file system)
    master = launch(
        elastic_master_argv(
            *("--host", "127.0.0.1", "--port", "0", "--job-id", job, "--nnodes", "2"),
            *("--token-file", str(token), "--heartbeat-interval", "0.5", "--heartbeat-timeout", "5"),
        ),
        name="master",
    )
    port = master.wait_for(r"listening on 127\.0\.0\.1:(\d+)", RUN_TIMEOUT_S).group(1)
    steps = 12
    script = [str(SCRIPT), "--steps", str(steps), "--batch-size", "60"]
    agents = [
        launch(
            elastic_run_argv(
                *("--nnodes", "2", "--nproc-per-node", "2", "--master", f"127.0.0.1:{port}"),
                *("--job-id", job, "--token-file", str(token), "--node-id", node, "--ckpt-dir", str(ckpt)),
                *script,
                *("--final-weights", str(tmp_path / "elastic.pt")),
            ),
            name=f"agent-{node}",
        )
        for node in ("a", "b")
    ]
    for agent in agents:
        assert agent.wait(2 * RUN_TIMEOUT_S) == 0, agent.output()[-4000:]
    assert shm_folders(job) == []
    disk = ckpt / sl.SHARDED_SUBDIR
    (step, _, data), *_ = sl.committed(disk)
    assert step == steps and sl.latest_step(disk) == steps, "the last save is on disk when the job ends"
    assert sorted(p.name for p in data.glob("*.distcp")) == [f"__{r}_0.distcp" for r in range(4)]
    assert sl.complete_on_disk(data) and not list(data.glob(".*.tmp"))

    # World 3, no agent: DCP re-shards the persisted step; nothing is left to train.
    out = tmp_path / "world3"
    run_without_agent(3, [*script[1:], "--ckpt-dir", str(ckpt), "--final-weights", str(out / "w.pt")], out)
    assert f"resumed_step={steps}" in (out / "rank0.log").read_text()
    trained, loaded = (torch.load(p, weights_only=True) for p in (tmp_path / "elastic.pt", out / "w.pt"))
    assert trained.keys() == loaded.keys()
    for name, tensor in trained.items():
        assert torch.equal(loaded[name], tensor), name
