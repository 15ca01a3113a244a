"""The keeper persisting sharded memory saves to --ckpt-dir (agent/checkpoints/sharded_persist.py,
agent/checkpoints/keeper.py): each node's part into the save's data folder, the step committed by whoever
completes it, fenced by round, ``latest`` never backwards, bounded pruning, also with a folder per node (no
shared file system).

Saves are opaque bytes laid out as a sharded flash save leaves them in a node's shared memory."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from e2e import wait_until

from agent.checkpoints import fence as ckpt_fence
from agent.checkpoints import sharded_persist
from agent.checkpoints.keeper import CheckpointKeeper
from elastic.checkpoint import layout
from elastic.checkpoint import shard_layout as sl

NODES = {"A": ["__0_0.distcp", "__1_0.distcp"], "B": ["__2_0.distcp", "__3_0.distcp"]}


def memory_save(shm: Path, node: str, step: int, save_id: str) -> Path:
    """A node's committed sharded save in its memory folder: its ranks' data files, the global
    ``.metadata`` and a manifest naming every node's files."""
    root = shm / sl.SHARDED_SUBDIR
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / sl.tmp_dir_name(step, save_id)
    tmp.mkdir()
    files = {name: 100 + int(name[2]) for names in NODES.values() for name in names}
    for name in NODES[node]:
        (tmp / name).write_bytes(bytes([step % 256]) * files[name])
    (tmp / sl.METADATA).write_bytes(f"metadata of {step}".encode())
    sl.write_json(tmp / sl.MANIFEST, {"step": step, "save_id": save_id, "files": files})
    return sl.commit(root, tmp, step, save_id)


def copy(src, dst) -> None:
    while chunk := src.read(1 << 20):
        dst.write(chunk)


def persist(data: Path, root: Path, step: int, save_id: str, round_: int | None = 1, keep: int = 2):
    return sharded_persist.persist(
        data, root, step=step, save_id=save_id, round_=round_, keep=keep, copy=copy
    )


def sid(step: int, round_: int = 1) -> str:
    return f"{round_:08x}{step:08x}"


@pytest.mark.timeout(30)
def test_the_node_that_completes_a_step_on_a_shared_folder_commits_it(tmp_path: Path) -> None:
    disk = tmp_path / "ckpt" / sl.SHARDED_SUBDIR
    a = memory_save(tmp_path / "shmA", "A", 7, sid(7))
    b = memory_save(tmp_path / "shmB", "B", 7, sid(7))

    first = persist(a, disk, 7, sid(7))
    assert first.published and not first.committed
    assert sl.committed(disk) == [] and sl.latest_step(disk) is None, "half a step is never committed"
    second = persist(b, disk, 7, sid(7))
    assert second.published and second.committed
    (step, save_id, data), *_ = sl.committed(disk)
    assert (step, save_id, sl.latest_step(disk)) == (7, sid(7), 7)
    assert sorted(p.name for p in data.iterdir()) == sorted(
        [sl.METADATA, sl.MANIFEST, *NODES["A"], *NODES["B"]]
    )
    assert sl.complete_on_disk(data)
    assert not [p for p in data.iterdir() if p.name.endswith(".tmp")]


@pytest.mark.timeout(30)
def test_a_deposed_round_never_publishes_nor_moves_latest_back(tmp_path: Path) -> None:
    disk = tmp_path / "ckpt" / sl.SHARDED_SUBDIR
    for node in "AB":
        persist(memory_save(tmp_path / f"shm{node}", node, 10, sid(10, 3)), disk, 10, sid(10, 3), round_=3)
    assert sl.latest_step(disk) == 10

    # A slow writer of round 2 (a restart since superseded it) finishes step 12: nothing of it appears.
    late = memory_save(tmp_path / "old", "A", 12, sid(12, 2))
    outcome = persist(late, disk, 12, sid(12, 2), round_=2)
    assert not outcome.published and "superseded by round 3" in outcome.why
    assert [s for s, _, _ in sl.data_folders(disk)] == [12, 10]
    assert not [p for p in (disk / sl.data_dir_name(12, sid(12, 2))).iterdir()], "its temp files are gone"
    assert sl.latest_step(disk) == 10

    # The same round committing an older step (a rollback): kept, but latest stays on the newer step.
    for node in "AB":
        persist(memory_save(tmp_path / f"re{node}", node, 8, sid(8, 3)), disk, 8, sid(8, 3), round_=3)
    assert sl.latest_step(disk) == 10
    assert [s for s, _, _ in sl.committed(disk)] == [10, 8], "nothing newer pruned by the older commit"


@pytest.mark.timeout(30)
def test_with_a_folder_per_node_each_keeps_its_newest_parts_only(tmp_path: Path) -> None:
    disk = tmp_path / "ckptA" / sl.SHARDED_SUBDIR  # node A's own disk: B's files never arrive
    shm = tmp_path / "shmA"
    for step in range(1, 6):
        outcome = persist(memory_save(shm, "A", step, sid(step)), disk, step, sid(step), keep=2)
        assert outcome.published and not outcome.committed
        sl.prune(shm / sl.SHARDED_SUBDIR, 2)
    assert [s for s, _, _ in sl.data_folders(disk)] == [5, 4], "parts are pruned to --ckpt-keep"
    assert sl.committed(disk) == []
    files = sorted(p.name for p in (disk / sl.data_dir_name(5, sid(5))).iterdir())
    assert files == sorted([sl.METADATA, sl.MANIFEST, *NODES["A"]])


@pytest.mark.timeout(30)
def test_pruning_keeps_the_newest_complete_step_behind_newer_parts(tmp_path: Path) -> None:
    disk = tmp_path / "ckpt" / sl.SHARDED_SUBDIR
    for node in "AB":
        persist(memory_save(tmp_path / f"shm{node}", node, 3, sid(3)), disk, 3, sid(3))
    # Later steps reach the disk from node A only (B's persists are slow): 3 stays, the only whole one.
    for step in (4, 5, 6):
        persist(memory_save(tmp_path / f"a{step}", "A", step, sid(step)), disk, step, sid(step))
    assert [s for s, _, _ in sl.data_folders(disk)] == [6, 5, 3]
    assert [s for s, _, _ in sl.committed(disk)] == [3] and sl.latest_step(disk) == 3


@pytest.mark.timeout(30)
def test_a_fence_held_too_long_is_an_error(tmp_path: Path) -> None:
    disk = tmp_path / "ckpt" / sl.SHARDED_SUBDIR
    disk.mkdir(parents=True)
    data = memory_save(tmp_path / "shmA", "A", 2, sid(2))
    fd = os.open(disk / ckpt_fence.FENCE_FILE, os.O_RDWR | os.O_CREAT)
    try:
        import fcntl

        fcntl.flock(fd, fcntl.LOCK_EX)
        with pytest.raises(ckpt_fence.FenceLockTimeoutError):
            sharded_persist.persist(
                data, disk, step=2, save_id=sid(2), round_=1, keep=2, copy=copy, lock_timeout_s=0.2
            )
    finally:
        os.close(fd)
    assert not [p for p in (disk / sl.data_dir_name(2, sid(2))).iterdir()], "no temp file left"


@pytest.mark.timeout(30)
def test_the_keeper_persists_reported_sharded_saves_and_flushes_the_newest_at_stop(tmp_path: Path) -> None:
    root = tmp_path / "shm"
    root.mkdir()
    ckpt = tmp_path / "ckpt"
    keeper = CheckpointKeeper("job1", "node-a", ckpt_dir=ckpt, keep=2, root=root).start()
    try:
        memory = keeper.folder / sl.SHARDED_SUBDIR
        # A world of one node: the manifest names this node's files only.
        NODES_ONE = {"__0_0.distcp": 5}
        memory.mkdir()
        for step in (1, 2):
            tmp = memory / sl.tmp_dir_name(step, sid(step))
            tmp.mkdir()
            (tmp / "__0_0.distcp").write_bytes(b"x" * 5)
            (tmp / sl.METADATA).write_bytes(b"m")
            sl.write_json(tmp / sl.MANIFEST, {"files": NODES_ONE})
            sl.commit(memory, tmp, step, sid(step))
        keeper.on_checkpoint(0, 1, str(memory / sl.step_link_name(1)), round_number=1)
        wait_until(lambda: keeper.persist_status() == (1, ""), 20, "step 1 persisted")
        disk = ckpt / sl.SHARDED_SUBDIR
        assert sl.latest_step(disk) == 1 and sl.complete_on_disk(sl.committed(disk)[0][2])
        # Step 2 was saved but its report was lost (its worker died): the stop persists it.
    finally:
        keeper.stop()
    assert sl.latest_step(ckpt / sl.SHARDED_SUBDIR) == 2
    assert keeper.persisted_step == 2
    assert not layout.checkpoint_files(ckpt)
