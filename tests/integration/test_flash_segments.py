"""Reused shared-memory segments of flash saves (elastic/checkpoint/segments.py,
elastic/checkpoint/flash.py): the double buffer recycles the same inodes, a file under a reader is never
recycled, a killed save leaves nothing torn, space errors name the sizes, and device copies finish in the
background (a fake device).

Segments live in a real tmpfs folder under /dev/shm, removed at teardown with every mapping closed."""

from __future__ import annotations

import fcntl
import os
import shutil
import signal
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
import torch

from elastic.checkpoint import flash, layout, segments
from elastic.checkpoint.flash import AsyncSaveError, FlashWriter

REPO = Path(__file__).resolve().parents[2]
PLENTY = 1 << 40


@pytest.fixture
def shm() -> Iterator[Path]:
    folder = Path("/dev/shm") / f"elastic-test-segments-{uuid.uuid4().hex[:8]}"
    folder.mkdir(mode=0o700)
    try:
        yield folder
    finally:
        flash.close_all()
        shutil.rmtree(folder, ignore_errors=True)


def writer(folder: Path, free: int = PLENTY, copier: object = None) -> FlashWriter:
    return FlashWriter(folder, 2, lambda _: free, copier)  # type: ignore[arg-type]


def state(value: float, numel: int = 50_000) -> dict:
    return {"w": torch.full((numel,), value), "step_tensor": torch.tensor(value), "note": f"v{value}"}


def inodes(folder: Path) -> dict[str, int]:
    return {p.name: p.stat().st_ino for p in folder.iterdir()}


def load(path: Path) -> tuple[dict, int]:
    return flash.parse(layout.read_shared(path), "cpu")


@pytest.mark.timeout(30)
def test_the_double_buffer_recycles_the_same_two_inodes_after_the_first_save(shm: Path) -> None:
    w = writer(shm)
    committed: list[int] = []
    w.save(state(1), 1, lambda: committed.append(1))
    first = w.history[0]
    size = flash.plan(state(1)).size
    assert first.fresh_bytes >= 2 * size - 2 * 4096, "the first save faults its segment and the spare in"
    names = inodes(shm)
    assert len(names) == 2 and any(n.startswith(segments.SPARE_PREFIX) for n in names), names
    pair = set(names.values())
    for step in range(2, 7):
        w.save(state(step), step, lambda step=step: committed.append(step))
        assert set(inodes(shm).values()) == pair, "no new file: the two segments alternate"
        assert w.history[-1].fresh_bytes == 0 and w.history[-1].prefault_s == 0.0
    assert committed == [1, 2, 3, 4, 5, 6]
    assert [s for s, _ in layout.checkpoint_files(shm)] == [6, 5], "memory keeps the last two saves"
    loaded, step = load(shm / layout.step_file_name(6))
    assert step == 6 and torch.equal(loaded["w"], state(6)["w"]) and loaded["note"] == "v6"
    assert load(shm / layout.step_file_name(5))[0]["note"] == "v5", "the older copy is intact"

    # A new writer (a restarted worker) adopts the files in the folder: nothing new is allocated.
    w.close()
    again = writer(shm)
    again.save(state(7), 7, lambda: None)
    assert set(inodes(shm).values()) == pair and again.history[-1].fresh_bytes == 0


@pytest.mark.timeout(30)
def test_a_file_a_reader_holds_is_not_recycled_and_becomes_the_spare(shm: Path) -> None:
    w = writer(shm)
    for step in (1, 2):
        w.save(state(step), step, lambda: None)
    held_path = shm / layout.step_file_name(1)
    with layout.open_shared(held_path) as reader:  # what the agent's keeper holds while it persists
        held = os.fstat(reader.fileno()).st_ino
        w.save(state(3), 3, lambda: None)
        w.save(state(4), 4, lambda: None)
        assert held not in {p.stat().st_ino for _, p in layout.checkpoint_files(shm)}
        spares = [p for p in shm.iterdir() if p.name.startswith(segments.SPARE_PREFIX)]
        assert [p.stat().st_ino for p in spares] == [held], (
            "the surplus file under a reader is kept as the spare"
        )
        assert flash.parse(reader.read(), "cpu")[1] == 1, "the reader still reads step 1, unchanged"
    # Released: the next saves may take it again; never more than the double buffer and one spare.
    for step in (5, 6, 7):
        w.save(state(step), step, lambda: None)
    assert len(list(shm.iterdir())) <= 3
    assert [s for s, _ in layout.checkpoint_files(shm)] == [7, 6]


@pytest.mark.timeout(30)
def test_open_shared_refuses_a_file_that_is_being_or_was_recycled(
    shm: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    w = writer(shm)
    w.save(state(1), 1, lambda: None)
    path = shm / layout.step_file_name(1)
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a writer about to rename it away
        with pytest.raises(FileNotFoundError, match="recycled"):
            layout.open_shared(path)
    finally:
        os.close(fd)
    with layout.open_shared(path) as f:
        assert flash.parse(f.read(), "cpu")[1] == 1
    # Recycled between the reader's open and its lock: the name now names another file, never read.
    other = shm / "other"
    other.write_bytes(b"x")
    real_flock = fcntl.flock

    def recycle_then_lock(fd: int, operation: int) -> None:
        os.replace(other, path)
        real_flock(fd, operation)

    monkeypatch.setattr(fcntl, "flock", recycle_then_lock)
    with pytest.raises(FileNotFoundError, match="recycled"):
        layout.open_shared(path)
    monkeypatch.undo()


@pytest.mark.timeout(30)
def test_a_save_that_fails_midway_leaves_the_newest_checkpoint_and_no_temp_file(
    shm: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    w = writer(shm)
    for step in (1, 2):
        w.save(state(step), step, lambda: None)

    def broken(*args: object) -> None:
        raise OSError("disk on fire")

    monkeypatch.setattr(flash, "write_frame", broken)
    with pytest.raises(OSError, match="on fire"):
        w.save(state(3), 3, lambda: pytest.fail("a failed save must not be reported"))
    monkeypatch.undo()
    assert [s for s, _ in layout.checkpoint_files(shm)] == [2]
    assert not [p for p in shm.iterdir() if p.name.endswith(layout.TMP_SUFFIX)]
    assert load(shm / layout.step_file_name(2))[0]["note"] == "v2"
    w.save(state(3), 3, lambda: None)
    assert [s for s, _ in layout.checkpoint_files(shm)] == [3, 2]


_KILLED_CHILD = """
import sys, threading, torch
from pathlib import Path
from elastic.checkpoint.flash import FlashWriter

class Stuck:  # a device whose copies never finish: the save is killed while its file is a temp file
    def handles(self, device): return True
    def start(self, sources):
        class Pending:
            def wait(self): threading.Event().wait()
        return Pending()

w = FlashWriter(Path(sys.argv[1]), 2, lambda _: 1 << 40)
for step in (1, 2):
    w.save({"w": torch.full((50_000,), float(step))}, step, lambda: None)
w.copier = Stuck()
w.save({"w": torch.full((50_000,), 3.0)}, 3, lambda: None)
print("saving", flush=True)
threading.Event().wait()
"""


@pytest.mark.timeout(60)
def test_a_writer_killed_mid_save_leaves_only_whole_checkpoints_and_the_next_writer_goes_on(
    shm: Path,
) -> None:
    child = subprocess.Popen(
        [sys.executable, "-c", _KILLED_CHILD, str(shm)], cwd=REPO, stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout is not None and child.stdout.readline() == "saving\n"
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.kill()
        child.wait()
        child.stdout.close()  # type: ignore[union-attr]
    assert [s for s, _ in layout.checkpoint_files(shm)] == [2], "step 1's file was being overwritten: gone"
    temps = [p for p in shm.iterdir() if p.name.endswith(layout.TMP_SUFFIX)]
    assert len(temps) == 1 and layout.step_of(layout.parse_temp_name(temps[0].name).final) == 3
    assert torch.equal(load(shm / layout.step_file_name(2))[0]["w"], torch.full((50_000,), 2.0))
    layout.remove_temp_files(shm)  # what the agent's sweep does: its writer is dead
    assert not [p for p in shm.iterdir() if p.name.endswith(layout.TMP_SUFFIX)]
    w = writer(shm)
    w.save(state(3), 3, lambda: None)
    assert [s for s, _ in layout.checkpoint_files(shm)] == [3, 2]


@pytest.mark.timeout(30)
def test_too_little_space_is_a_no_space_error_and_the_spare_is_skipped_when_it_does_not_fit(
    shm: Path,
) -> None:
    size = flash.plan(state(1, numel=1 << 20)).size  # 4 MiB
    with pytest.raises(segments.NoSpaceError) as caught:
        writer(shm, free=size // 2).save(state(1, numel=1 << 20), 1, lambda: pytest.fail("not saved"))
    assert caught.value.need >= size and caught.value.free == size // 2
    assert list(shm.iterdir()) == [], "nothing left behind"
    flash.close_all()

    # A folder of room for one segment, not two: free space shrinks as the folder fills up.
    capacity = size + segments.HEADROOM_BYTES + 8192
    w = FlashWriter(shm, 2, lambda _: capacity - sum(p.stat().st_blocks * 512 for p in shm.iterdir()))
    w.save(state(1, numel=1 << 20), 1, lambda: None)
    assert [p.name for p in shm.iterdir()] == [layout.step_file_name(1)], "no spare without room for it"


class FakeDevice:
    """Stands in for a GPU: claims CPU storages, 'copies' them only when the test opens the gate."""

    def __init__(self, fail: bool = False) -> None:
        self.gate = threading.Event()
        self.started = 0
        self.fail = fail

    def handles(self, device: torch.device) -> bool:
        return device.type == "cpu"

    def start(self, sources: Sequence[torch.Tensor]) -> object:
        self.started += 1
        snapshot = [s.clone() for s in sources]  # a DMA reads the state as of the save call
        device = self

        class Pending:
            def wait(self) -> list[torch.Tensor]:
                device.gate.wait(20)
                if device.fail:
                    raise RuntimeError("device lost")
                return snapshot

        return Pending()


@pytest.mark.timeout(60)
def test_device_copies_finish_in_the_background_and_commit_then_report(shm: Path) -> None:
    device = FakeDevice()
    w = writer(shm, copier=device)
    committed = threading.Event()
    final = w.save(state(1), 1, committed.set)
    assert device.started == 1 and w.history[-1].asynchronous
    assert not final.exists() and not committed.is_set(), "returned before the device copies ended"

    second = threading.Thread(target=w.save, args=(state(2), 2, lambda: None))
    second.start()
    second.join(0.2)
    assert second.is_alive(), "a save waits for the previous one's background part"
    device.gate.set()
    second.join(20)
    assert not second.is_alive()
    w.wait()
    assert committed.is_set()
    for step in (1, 2):
        loaded, got = load(shm / layout.step_file_name(step))
        assert got == step and torch.equal(loaded["w"], state(step)["w"])


@pytest.mark.timeout(60)
def test_a_failed_background_copy_is_raised_by_the_next_save_and_publishes_nothing(shm: Path) -> None:
    device = FakeDevice(fail=True)
    w = writer(shm, copier=device)
    w.save(state(1), 1, lambda: pytest.fail("a failed save must not be reported"))
    device.gate.set()
    with pytest.raises(AsyncSaveError, match="device lost"):
        w.save(state(2), 2, lambda: None)
    assert layout.checkpoint_files(shm) == []
    assert not [p for p in shm.iterdir() if p.name.endswith(layout.TMP_SUFFIX)]
    device.fail = False
    w.save(state(2), 2, lambda: None)
    w.wait()
    assert [s for s, _ in layout.checkpoint_files(shm)] == [2]


@pytest.mark.timeout(30)
def test_a_rollback_recycles_the_abandoned_steps(shm: Path) -> None:
    w = writer(shm)
    for step in (5, 6):
        w.save(state(step), step, lambda: None)
    before = set(inodes(shm).values())
    w.save(state(3), 3, lambda: None)  # training resumed from step 3: 5 and 6 belong to the old run
    assert [s for s, _ in layout.checkpoint_files(shm)] == [3]
    assert set(inodes(shm).values()) <= before, "the abandoned files were reused, not reallocated"
