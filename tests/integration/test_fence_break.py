"""A checkpoint folder's fence lock held by a frozen writer (agent.checkpoints.fence): a node SIGSTOPped or
cut off in the middle of a commit keeps its ``flock`` for as long as it lives, and every other node of the job
could persist nothing more. A waiter breaks a lock held past ``break_after_s`` and commits; the frozen writer,
when it runs again, finds it lost the lock and publishes nothing."""

from __future__ import annotations

import fcntl
import os
import threading
from pathlib import Path

import pytest

from agent.checkpoints import fence
from elastic.checkpoint import layout

pytestmark = pytest.mark.timeout(30)


def temp_checkpoint(folder: Path, step: int) -> tuple[Path, Path]:
    final = folder / layout.step_file_name(step)
    return layout.write_temp(final, lambda f: f.write(b"state of step %d" % step)), final


def test_a_lock_held_past_the_break_time_is_broken_and_the_commit_goes_on(tmp_path: Path, caplog) -> None:
    frozen = os.open(tmp_path / fence.FENCE_FILE, os.O_RDWR | os.O_CREAT)  # a writer stopped mid-commit
    try:
        fcntl.flock(frozen, fcntl.LOCK_EX)
        with fence.fence_lock(tmp_path, timeout_s=20, cancel=threading.Event(), break_after_s=0.2) as fd:
            assert fence.still_holds(fd, tmp_path)
            assert not fence.still_holds(frozen, tmp_path), "the frozen writer lost the lock"
        assert "was held for over 0.2s" in caplog.text and "broke it" in caplog.text
        # The frozen writer runs again, just before it would publish: it gives its commit up.
        with pytest.raises(fence.FenceLostError, match="not published"):
            fence.check_still_holds(frozen, tmp_path)
    finally:
        os.close(frozen)
    assert sorted(p.name for p in tmp_path.iterdir()) == [fence.FENCE_FILE], "no temp file of the break left"


def test_a_commit_behind_a_frozen_writer_publishes_and_the_fence_keeps_its_content(tmp_path: Path) -> None:
    tmp, final = temp_checkpoint(tmp_path, 5)
    fence.commit(tmp_path, tmp, final, round_=2, step=5, keep=3, incarnation="inc-1")
    frozen = os.open(tmp_path / fence.FENCE_FILE, os.O_RDWR)
    try:
        fcntl.flock(frozen, fcntl.LOCK_EX)
        tmp, final = temp_checkpoint(tmp_path, 6)
        with fence.fence_lock(tmp_path, timeout_s=20, cancel=threading.Event(), break_after_s=0.2) as fd:
            assert fence.read_fence(fd) == fence.Fence(round=2, incarnation="inc-1"), "the copy keeps it"
        decision = fence.commit(tmp_path, tmp, final, round_=2, step=6, keep=3, incarnation="inc-1")
        assert decision.publish and decision.move_latest
        assert layout.read_marker(tmp_path) == final
    finally:
        os.close(frozen)


def test_a_lock_held_briefly_is_waited_for_not_broken(tmp_path: Path) -> None:
    holder = os.open(tmp_path / fence.FENCE_FILE, os.O_RDWR | os.O_CREAT)
    fcntl.flock(holder, fcntl.LOCK_EX)
    inode = os.fstat(holder).st_ino
    release = threading.Timer(0.3, os.close, (holder,))
    release.start()
    try:
        with fence.fence_lock(tmp_path, timeout_s=20, cancel=threading.Event(), break_after_s=15) as fd:
            assert os.fstat(fd).st_ino == inode, "the same fence file: nothing was broken"
    finally:
        release.join()
