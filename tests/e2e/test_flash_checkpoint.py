"""Flash checkpoints, exact data position and exactly-once training.

Library tests run in this process (flash save, space check, memory-first load) or as small gloo worlds
of real processes (tests/support/ckpt_worker.py: the ranks' agreement in elastic.load, DCP re-sharding). The
end-to-end tests run real agents (``python -m agent``), a real master and scripts/train_script.py
through the e2e harness, which kills every process tree it started. Waiting is always polling with a
deadline, never a bare sleep; each test checks that no shared-memory folder of its job is left.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import e2e
import psutil
import pytest
import torch
from ckpt_world import WORKER, results, run_world
from e2e import (
    REPO,
    SHM,
    TRAIN_SCRIPT,
    alive,
    base_env,
    elastic_master_argv,
    elastic_run_argv,
    shm_folders,
    unique_job,
    wait_until,
)

from agent.checkpoints.shm_folder import folder_name
from elastic.checkpoint import layout
from elastic.checkpoint import replicated as checkpoint
from elastic.checkpoint.replicated import CheckpointError

launch = e2e.launch  # the fixture: starts processes, kills their trees at teardown
jobs = e2e.jobs  # the fixture: removes the shared-memory folders of the test's jobs

# A change of summation order (world size, micro-batches) moves the example MLP's final weights by float
# rounding only: 4e-6 (relative) at its default lr (0.05, momentum 0.9) since its activations are tanh, not
# ReLU. At 0.005 such runs agree to ~1e-7, so weights can be compared across world sizes.
LOW_LR = "0.005"
RUN_TIMEOUT_S = 150  # other suites share the 2 cores; each torch worker takes seconds to start


def steps_in(output: str) -> list[tuple[int, int]]:
    """``(step, world)`` of every step line of rank 0."""
    return [
        (int(s), int(w)) for s, w in re.findall(r"^\[rank0\]:step=(\d+) loss=\S+ world=(\d+)$", output, re.M)
    ]


def starts_in(output: str) -> list[tuple[int, int, int, int]]:
    """``(rank, world, restart, resumed_step)`` of every worker start."""
    pattern = r"^\[rank(\d+)\]:start rank=\d+ world=(\d+) restart=(\d+) resumed_step=(\d+)$"
    return [tuple(map(int, m)) for m in re.findall(pattern, output, re.M)]  # type: ignore[misc]


def standalone_argv(
    job: str, nproc: int, ckpt: Path | None, *script_args: str, node: str = "n1"
) -> list[str]:
    agent = ["--standalone", "--rdzv-id", job, "--node-id", node, "--nproc-per-node", str(nproc)]
    agent += ["--max-restarts", "5", "--stop-grace", "2"]
    if ckpt is not None:
        agent += ["--ckpt-dir", str(ckpt)]
    return elastic_run_argv(*agent, str(TRAIN_SCRIPT), *script_args)


# == the library in one process ===========================================================================
@pytest.fixture
def flash_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Path, socket.socket]]:
    """A fake agent for one worker: a shared-memory folder and the progress socket it listens on."""
    shm = tmp_path / "shm"
    shm.mkdir()
    for name in ("RANK", "WORLD_SIZE", "GROUP_RANK", "ELASTIC_CKPT_DIR", "ELASTIC_COMMITTED_STEP"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("ELASTIC_SHM_DIR", str(shm))
    monkeypatch.setenv("LOCAL_RANK", "0")
    sock_path = str(tmp_path / "agent.sock")
    monkeypatch.setenv("ELASTIC_AGENT_SOCKET", sock_path)
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as agent:
        agent.bind(sock_path)
        agent.settimeout(5)
        yield shm, agent


def received(agent: socket.socket) -> dict:
    return json.loads(agent.recv(65536))


@pytest.mark.timeout(30)
def test_flash_save_writes_to_shared_memory_only_and_asks_the_agent_to_persist(
    flash_env: tuple[Path, socket.socket], tmp_path: Path
) -> None:
    shm, agent = flash_env
    for step in (1, 2, 3):
        path = checkpoint.save({"w": torch.full((4,), float(step))}, step, tmp_path / "disk")
        assert path == shm / layout.step_file_name(step)
        message = received(agent)
        assert (message["k"], message["step"], message["loc"], message["r"]) == ("ckpt", step, str(path), 0)
        assert message["dir"] == str((tmp_path / "disk").resolve()), "persisted where the script loads from"

    assert [s for s, _ in layout.checkpoint_files(shm)] == [3, 2], "memory keeps the last two saves"
    assert not (tmp_path / "disk").exists(), "no disk I/O in the worker"
    assert not [p for p in shm.iterdir() if p.name.endswith(".tmp")]
    state, step = checkpoint.parse_checkpoint((shm / layout.step_file_name(3)).read_bytes(), "cpu")
    assert step == 3 and torch.equal(state["w"], torch.full((4,), 3.0))

    checkpoint.save({"w": torch.zeros(1)}, 4, persist=False)
    assert received(agent)["loc"] == "", "persist=False keeps the save in memory only"


@pytest.mark.timeout(30)
def test_only_local_rank_zero_stores_and_only_node_rank_zero_persists(
    flash_env: tuple[Path, socket.socket], monkeypatch: pytest.MonkeyPatch
) -> None:
    shm, agent = flash_env
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert checkpoint.save({"w": torch.ones(1)}, 5) is None
    assert not list(shm.iterdir())
    message = received(agent)
    assert (message["step"], message["loc"]) == (5, ""), "reported, with nothing to copy"

    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("GROUP_RANK", "1")
    assert checkpoint.save({"w": torch.ones(1)}, 5) == shm / layout.step_file_name(5)
    message = received(agent)
    assert (message["step"], message["loc"]) == (5, ""), "another node's agent persists"


@pytest.mark.timeout(30)
def test_too_small_shared_memory_is_a_clear_error_naming_the_sizes(
    flash_env: tuple[Path, socket.socket], monkeypatch: pytest.MonkeyPatch
) -> None:
    shm, _ = flash_env
    checkpoint.save({"w": torch.ones(1)}, 1)
    checkpoint.save({"w": torch.ones(1)}, 2)
    state = {"w": torch.zeros(3 << 20)}  # 12 MiB
    monkeypatch.setattr(checkpoint, "free_bytes", lambda directory: 5 << 20)

    with pytest.raises(
        CheckpointError, match=r"step 3: it needs about 13\.0 MiB .*only 5\.0 MiB is available"
    ):
        checkpoint.save(state, 3)

    # Before giving up it dropped the older memory copy, never the newest one.
    assert [s for s, _ in layout.checkpoint_files(shm)] == [2]
    monkeypatch.setattr(checkpoint, "free_bytes", lambda directory: 100 << 20)
    assert checkpoint.save(state, 3) is not None


@pytest.mark.timeout(30)
def test_load_prefers_memory_then_disk_and_forgets_rolled_back_saves(
    flash_env: tuple[Path, socket.socket], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    shm, _ = flash_env
    disk = tmp_path / "disk"
    monkeypatch.delenv("ELASTIC_SHM_DIR")
    checkpoint.save({"where": "disk"}, 5, disk)
    checkpoint.save({"where": "disk"}, 7, disk)
    monkeypatch.setenv("ELASTIC_SHM_DIR", str(shm))
    checkpoint.save({"where": "memory"}, 7)
    checkpoint.save({"where": "memory"}, 8)

    assert checkpoint.load(disk) == ({"where": "memory"}, 8)
    (shm / layout.step_file_name(8)).write_bytes(b"torn")  # damaged in memory (a rename never publishes it)
    assert checkpoint.load(disk) == ({"where": "memory"}, 7)
    assert not (shm / layout.step_file_name(8)).exists(), "saves after the restored step are dropped"
    (shm / layout.step_file_name(7)).write_bytes(b"")
    assert checkpoint.load(disk) == ({"where": "disk"}, 7), "a broken memory copy falls back to disk"
    with pytest.raises(CheckpointError, match="step 6 is not loadable"):
        checkpoint.load(disk, step=6)


@pytest.mark.timeout(30)
def test_starting_fresh_while_checkpoints_exist_is_an_error_naming_the_override(
    flash_env: tuple[Path, socket.socket], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    shm, _ = flash_env
    checkpoint.save({"v": 1}, 4)
    (shm / layout.step_file_name(4)).write_bytes(b"torn")
    with pytest.raises(CheckpointError, match=r"--ckpt-reset.*new job id"):
        checkpoint.load()
    monkeypatch.setenv("ELASTIC_CKPT_RESET", "1")
    assert checkpoint.load() is None, "the override starts fresh"
    checkpoint.save({"v": 2}, 5)
    assert checkpoint.load() is None, "still set: this rank's copies are ignored"


@pytest.mark.timeout(30)
def test_load_without_process_group_in_a_multi_rank_world_needs_the_committed_step(
    flash_env: tuple[Path, socket.socket], monkeypatch: pytest.MonkeyPatch
) -> None:
    checkpoint.save({"v": 1}, 1)
    checkpoint.save({"v": 2}, 2)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(CheckpointError, match="init_process_group"):
        checkpoint.load()
    monkeypatch.setenv("ELASTIC_COMMITTED_STEP", "1")
    assert checkpoint.load() == ({"v": 1}, 1)


@pytest.mark.timeout(10)
def test_without_an_agent_save_is_the_atomic_disk_save(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("ELASTIC_SHM_DIR", raising=False)
    assert not checkpoint.flash_enabled()
    assert checkpoint.save({"w": torch.ones(1)}, 3, tmp_path, rank=0) == tmp_path / "step_0000000003.pt"
    assert (tmp_path / "latest").read_text() == "step_0000000003.pt"


# == small gloo worlds of real processes ====================================================================


def shm_env(folders: list[Path]):
    """Per-rank environment: rank R's shared-memory folder is ``folders[R]``."""
    return lambda rank: {"ELASTIC_SHM_DIR": str(folders[rank])}


def write_checkpoint(folder: Path, step: int, value: float | None = None) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / layout.step_file_name(step)
    if value is None:
        path.write_bytes(b"garbage")  # unloadable, under a final name
    else:
        torch.save({"step": step, "state": {"value": torch.tensor([value])}}, path)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_all_ranks_restore_the_newest_step_any_rank_holds_from_one_holder(tmp_path: Path) -> None:
    # Two ranks as two nodes, each with its own memory; a shared disk folder.
    memory = [tmp_path / "node0", tmp_path / "node1"]
    disk = tmp_path / "disk"
    write_checkpoint(disk, 3, 3.0)
    for step in (5, 6):
        write_checkpoint(memory[0], step, float(step))
    for step in (4, 5):
        write_checkpoint(memory[1], step, float(step) + 0.5)  # another run's state under the same step
    out = tmp_path / "out"
    out.mkdir()

    def env(rank: int) -> dict[str, str]:
        # The master's committed step is older: a newer step some rank holds wins.
        return {"ELASTIC_SHM_DIR": str(memory[rank]), "ELASTIC_COMMITTED_STEP": "4"}

    run_world(2, ["load", str(out), str(disk)], tmp_path / "logs", env)
    assert results(out, 2) == [{"step": 6, "value": [6.0]}, {"step": 6, "value": [6.0]}]
    kept = torch.load(memory[1] / layout.step_file_name(6), weights_only=True)
    assert kept["state"]["value"].tolist() == [6.0], "node 1 keeps the step it received in its memory"

    # Every copy of step 6 is broken: both ranks fall back together to step 5, and take one holder's
    # bytes (rank 0's 5.0), never a mix of the two states saved under step 5.
    for folder in memory:
        write_checkpoint(folder, 6)
    run_world(2, ["load", str(out), str(disk)], tmp_path / "logs2", env)
    assert results(out, 2) == [{"step": 5, "value": [5.0]}, {"step": 5, "value": [5.0]}]

    # A node that joins with nothing resumes from its peer's memory, not from the older disk copy.
    joining = tmp_path / "joining"
    joining.mkdir()
    holder = tmp_path / "holder"
    write_checkpoint(holder, 9, 9.0)
    folders = [joining, holder]
    run_world(2, ["load", str(out), str(disk)], tmp_path / "logs3", shm_env(folders))
    assert results(out, 2) == [{"step": 9, "value": [9.0]}, {"step": 9, "value": [9.0]}]
    assert (joining / layout.step_file_name(9)).is_file()

    # Nothing anywhere: a fresh start on every rank.
    empty = [tmp_path / "empty0", tmp_path / "empty1"]
    for folder in empty:
        folder.mkdir()
    run_world(2, ["load", str(out)], tmp_path / "logs4", shm_env(empty))
    assert results(out, 2) == [{"step": None, "value": None}, {"step": None, "value": None}]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_restore_agreement_uses_tensor_collectives_and_works_without_numpy(tmp_path: Path) -> None:
    # torch's CPU wheel does not depend on numpy, and its object collectives fail without it
    # ("Numpy is not available"). The step agreement of elastic.load must not need it.
    blocker = tmp_path / "no_numpy"
    blocker.mkdir()
    blocked = "raise ModuleNotFoundError('numpy is blocked by the test', name='numpy')\n"
    (blocker / "numpy.py").write_text(blocked)
    memory = [tmp_path / "node0", tmp_path / "node1"]
    for step in (2, 7):
        write_checkpoint(memory[0], step, float(step))
    for step in (2, 7, 8):
        write_checkpoint(memory[1], step, float(step))
    out = tmp_path / "out"
    out.mkdir()

    def env(rank: int) -> dict[str, str]:
        path = os.pathsep.join([str(blocker), str(REPO)])
        return {"ELASTIC_SHM_DIR": str(memory[rank]), "PYTHONPATH": path}

    run_world(2, ["load", str(out)], tmp_path / "logs", env)
    assert results(out, 2) == [{"step": 8, "value": [8.0]}, {"step": 8, "value": [8.0]}]
    logs = (tmp_path / "logs" / "rank0.log").read_text()
    assert "Failed to initialize NumPy" in logs, "the blocker did not hide numpy from torch"


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_sharded_checkpoint_saved_at_world_2_loads_at_world_1_and_3(tmp_path: Path) -> None:
    sys.path.insert(0, str(WORKER.parent))
    from ckpt_worker import expected_tensors

    ckpt = tmp_path / "ckpt"
    run_world(2, ["sharded-save", str(tmp_path), str(ckpt), "9"], tmp_path / "save")
    assert (ckpt / "sharded" / "latest").read_text() == "step_0000000009"
    assert not [p for p in (ckpt / "sharded").iterdir() if p.name.endswith(".tmp")]

    expected = expected_tensors()
    for world in (1, 3):
        out = tmp_path / f"world{world}"
        out.mkdir()
        run_world(world, ["sharded-load", str(out), str(ckpt)], out / "logs")
        assert [r["step"] for r in results(out, world)] == [9] * world
        full = torch.load(out / "full.pt", weights_only=True)
        for name, tensor in expected.items():
            assert torch.equal(full[name], tensor), f"{name} differs at world {world}"
        assert full["meta"] == {"epoch": 4}


# == end to end: real agents, master and training script =================================================
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_worker_killed_right_after_a_save_resumes_from_that_step_from_memory(launch, jobs, tmp_path) -> None:
    job = unique_job("flash1")
    jobs.append(job)
    ckpt = tmp_path / "ckpt"
    # Every persist pauses mid-copy: nothing complete reaches the disk while the test looks.
    env = base_env(ELASTIC_PERSIST_DELAY_S="600")
    script = ["--steps", "10", "--ckpt-every", "1", "--batch-size", "64", "--hold-at-step", "6"]
    proc = launch(standalone_argv(job, 2, ckpt, *script), name="agent", env=env)

    proc.wait_for(r"^\[rank0\]:step=6 loss", RUN_TIMEOUT_S)  # logged after the save; then every rank holds
    memory = SHM / folder_name(job, "n1")
    assert layout.checkpoint_files(memory)[0][0] == 6
    assert layout.checkpoint_files(ckpt) == []
    workers = proc.worker_pids()
    assert len(workers) == 2
    offset = len(proc.output())
    os.kill(max(workers), signal.SIGKILL)

    restarted = proc.wait_for(
        r"^\[rank0\]:start rank=0 world=2 restart=1 resumed_step=(\d+)$", RUN_TIMEOUT_S, after=offset
    )
    assert int(restarted.group(1)) == 6
    proc.wait_for(r"^\[rank1\]:start rank=1 world=2 restart=1 resumed_step=6$", RUN_TIMEOUT_S, after=offset)
    assert layout.checkpoint_files(ckpt) == [], "the restore came from memory"
    assert proc.wait(RUN_TIMEOUT_S) == 0, proc.output()[-4000:]
    after = [step for step, _ in steps_in(proc.output()[restarted.end() :])]
    assert after == [7, 8, 9, 10]
    # The keeper's stop ended the pause and persisted the newest save; then it freed the memory.
    assert (ckpt / "latest").read_text() == "step_0000000010.pt"
    assert shm_folders(job) == []


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_three_worker_kills_end_with_the_weights_of_an_uninterrupted_run(launch, jobs, tmp_path) -> None:
    script = ["--steps", "40", "--batch-size", "128", "--ckpt-every", "10"]
    ref_job, job = unique_job("ref"), unique_job("once")
    jobs += [ref_job, job]
    reference = launch(
        standalone_argv(
            ref_job, 2, tmp_path / "ref-ckpt", *script, "--final-hash", str(tmp_path / "ref.hash")
        ),
        name="reference",
    )
    proc = launch(
        standalone_argv(
            job,
            2,
            tmp_path / "ckpt",
            *script,
            "--step-time",
            "0.1",
            "--final-hash",
            str(tmp_path / "killed.hash"),
        ),
        name="killed",
    )

    offset = 0
    for kill in range(1, 4):
        # Let the workers take a few steps in this attempt, then kill one: alternately rank 1 and rank 0.
        seen = proc.wait_for(r"^\[rank0\]:step=(\d+) loss", RUN_TIMEOUT_S, after=offset)
        proc.wait_for(rf"^\[rank0\]:step={int(seen.group(1)) + 2} loss", RUN_TIMEOUT_S, after=offset)
        by_rank = {int(psutil.Process(pid).environ()["RANK"]): pid for pid in proc.worker_pids()}
        offset = len(proc.output())
        os.kill(by_rank[kill % 2], signal.SIGKILL)
        proc.wait_for(
            rf"^\[rank0\]:start rank=0 world=2 restart={kill} resumed_step=\d+$", RUN_TIMEOUT_S, after=offset
        )

    assert proc.wait(RUN_TIMEOUT_S) == 0, proc.output()[-4000:]
    assert reference.wait(RUN_TIMEOUT_S) == 0, reference.output()[-4000:]
    resumed = [s for rank, _, restart, s in starts_in(proc.output()) if rank == 0 and restart > 0]
    assert len(resumed) == 3 and all(s > 0 for s in resumed), resumed
    # Every step was completed; the ones lost to a kill were done again after the restore. A kill between
    # a save and its step line leaves that step unprinted: the restart resumed from it.
    assert {step for step, _ in steps_in(proc.output())} | set(resumed) == set(range(1, 41))
    assert (tmp_path / "killed.hash").read_text() == (tmp_path / "ref.hash").read_text()
    assert shm_folders(job) == [] and shm_folders(ref_job) == []


def read_sample_logs(folder: Path) -> dict[int, dict[int, list[int]]]:
    """``{step: {round: indices}}`` from every rank's log (a round's indices of a step over all its ranks)."""
    by_step: dict[int, dict[int, list[int]]] = defaultdict(lambda: defaultdict(list))
    for path in folder.iterdir():
        round_number = int(re.match(r"round(\d+)-rank\d+-pid\d+\.log$", path.name).group(1))  # type: ignore[union-attr]
        for line in path.read_text().splitlines():
            step, epoch, *indices = map(int, line.split())
            assert epoch == 0
            by_step[step][round_number] += indices
    return by_step


@pytest.mark.slow
@pytest.mark.timeout(480)
@pytest.mark.parametrize("disk", [True, False], ids=["ckpt-dir", "memory-only"])
def test_resize_2_1_2_mid_epoch_consumes_every_sample_exactly_once(launch, jobs, tmp_path, disk) -> None:
    # Without --ckpt-dir the node that joins holds nothing: it must resume from the survivor's memory.
    job = unique_job("resize")
    jobs.append(job)
    token = tmp_path / "tok"
    token.write_text("resize-test-token\n")
    master = launch(
        elastic_master_argv(
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--job-id",
            job,
            "--nnodes",
            "1:2",
            "--token-file",
            str(token),
            "--heartbeat-interval",
            "0.5",
            "--heartbeat-timeout",
            "3",
            "--last-call",
            "1",
            "--max-restarts",
            "5",
        ),
        name="master",
    )
    port = master.wait_for(r"listening on 127\.0\.0\.1:(\d+)", RUN_TIMEOUT_S).group(1)
    samples, batch = 4096, 32
    steps = samples // batch  # exactly one epoch
    logs = tmp_path / "samples"

    def agent(node: str):
        argv = elastic_run_argv(
            "--nnodes",
            "1:2",
            "--nproc-per-node",
            "1",
            "--master",
            f"127.0.0.1:{port}",
            "--job-id",
            job,
            "--token-file",
            str(token),
            "--node-id",
            node,
            *(["--ckpt-dir", str(tmp_path / "ckpt")] if disk else []),
            "--stop-grace",
            "2",
            str(TRAIN_SCRIPT),
            "--steps",
            str(steps),
            "--batch-size",
            str(batch),
            "--num-samples",
            str(samples),
            "--ckpt-every",
            "4",
            "--sample-log",
            str(logs),
            "--ckpt-dir",
            str(tmp_path / "ckpt") if disk else "",  # the script's own flag; '': memory only
            "--final-weights",
            str(tmp_path / "resized.pt"),
            "--lr",
            LOW_LR,
        )
        return launch(argv, name=f"agent-{node}")

    def world_steps(world: int, *procs) -> list[int]:
        return [s for p in procs for s, w in steps_in(p.output()) if w == world]

    a, b = agent("a"), agent("b")
    wait_until(lambda: len(world_steps(2, a, b)) >= 20, RUN_TIMEOUT_S, "20 steps at world 2")
    b.kill()  # the node is lost: agent and workers SIGKILLed
    wait_until(lambda: len(world_steps(1, a)) >= 15, RUN_TIMEOUT_S, "15 steps at world 1")
    before = len(world_steps(2, a))
    c = agent("c")
    wait_until(lambda: len(world_steps(2, a, c)) > before, RUN_TIMEOUT_S, "world 2 again")
    assert a.wait(2 * RUN_TIMEOUT_S) == 0, a.output()[-4000:]
    assert c.wait(RUN_TIMEOUT_S) == 0, c.output()[-4000:]
    assert any(f"[rank0]:done step={steps}" in p.output() for p in (a, c))
    assert max(world_steps(1, a)) < steps, "the resize happened mid-epoch"
    completed = [s for p in (a, b, c) for s, _ in steps_in(p.output())]  # rank 0's lines, any node
    redone = sorted({s for s in completed if completed.count(s) > 1})
    assert redone == [], f"steps trained twice after a resize: {redone}"

    # For each step, the round that executed it last is the one whose update the final weights contain.
    by_step = read_sample_logs(logs)
    assert sorted(by_step) == list(range(1, steps + 1))
    # A worker stopped (SIGTERM at a resize) or killed between its save and its step line leaves a
    # completed step unprinted; the next round's start lines name the step they resumed from.
    resumed = {r for p in (a, b, c) for *_, r in starts_in(p.output()) if r > 0}
    missing = sorted(set(range(1, steps + 1)) - set(completed) - resumed)
    assert missing == [], f"steps neither reported nor resumed from: {missing}"
    consumed = [i for step in sorted(by_step) for i in by_step[step][max(by_step[step])]]
    assert all(len(by_step[s][max(by_step[s])]) == batch for s in by_step)
    assert sorted(consumed) == list(range(samples)), "a sample was skipped or repeated"
    assert shm_folders(job) == []
    if disk:
        return
    # The same run without faults: the same global batches at the same world sizes, each phase a clean
    # run that resumes from the previous one's disk checkpoint. Bitwise equal: the lost node, the restore
    # from the survivor's memory and the broadcast to the new node changed nothing.
    schedule = sorted({(resumed, world) for p in (a, b, c) for _, world, _, resumed in starts_in(p.output())})
    phases = [
        (w, end)
        for (start, w), (end, _) in zip(schedule, [*schedule[1:], (steps, 0)], strict=True)
        if end > start
    ]
    assert [w for w, _ in phases] == [2, 1, 2], schedule
    for world, end in phases:
        clean = launch(
            elastic_run_argv(
                *("--standalone", "--no-warm-start", "--nproc-per-node", str(world)),
                str(TRAIN_SCRIPT),
                *("--steps", str(end), "--batch-size", str(batch), "--num-samples", str(samples)),
                *("--ckpt-dir", str(tmp_path / "clean-ckpt"), "--final-weights", str(tmp_path / "clean.pt")),
                *("--ckpt-every", "4", "--lr", LOW_LR),
            ),
            name=f"clean-world{world}-to{end}",
        )
        assert clean.wait(2 * RUN_TIMEOUT_S) == 0, clean.output()[-4000:]
    resized, expected = (torch.load(tmp_path / f, weights_only=True) for f in ("resized.pt", "clean.pt"))
    for name, tensor in expected.items():
        assert torch.equal(resized[name], tensor), (
            f"{name} differs from the fault-free run of the same schedule"
        )
    # And one uninterrupted run at world 2, the same global batches: float rounding apart, the same weights.
    alone = launch(
        elastic_run_argv(
            *("--standalone", "--no-warm-start", "--nproc-per-node", "2"),
            str(TRAIN_SCRIPT),
            *("--steps", str(steps), "--batch-size", str(batch), "--num-samples", str(samples)),
            *("--final-weights", str(tmp_path / "alone.pt"), "--lr", LOW_LR),
        ),
        name="uninterrupted",
    )
    assert alone.wait(2 * RUN_TIMEOUT_S) == 0, alone.output()[-4000:]
    uninterrupted = torch.load(tmp_path / "alone.pt", weights_only=True)
    for name, tensor in uninterrupted.items():
        relative = float((resized[name] - tensor).abs().max() / tensor.abs().max())
        assert relative <= 1e-5, f"{name} differs from the uninterrupted run by {relative:.2e} (relative)"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_agent_killed_during_a_persist_restarts_from_the_previous_complete_checkpoint(
    launch, jobs, tmp_path
) -> None:
    job = unique_job("torn")
    jobs.append(job)
    ckpt = tmp_path / "ckpt"
    script = ["--steps", "20", "--ckpt-every", "3", "--batch-size", "64", "--step-time", "0.1"]
    # Persists from step 6 on pause mid-copy: step 3 completes, step 6 is caught half-written.
    first = launch(
        standalone_argv(job, 1, ckpt, *script), name="first", env=base_env(ELASTIC_PERSIST_DELAY_S="600@6")
    )

    def torn() -> list[Path]:
        return (
            [p for p in ckpt.glob(".step_0000000006.pt.*.tmp") if p.stat().st_size > 0]
            if ckpt.is_dir()
            else []
        )

    wait_until(torn, RUN_TIMEOUT_S, "the persist of step 6 in progress")
    assert (ckpt / "latest").read_text() == "step_0000000003.pt"
    workers = first.worker_pids()
    assert workers
    os.kill(first.pid, signal.SIGKILL)
    first.wait(30)
    wait_until(lambda: not any(map(alive, workers)), 30, "the workers of the killed agent to be reaped")
    assert torn() and not (ckpt / "step_0000000006.pt").exists()
    # The killed agent's memory (newer saves than step 3) is left behind; the next agent's start removes
    # it (any agent starting on this host would: tests/integration/test_ckpt_keeper.py checks that rule).

    second = launch(standalone_argv(job, 1, ckpt, *script), name="second")
    assert second.wait(RUN_TIMEOUT_S) == 0, second.output()[-4000:]
    assert starts_in(second.output()) == [(0, 1, 0, 3)], "restarted from step 3, the last complete one"
    assert [s for s, _ in steps_in(second.output())] == list(range(4, 21))
    assert (ckpt / "latest").read_text() == "step_0000000020.pt"
    assert not list(ckpt.glob("*.tmp")), "the torn temp file was cleaned up"
    assert shm_folders(job) == [], "the stale memory was removed at start, the new one at exit"


@pytest.mark.timeout(120)
def test_benchmark_smoke_mode_prints_the_table(tmp_path: Path) -> None:
    disk, report = tmp_path / "disk", tmp_path / "report.json"
    disk.mkdir()
    argv = [sys.executable, str(REPO / "bench" / "checkpoint.py"), "--smoke", "--disk-dir", str(disk)]
    argv += ["--json", str(report)]
    bench = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=base_env(), cwd=REPO
    )
    try:
        out, err = bench.communicate(timeout=110)
    finally:
        bench.kill()
        bench.wait()
    assert bench.returncode == 0, err
    rows = ("flash save", "torch.save", "restore from memory", "restore from disk", "memory copy")
    rows += ("sharded flash save", "from a peer's replica", "replication push", "loopback TCP")
    for row in rows:
        assert row in out, out
    assert not (SHM / folder_name(f"bench-{bench.pid}", "n0")).exists()
    assert list(disk.iterdir()) == []
    # The restore targets' rows, each with its references measured in the same run.
    targets = {row["row"]: row for row in json.loads(report.read_text())["rows"] if "row" in row}
    assert sorted(targets) == ["restore_own_memory_over_memcpy", "restore_peer_over_tcp"], targets
    for row in targets.values():
        assert row["restore_s"] > 0 and row["reference_s"] > 0 and row["digest_s"] > 0, row
        assert row["met"] == (row["restore_s"] <= row["target_ratio"] * row["reference_s"] + row["digest_s"])
