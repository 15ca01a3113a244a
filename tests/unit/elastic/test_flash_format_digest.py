"""The digest of flash checkpoints (elastic/checkpoint/digest.py, flash.py): computed during the save's
copy, recorded in the file, checked before a restore builds a tensor; a damaged copy is skipped, reported
to the agent and never loaded; version-1 files (no digest) still load. Real files, a real progress socket."""

from __future__ import annotations

import json
import struct
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
import torch

from agent.checkpoints import persist
from agent.observe.channel import ProgressChannel
from elastic.checkpoint import digest, flash, layout
from elastic.checkpoint import replicated as checkpoint
from elastic.checkpoint.digest import CheckpointCorruptError

STATE = {"w": torch.arange(1000, dtype=torch.float32), "b": torch.ones(3, dtype=torch.int64), "lr": 0.1}


def saved(state: dict, step: int = 7) -> tuple[bytes, flash.Plan]:
    """A flash file's bytes as a save writes them (host path: hashed slot by slot after each copy)."""
    plan = flash.plan(state)
    buffer = bytearray(b"\xa5" * plan.size)  # a recycled segment's stale bytes: the gaps must be zeroed
    flash.write_frame(buffer, plan, step, flash.new_content_id())
    hasher = flash.frame_hasher(buffer, plan)
    for slot in plan.storages:
        if slot.nbytes:
            torch.frombuffer(buffer, dtype=torch.uint8, count=slot.nbytes, offset=slot.offset).copy_(
                slot.source
            )
            flash.hash_slot(hasher, buffer, slot)
    flash.write_digest(buffer, hasher.digest())
    return bytes(buffer), plan


def flipped(data: bytes, offset: int) -> bytes:
    out = bytearray(data)
    out[offset] ^= 0x01
    return bytes(out)


def test_a_flipped_byte_in_a_storage_the_json_or_the_header_is_detected() -> None:
    data, plan = saved(STATE)
    assert flash.parse(data)[1] == 7
    storage = plan.storages[0].offset + 17
    meta = flash.HEADER.size + 5
    places = {
        "a storage's byte": storage,
        "the JSON description": meta,
        "the header's step": 16,
        "the header's reserved field": 12,
        "the digest itself": flash.HEADER.size - 1,
    }
    for why, offset in places.items():
        with pytest.raises(CheckpointCorruptError, match="do not match its digest"):
            flash.parse(flipped(data, offset))
            pytest.fail(f"accepted a flipped byte in {why}")
    # Torn frames stay what they were: ValueErrors (a CheckpointCorruptError is one too).
    with pytest.raises(ValueError, match="trailer"):
        flash.parse(flipped(data, len(data) - 1))


def test_the_digest_names_the_content_not_the_save_and_gaps_are_zeroed() -> None:
    one, _ = saved(STATE)
    two, _ = saved(STATE)
    assert one[48:64] != two[48:64], "two saves: two content ids"
    assert digest.read_header(one, len(one)).digest == digest.read_header(two, len(two)).digest
    other, _ = saved({**STATE, "lr": 0.2})
    assert digest.read_header(other, len(other)).digest != digest.read_header(one, len(one)).digest


class _CpuAsDevice:
    """Claims CPU storages as a device's: the save takes the device path (copies finished, hashed and
    committed by the background thread)."""

    def handles(self, device: torch.device) -> bool:
        return device.type == "cpu"

    def start(self, sources: Sequence[torch.Tensor]) -> flash.PendingCopy:
        return flash._Done([s.clone() for s in sources])


def test_the_host_and_the_device_path_record_the_same_digest_and_digest_of_reads_it(tmp_path: Path) -> None:
    paths = []
    for name, copier in (("host", None), ("device", _CpuAsDevice())):
        folder = tmp_path / name
        folder.mkdir()
        writer = flash.FlashWriter(folder, 2, lambda _: 1 << 40, copier=copier)
        try:
            committed = threading.Event()
            paths.append(writer.save(STATE, 3, committed.set))
            writer.wait()
            assert committed.is_set()
        finally:
            writer.close()
    recorded = [checkpoint_digest(p) for p in paths]
    assert recorded[0] == recorded[1] and recorded[0].startswith("xxh3_128:")
    assert digest.verify_file(paths[1]) == recorded[1]
    data = paths[1].read_bytes()
    assert digest.text(digest.frame_digest(data, digest.read_header(data, len(data)))) == recorded[1]


def checkpoint_digest(path: Path) -> str:
    from elastic import checkpoint as api  # the public helper, importable without torch

    found = api.digest_of(path)
    assert found is not None
    return found


def v1_file(state: dict, step: int = 5) -> bytes:
    """A version-1 file (64-byte header, no digest), as earlier versions wrote it."""
    plan = flash.plan(state)
    meta = plan.meta
    offset = flash._align(digest.HEADER_V1.size + len(meta), flash.DATA_ALIGN)
    shift = offset - plan.data_offset
    size = plan.size + shift
    ident = b"v" * 16
    out = bytearray(size)
    out[: digest.HEADER_V1.size] = digest.HEADER_V1.pack(
        flash.MAGIC, 1, 0, step, size, len(meta), offset, ident
    )
    out[digest.HEADER_V1.size : digest.HEADER_V1.size + len(meta)] = meta
    for slot in plan.storages:
        start = slot.offset + shift
        out[start : start + slot.nbytes] = bytes(slot.source.numpy().tobytes())
    out[size - 16 :] = ident
    return bytes(out)


def test_a_version_1_file_still_loads_unverified(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    data = v1_file(STATE)
    state, step = flash.parse(data)
    assert step == 5 and torch.equal(state["w"], STATE["w"]) and state["lr"] == 0.1
    path = tmp_path / layout.step_file_name(5)
    path.write_bytes(data)
    assert digest.digest_of(path) is None
    assert digest.verify_file(path) is None
    assert flash.parse(flipped(data, 5000))[1] == 5, "no digest: a damaged v1 file is not detected"
    # The agent converts it to torch's format as before.
    with path.open("rb") as src:
        frame = persist.torch_format.read_frame(src)
    assert frame.step == 5


def test_the_agent_verifies_a_file_before_persisting_it_and_persists_nothing_damaged(tmp_path: Path) -> None:
    memory, disk = tmp_path / "shm", tmp_path / "disk"
    memory.mkdir()
    data, plan = saved(STATE, step=4)
    path = memory / layout.step_file_name(4)
    path.write_bytes(flipped(data, plan.storages[0].offset))
    request = persist.Request(4, path, disk, None)
    with pytest.raises(CheckpointCorruptError, match=str(path)):
        persist.persist(
            request, keep=2, copy=lambda s, d: persist.copy(s, d, lambda: None), lock_timeout_s=5,
            cancel=threading.Event(),
        )  # fmt: skip
    assert not disk.exists() or not list(disk.iterdir()), "nothing written"
    path.write_bytes(data)
    outcome = persist.persist(
        request, keep=2, copy=lambda s, d: persist.copy(s, d, lambda: None), lock_timeout_s=5,
        cancel=threading.Event(),
    )  # fmt: skip
    assert outcome.committed
    loaded = torch.load(disk / path.name, weights_only=True)
    assert loaded["step"] == 4 and torch.equal(loaded["state"]["w"], STATE["w"])


@pytest.fixture
def agent_channel(
    flash_env: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[Path, list, threading.Event]]:
    """The worker's environment with a real agent progress channel; yields the shared-memory folder,
    the corruption reports the channel passed on, and an event set at the first."""
    reports: list[tuple] = []
    got = threading.Event()

    def on_checkpoint(rank: int, step: int, location: str, persist_to: str = "", **kw: object) -> None:
        if kw.get("corrupt"):
            reports.append((rank, step, location))
            got.set()

    channel = ProgressChannel(on_checkpoint=on_checkpoint)
    channel.reset(1)
    monkeypatch.setenv("ELASTIC_AGENT_SOCKET", channel.path)
    try:
        yield flash_env, reports, got
    finally:
        channel.close()


def test_a_damaged_newest_copy_is_skipped_reported_and_the_older_step_restored(agent_channel) -> None:
    shm, reports, got = agent_channel
    for step in (1, 2):
        checkpoint.save({"w": torch.full((64,), float(step))}, step, persist=False)
    flash.wait_all()
    newest = shm / layout.step_file_name(2)
    with newest.open("r+b") as f:  # one bit flips in memory after the save
        data = f.read()
        header = digest.read_header(data, len(data))
        f.seek(header.data_offset + 3)
        f.write(bytes([data[header.data_offset + 3] ^ 0x10]))
    state, step = checkpoint.load()
    assert step == 1 and torch.equal(state["w"], torch.full((64,), 1.0)), "never the damaged bytes"
    assert got.wait(10), "the agent heard of it"
    assert reports == [(0, 2, str(newest))]


def test_an_exact_step_whose_only_copy_is_damaged_is_an_error_naming_file_and_mismatch(
    flash_env: Path,
) -> None:
    checkpoint.save({"w": torch.ones(8)}, 3, persist=False)
    flash.wait_all()
    path = flash_env / layout.step_file_name(3)
    data = path.read_bytes()
    path.write_bytes(flipped(data, len(data) - 20))
    with pytest.raises(checkpoint.CheckpointError) as raised:
        checkpoint.load(step=3)
    text = str(raised.value)
    assert str(path) in text and "do not match its digest" in text and "xxh3_128:" in text


def test_load_latest_falls_back_from_a_damaged_disk_file_to_the_next(tmp_path: Path) -> None:
    folder = tmp_path / "disk"
    folder.mkdir()
    for step in (1, 2):
        data, _ = saved({"v": torch.full((4,), float(step))}, step)
        (folder / layout.step_file_name(step)).write_bytes(data if step == 1 else flipped(data, 100))
    state, step = checkpoint.load_latest(folder)
    assert step == 1 and state["v"].tolist() == [1.0] * 4


def test_the_header_layout_is_the_documented_one() -> None:
    data, plan = saved(STATE)
    magic, version, _, step, size, meta, offset, _, recorded = struct.unpack_from("<8sIIQQQQ16s16s", data)
    assert (magic, version, step, size, offset) == (flash.MAGIC, 2, 7, len(data), plan.data_offset)
    assert json.loads(data[80 : 80 + meta])["storages"]
    assert recorded == digest.frame_digest(data, digest.read_header(data, len(data)))
