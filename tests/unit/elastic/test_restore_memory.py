"""Restores copy a checkpoint's bytes once, into memory the restored tensors own
(elastic.checkpoint.hostmem, elastic.checkpoint.layout.map_shared, the flash parse)."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

import pytest
import torch

from elastic.checkpoint import flash, hostmem, layout
from elastic.checkpoint import replicated as checkpoint
from elastic.checkpoint.digest import CheckpointCorruptError

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _huge_kib_at(address: int) -> int:
    """AnonHugePages (KiB) of this process's mapping that contains ``address`` (/proc/self/smaps)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            low, high = (int(v, 16) for v in head.split("-"))
            inside = low <= address < high
        elif inside and head == "AnonHugePages:":
            return int(line.split()[1])
    return 0


@pytest.mark.timeout(60)
def test_fresh_restore_memory_is_faulted_in_huge_pages_and_owned_by_the_tensor() -> None:
    if not THP.exists() or "[never]" in THP.read_text():
        pytest.skip("this kernel has transparent huge pages off: hostmem.empty is a plain torch.empty")
    tensor = hostmem.empty(16 << 20)
    tensor.fill_(1)  # the first touch faults the pages in
    address = (tensor.data_ptr() + hostmem.HUGE_PAGE - 1) // hostmem.HUGE_PAGE * hostmem.HUGE_PAGE
    assert _huge_kib_at(address) >= 2048, "no huge page backs the advised allocation"
    tensor.resize_(32 << 20)  # an ordinary storage of torch's allocator: resizable, freed with the tensor
    assert tensor.numel() == 32 << 20


@pytest.mark.timeout(60)
def test_a_mapped_checkpoint_holds_the_shared_lock_until_its_context_ends(tmp_path: Path) -> None:
    path = tmp_path / layout.step_file_name(1)
    path.write_bytes(b"checkpoint bytes")
    with layout.map_shared(path) as mapped:
        assert bytes(mapped) == b"checkpoint bytes"
        # What a flash writer takes before it recycles a file.
        with open(path, "rb") as writer, pytest.raises(BlockingIOError):
            fcntl.flock(writer.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    with open(path, "rb") as writer:
        fcntl.flock(writer.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)  # released with the map


@pytest.mark.timeout(60)
def test_a_restore_from_memory_owns_its_tensors_when_the_next_saves_recycle_the_segment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ELASTIC_SHM_DIR", str(tmp_path))
    for name in ("ELASTIC_AGENT_SOCKET", "ELASTIC_CKPT_DIR", "ELASTIC_COMMITTED_STEP", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    state = {"w": torch.randn(1 << 20), "b": torch.arange(10), "nested": {"step": 4}}
    try:
        checkpoint.save(state, 4)
        loaded = checkpoint.load()
        assert loaded is not None and loaded[1] == 4
        restored = loaded[0]
        expected = {k: v.clone() for k, v in restored.items() if isinstance(v, torch.Tensor)}
        for step in (5, 6, 7):  # the double buffer: step 6 recycles step 4's segment
            checkpoint.save({"w": torch.zeros(1 << 20), "b": torch.zeros(10, dtype=torch.long)}, step)
        assert not (tmp_path / layout.step_file_name(4)).exists()
        for key, value in expected.items():
            assert torch.equal(restored[key], value), key
        assert torch.equal(restored["w"], state["w"]) and restored["nested"] == {"step": 4}
        restored["w"].untyped_storage().resize_(8)  # torch's own storage, not a view of a map
    finally:
        flash.close_all()
        for path in tmp_path.iterdir():
            os.unlink(path)


@pytest.mark.timeout(60)
def test_a_storage_read_straight_into_its_tensor_is_verified_before_the_restore_returns_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ELASTIC_SHM_DIR", str(tmp_path))
    for name in ("ELASTIC_AGENT_SOCKET", "ELASTIC_CKPT_DIR", "ELASTIC_COMMITTED_STEP", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    older, newer = {"w": torch.full((4096,), 1.0)}, {"w": torch.full((4096,), 2.0)}
    try:
        checkpoint.save(older, 1)
        checkpoint.save(newer, 2)
        flash.close_all()
        damaged = tmp_path / layout.step_file_name(2)
        with open(damaged, "r+b") as f:  # one flipped bit in the last storage's bytes
            f.seek(damaged.stat().st_size - flash.TRAILER_SIZE - 100)
            byte = f.read(1)[0]
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte ^ 1]))
        with open(damaged, "rb") as f, pytest.raises(CheckpointCorruptError):
            flash.read_flash_file(f)
        loaded = checkpoint.load()  # the damaged step is skipped (and reported), never restored
        assert loaded is not None and loaded[1] == 1
        assert torch.equal(loaded[0]["w"], older["w"])
    finally:
        flash.close_all()
        for path in tmp_path.iterdir():
            os.unlink(path)


@pytest.mark.timeout(60)
def test_a_load_before_any_group_and_any_committed_step_restores_the_newest_copy_only_for_elastic_run(
    flash_env: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker lost within a heartbeat of the first save is restarted before the master knows a committed
    step. Under an agent that offers in-process recovery, its script's early ``elastic.load`` (before
    ``elastic.run`` forms the group) takes this node's newest copy: ``elastic.run`` agrees with the live
    ranks next. Without that offer there is nothing to agree with, and it stays an error."""
    for step in (1, 2):
        checkpoint.save({"w": torch.full((4,), float(step))}, step)
    flash.wait_all()
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(checkpoint.CheckpointError, match="without a process group"):
        checkpoint.load()
    monkeypatch.setenv("ELASTIC_INPROCESS_SOCKET", str(flash_env / "inprocess.sock"))
    loaded = checkpoint.load()
    assert loaded is not None and loaded[1] == 2 and torch.equal(loaded[0]["w"], torch.full((4,), 2.0))


@pytest.mark.timeout(60)
def test_a_process_joining_live_ranks_starts_from_its_newest_copy_of_the_lineage(
    flash_env: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A spare taking a lost rank (or a process restarted beside ranks kept in process) under an agent that
    offers in-process recovery: its early ``elastic.load`` is only a starting point, and ``elastic.run``'s
    agreement takes the newest step any rank holds. It starts from this node's newest copy up to the
    committed step, or from one in this node's memory past it (the committed step trails the saves by a
    heartbeat; a restore drops memory of another lineage), or from nothing; it drops none of the newer
    memory copies (before, a restart that loaded the committed step deleted the steps saved after it, and
    a kept rank's older step won: 80 steps lost in a chaos run). Disk copies past the committed step are
    not used: the shared folder may hold a rolled-back run's."""
    disk = tmp_path / "disk"
    shm = os.environ["ELASTIC_SHM_DIR"]
    monkeypatch.delenv("ELASTIC_SHM_DIR")
    for step in (5, 6):
        checkpoint.save({"w": torch.full((4,), float(step))}, step, ckpt_dir=disk)
    monkeypatch.setenv("ELASTIC_SHM_DIR", shm)
    monkeypatch.setenv("ELASTIC_CKPT_DIR", str(disk))
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("ELASTIC_INPROCESS_SOCKET", str(flash_env / "inprocess.sock"))
    for step in (3, 4):
        checkpoint.save({"w": torch.full((4,), float(step))}, step, persist=False)
    flash.wait_all()
    monkeypatch.setenv("ELASTIC_COMMITTED_STEP", "9")  # the live ranks' step, not on this node
    loaded = checkpoint.load()
    assert loaded is not None and loaded[1] == 6, "the newest copy up to the committed step"
    monkeypatch.setenv("ELASTIC_COMMITTED_STEP", "2")  # older than any copy: memory past it, not disk
    loaded = checkpoint.load()
    assert loaded is not None and loaded[1] == 4 and torch.equal(loaded[0]["w"], torch.full((4,), 4.0))
    monkeypatch.setenv("ELASTIC_COMMITTED_STEP", "3")  # held here, and a newer memory copy
    loaded = checkpoint.load()
    assert loaded is not None and loaded[1] == 4
    assert sorted(s for s, _ in layout.checkpoint_files(Path(shm))) == [3, 4], "no memory copy dropped"
    monkeypatch.setenv("ELASTIC_COMMITTED_STEP", "5")
    loaded = checkpoint.load()
    assert loaded is not None and loaded[1] == 5, "a disk copy up to the committed step beats older memory"
    for step in (3, 4):
        (Path(shm) / layout.step_file_name(step)).unlink()
    monkeypatch.setenv("ELASTIC_COMMITTED_STEP", "2")
    assert checkpoint.load() is None, "nothing up to the committed step and nothing in memory"
    monkeypatch.delenv("ELASTIC_INPROCESS_SOCKET")
    monkeypatch.setenv("ELASTIC_COMMITTED_STEP", "9")  # no in-process offer: the committed step is required
    with pytest.raises(checkpoint.CheckpointError, match="step 9 is not loadable"):
        checkpoint.load()
