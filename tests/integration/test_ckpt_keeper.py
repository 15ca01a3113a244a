"""Unit tests of the agent's checkpoint keeper (agent/checkpoints/keeper.py): shared-memory folder hygiene,
background persistence (atomic, keep-K, newest-wins when busy) and the progress-channel hook.

The keeper is stdlib-only; checkpoints here are opaque bytes written the way a worker writes them (temp
file, rename). Roots are temp folders, except where /dev/shm itself is the point."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from e2e import wait_until

from agent.checkpoints import fence as ckpt_fence
from agent.checkpoints.keeper import CheckpointKeeper, keeper_for
from agent.checkpoints.persist import parse_persist_delay
from agent.checkpoints.shm_folder import DEFAULT_ROOT, OWNER_FILE, KeeperError, RootError, folder_name
from agent.observe.channel import ProgressChannel
from elastic.checkpoint import layout

REPO_ROOT = Path(__file__).resolve().parents[2]


def worker_save(folder: Path, step: int, payload: bytes | None = None) -> Path:
    """What elastic.save does in a worker: write under a temp name, rename (the commit)."""
    path = folder / layout.step_file_name(step)
    layout.atomic_write(path, lambda f: f.write(payload or f"state of step {step}".encode()), durable=False)
    return path


@pytest.fixture
def root(tmp_path: Path) -> Path:
    folder = tmp_path / "shm"
    folder.mkdir()
    return folder


@pytest.fixture
def keeper(root: Path, tmp_path: Path) -> Iterator[CheckpointKeeper]:
    k = CheckpointKeeper("job1", "node-a", ckpt_dir=tmp_path / "ckpt", keep=2, root=root).start()
    yield k
    k.stop()


# -- shared-memory folder ----------------------------------------------------------------------------------
@pytest.mark.timeout(10)
def test_folder_is_named_per_job_and_node_private_and_removed_on_stop(root: Path) -> None:
    keeper = CheckpointKeeper("job 1/x", "node-a", root=root).start()
    folder = root / "elastic-job_1_x-node-a"
    assert keeper.folder == folder and folder.is_dir()
    assert folder.stat().st_mode & 0o777 == 0o700
    owner = json.loads((folder / OWNER_FILE).read_text())
    assert (owner["job"], owner["node"], owner["pid"]) == ("job 1/x", "node-a", os.getpid())
    assert keeper.worker_env() == {"ELASTIC_SHM_DIR": str(folder)}

    keeper.stop()

    assert not folder.exists()
    keeper.stop()  # idempotent


@pytest.mark.timeout(30)
def test_start_removes_the_folder_a_crashed_agent_left(root: Path) -> None:
    # A folder whose owner process is gone: what an agent killed by SIGKILL leaves behind.
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    pid = int(dead.stdout)
    for node in ("node-a", "node-old"):  # same node, and a node id of a previous (crashed) agent
        stale = root / folder_name("job1", node)
        stale.mkdir()
        worker_save(stale, 5)
        record = {"job": "job1", "node": node, "host": socket.gethostname(), "pid": pid, "started": 0.0}
        (stale / OWNER_FILE).write_text(json.dumps(record))
    unowned = root / "elastic-something-else"  # not ours, no owner record: left alone
    unowned.mkdir()

    with CheckpointKeeper("job1", "node-a", root=root) as keeper:
        assert layout.checkpoint_files(keeper.folder) == []
        assert not (root / folder_name("job1", "node-old")).exists()
        assert unowned.is_dir()


@pytest.mark.timeout(10)
def test_a_live_agent_of_the_same_job_and_node_is_an_error_and_other_nodes_are_left_alone(root: Path) -> None:
    other = CheckpointKeeper("job1", "node-b", root=root).start()
    first = CheckpointKeeper("job1", "node-a", root=root).start()
    # Same process, so mark the owner as another live process: our parent.
    record = json.loads((first.folder / OWNER_FILE).read_text())
    parent = psutil.Process(os.getppid())
    record.update(pid=parent.pid, started=parent.create_time())
    (first.folder / OWNER_FILE).write_text(json.dumps(record))
    try:
        with pytest.raises(KeeperError, match=r"another agent .* node-a"):
            CheckpointKeeper("job1", "node-a", root=root).start()
        assert other.folder.is_dir()
    finally:
        first.stop()
        other.stop()


@pytest.mark.timeout(10)
def test_missing_root_is_a_keeper_error(tmp_path: Path) -> None:
    with pytest.raises(KeeperError, match="does not exist"):
        CheckpointKeeper("j", "n", root=tmp_path / "nope").start()


@pytest.mark.timeout(10)
def test_elastic_shm_root_moves_the_folder_and_a_missing_one_is_a_usage_error(tmp_path: Path) -> None:
    assert keeper_for("j", "n", None, 3, {}).root == DEFAULT_ROOT
    keeper = keeper_for("j", "n", None, 3, {"ELASTIC_SHM_ROOT": str(tmp_path)})
    assert keeper.folder == tmp_path / folder_name("j", "n")
    with pytest.raises(RootError, match=r"ELASTIC_SHM_ROOT=\S+/nope is not a folder; create it"):
        keeper_for("j", "n", None, 3, {"ELASTIC_SHM_ROOT": str(tmp_path / "nope")})


@pytest.mark.timeout(10)
def test_default_root_is_dev_shm_and_persist_delay_parses() -> None:
    assert Path("/dev/shm") == DEFAULT_ROOT
    assert parse_persist_delay(None) == (0.0, 0)
    assert parse_persist_delay("2.5") == (2.5, 0)
    assert parse_persist_delay("600@10") == (600.0, 10)
    for bad in ("soon", "1@x", "-1"):
        with pytest.raises(ValueError, match="ELASTIC_PERSIST_DELAY_S"):
            parse_persist_delay(bad)


# -- persistence -------------------------------------------------------------------------------------------
@pytest.mark.timeout(20)
def test_reported_checkpoint_is_persisted_atomically_with_marker_and_keep(
    keeper: CheckpointKeeper, tmp_path: Path
) -> None:
    ckpt = tmp_path / "ckpt"
    for step in (1, 2, 3):
        path = worker_save(keeper.folder, step)
        keeper.on_checkpoint(0, step, str(path))
        assert keeper.wait_idle(10)

    visible = sorted(p.name for p in ckpt.iterdir() if p.name != ckpt_fence.FENCE_FILE)
    assert visible == ["latest", "step_0000000002.pt", "step_0000000003.pt"]
    assert (ckpt / "latest").read_text() == "step_0000000003.pt"
    assert (ckpt / "step_0000000003.pt").read_bytes() == b"state of step 3"
    assert keeper.persisted_step == 3


@pytest.mark.timeout(20)
def test_reports_without_location_or_outside_the_folder_are_not_persisted(
    keeper: CheckpointKeeper, tmp_path: Path
) -> None:
    elsewhere = tmp_path / "secret" / layout.step_file_name(4)
    elsewhere.parent.mkdir()
    elsewhere.write_bytes(b"not yours")
    keeper.on_checkpoint(0, 4, "")
    keeper.on_checkpoint(0, 4, str(elsewhere))
    keeper.on_checkpoint(0, 5, str(worker_save(keeper.folder, 4)))  # step and name disagree
    assert keeper.wait_idle(10)
    assert not (tmp_path / "ckpt").exists()


@pytest.mark.timeout(20)
def test_busy_persist_never_blocks_and_only_the_newest_pending_save_follows(
    keeper: CheckpointKeeper, tmp_path: Path
) -> None:
    gate, copying = threading.Event(), threading.Event()
    original = keeper._copy

    def slow_copy(src, dst, step):
        copying.set()
        assert gate.wait(10)
        original(src, dst, step)

    keeper._copy = slow_copy  # type: ignore[method-assign]
    keeper.on_checkpoint(0, 1, str(worker_save(keeper.folder, 1)))
    assert copying.wait(10)
    for step in (2, 3, 4):  # arrive while step 1 is being copied: each returns at once
        keeper.on_checkpoint(0, step, str(worker_save(keeper.folder, step)))
    gate.set()
    assert keeper.wait_idle(10)

    steps = [step for step, _ in layout.checkpoint_files(tmp_path / "ckpt")]
    assert steps == [4, 1], "2 and 3 were skipped; 4, the newest, followed 1"
    assert keeper.skipped == 2


@pytest.mark.timeout(20)
def test_a_file_pruned_by_its_worker_before_its_persist_is_skipped(
    keeper: CheckpointKeeper, tmp_path: Path
) -> None:
    path = worker_save(keeper.folder, 1)
    path.unlink()
    keeper.on_checkpoint(0, 1, str(path))
    assert keeper.wait_idle(10)
    keeper.on_checkpoint(0, 2, str(worker_save(keeper.folder, 2)))
    assert keeper.wait_idle(10)
    assert [s for s, _ in layout.checkpoint_files(tmp_path / "ckpt")] == [2]


@pytest.mark.timeout(20)
def test_stop_ends_a_persist_pause_and_flushes_what_is_pending(root: Path, tmp_path: Path) -> None:
    keeper = CheckpointKeeper(
        "job1",
        "node-a",
        ckpt_dir=tmp_path / "ckpt",
        root=root,
        persist_delay_s=600,
        persist_delay_from_step=2,
    ).start()
    keeper.on_checkpoint(0, 1, str(worker_save(keeper.folder, 1)))
    assert keeper.wait_idle(10)  # step 1: no pause
    keeper.on_checkpoint(0, 2, str(worker_save(keeper.folder, 2, b"x" * (9 << 20))))

    def torn_files() -> list[Path]:
        return [p for p in (tmp_path / "ckpt").iterdir() if p.name.endswith(".tmp") and p.stat().st_size]

    # Step 3 is reported only once step 2's persist has begun: reported earlier, it would replace step 2
    # in the pending slot (by design) and step 2 would never be persisted.
    wait_until(torn_files, 10, "step 2's persist to pause mid-copy")
    keeper.on_checkpoint(0, 3, str(worker_save(keeper.folder, 3)))
    assert not keeper.wait_idle(0.2), "step 2 pauses mid-copy"
    torn = torn_files()
    assert len(torn) == 1 and torn[0].stat().st_size > 0, "a torn temp file is what a crash would leave"
    assert (tmp_path / "ckpt" / "latest").read_text() == "step_0000000001.pt"

    keeper.stop()

    assert [s for s, _ in layout.checkpoint_files(tmp_path / "ckpt")] == [3, 2, 1]
    assert (tmp_path / "ckpt" / "latest").read_text() == "step_0000000003.pt"
    assert not [p for p in (tmp_path / "ckpt").iterdir() if p.name.endswith(".tmp")]
    assert not keeper.folder.exists()


@pytest.mark.timeout(20)
def test_progress_channel_passes_checkpoint_reports_to_the_keeper(
    keeper: CheckpointKeeper, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from elastic.report import report_checkpoint

    seen = {7: threading.Event(), 8: threading.Event()}

    def on_checkpoint(local_rank: int, step: int, location: str, persist_to: str) -> None:
        keeper.on_checkpoint(local_rank, step, location, persist_to)
        seen[step].set()

    channel = ProgressChannel(on_checkpoint=on_checkpoint)
    try:
        channel.reset(1)
        monkeypatch.setenv("ELASTIC_AGENT_SOCKET", channel.path)
        monkeypatch.setenv("LOCAL_RANK", "0")
        report_checkpoint(7, str(worker_save(keeper.folder, 7)), str(tmp_path / "elsewhere"))
        report_checkpoint(8)  # no location: counts for the committed step, nothing to persist

        assert seen[7].wait(10) and seen[8].wait(10)
        assert keeper.wait_idle(10)
        assert keeper.persisted_step == 7
        assert (tmp_path / "elsewhere" / "latest").read_text() == "step_0000000007.pt", "the worker's folder"
        assert channel.checkpointed_step() == 8
    finally:
        channel.close()


@pytest.mark.timeout(60)
def test_agent_module_imports_no_torch() -> None:
    code = "import agent.checkpoints.keeper, agent.cli.main, sys; assert 'torch' not in sys.modules"
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
