"""A persist is never dropped silently, keeper level, with real files: a superseded persist is
an error (reported, counted), the newest checkpoint that did not reach the disk keeps the memory folder,
a short disk is made room on by pruning older checkpoints, and ``--ckpt-dir`` is checked at start."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agent.checkpoints import persist as ckpt_persist
from agent.checkpoints.fence import FENCE_FILE
from agent.checkpoints.keeper import CheckpointKeeper
from agent.checkpoints.shm_folder import remove_stale
from elastic.checkpoint import layout

OLD, NEW = "0000000000000001-aaaaaaaa", "0000000000000002-bbbbbbbb"


def worker_save(folder: Path, step: int) -> Path:
    path = folder / layout.step_file_name(step)
    layout.atomic_write(path, lambda f: f.write(f"state of step {step}".encode()), durable=False)
    return path


@pytest.fixture
def root(tmp_path: Path) -> Path:
    folder = tmp_path / "shm"
    folder.mkdir()
    return folder


def keeper_of(root: Path, ckpt: Path, incarnation: str, node: str = "n1") -> CheckpointKeeper:
    keeper = CheckpointKeeper("job1", node, ckpt_dir=ckpt, root=root).start()
    keeper.incarnation = incarnation
    return keeper


@pytest.mark.timeout(30)
def test_a_resubmission_persists_over_an_earlier_submissions_higher_round(root: Path, tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    first = keeper_of(root, ckpt, OLD)
    first.on_checkpoint(0, 40, str(worker_save(first.folder, 40)), round_number=2)
    assert first.wait_idle(10)
    first.stop()

    second = keeper_of(root, ckpt, NEW)  # the job submitted again: round 1
    second.on_checkpoint(0, 41, str(worker_save(second.folder, 41)), round_number=1)
    assert second.wait_idle(10)
    assert second.persist_status() == (41, "")
    second.stop()
    assert second.kept is None and not second.folder.exists()
    assert (ckpt / layout.LATEST_MARKER).read_text() == layout.step_file_name(41)
    assert json.loads((ckpt / FENCE_FILE).read_text()) == {"round": 1, "incarnation": NEW}


@pytest.mark.timeout(30)
def test_a_superseded_persist_is_reported_counted_and_keeps_the_memory_copy(
    root: Path, tmp_path: Path
) -> None:
    ckpt = tmp_path / "ckpt"
    newer = keeper_of(root, ckpt, NEW, "n2")
    newer.on_checkpoint(0, 5, str(worker_save(newer.folder, 5)), round_number=1)
    assert newer.wait_idle(10)
    newer.stop()

    older = keeper_of(root, ckpt, OLD)  # a writer of the earlier submission, still alive
    older.on_checkpoint(0, 9, str(worker_save(older.folder, 9)), round_number=3)
    assert older.wait_idle(10)
    step, error = older.persist_status()
    assert step is None and "step 9" in error and "superseded by a newer submission" in error
    assert older.outcomes == {"persisted": 0, "skipped": 0, "superseded": 1, "failed": 0}
    older.stop()
    assert [r.step for r in older.unpersisted] == [9]
    assert older.kept is not None and (older.kept / layout.step_file_name(9)).is_file()
    assert not older.folder.exists()
    remove_stale(root, root / "another")  # a later agent's start leaves the kept copy alone
    assert (older.kept / layout.step_file_name(9)).is_file()
    assert (ckpt / layout.LATEST_MARKER).read_text() == layout.step_file_name(5)


@pytest.mark.timeout(30)
def test_a_persist_superseded_by_a_newer_round_of_the_same_submission_keeps_nothing(
    root: Path, tmp_path: Path
) -> None:
    """A node preempted after its peers went on (a newer round committed): its last persist is refused,
    counted and reported, but it is no loss (the newer round resumed from its step or a newer one), so the
    memory folder is not kept and the agent does not exit 1 (a chaos run's preemption did both)."""
    ckpt = tmp_path / "ckpt"
    peer = keeper_of(root, ckpt, NEW, "n2")
    peer.on_checkpoint(0, 12, str(worker_save(peer.folder, 12)), round_number=4)
    assert peer.wait_idle(10)
    peer.stop()

    left = keeper_of(root, ckpt, NEW)  # the same submission, an older round
    left.on_checkpoint(0, 11, str(worker_save(left.folder, 11)), round_number=3)
    assert left.wait_idle(10)
    step, error = left.persist_status()
    assert step is None and "round 3 was superseded by round 4" in error
    assert left.outcomes["superseded"] == 1
    left.stop()
    assert left.unpersisted == [] and left.kept is None and not left.folder.exists()


def test_make_room_prunes_checkpoints_older_than_the_newest_complete_one(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    for step in (1, 2, 3, 4):
        worker_save(ckpt, step)
    layout.write_marker(ckpt, ckpt / layout.step_file_name(3))
    assert ckpt_persist.make_room(ckpt, "test") > 0
    assert [s for s, _ in layout.checkpoint_files(ckpt)] == [4, 3], "the newest complete one and newer stay"
    assert ckpt_persist.make_room(ckpt, "test") == 0


def test_check_folder_names_what_is_wrong_in_one_line(tmp_path: Path) -> None:
    assert ckpt_persist.check_folder(tmp_path / "new" / "ckpt") == ""
    assert (tmp_path / "new" / "ckpt").is_dir() and list((tmp_path / "new" / "ckpt").iterdir()) == []
    blocker = tmp_path / "file"
    blocker.write_text("")
    problem = ckpt_persist.check_folder(blocker / "ckpt")
    assert problem.startswith("cannot create") and "\n" not in problem
    assert ckpt_persist.check_folder(blocker) == f"{blocker} is not a folder"
