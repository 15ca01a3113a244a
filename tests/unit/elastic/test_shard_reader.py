"""The mapped DCP reader (elastic.checkpoint.dcp_io): restores read tensors straight from the mapped
files."""

from __future__ import annotations

import io
import mmap
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from elastic.checkpoint.dcp_io import MappedReader, record_tensor


def _mapped_record(tmp_path: Path, value: object, offset: int) -> tuple[mmap.mmap, memoryview, int]:
    """A file with ``torch.save(value)`` at ``offset`` (as DCP packs records), mapped read-only."""
    buffer = io.BytesIO()
    torch.save(value, buffer)
    record = buffer.getvalue()
    path = tmp_path / "__0_0.distcp"
    path.write_bytes(b"x" * offset + record + b"tail")
    with open(path, "rb") as f:
        mapped = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
    return mapped, memoryview(mapped)[offset : offset + len(record)], offset


@pytest.mark.timeout(60)
def test_record_tensor_is_a_view_of_the_mapping_not_a_copy(tmp_path: Path) -> None:
    value = torch.randn(64, 33).t()  # a non-contiguous layout survives
    mapped, record, offset = _mapped_record(tmp_path, value, offset=123)
    tensor = record_tensor(record, offset, mapped)
    assert tensor is not None
    assert torch.equal(tensor, value)
    assert tensor.stride() == value.stride()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        start = torch.frombuffer(mapped, dtype=torch.uint8).data_ptr()
    assert start <= tensor.untyped_storage().data_ptr() < start + len(mapped)
    del tensor, record


@pytest.mark.timeout(60)
def test_record_tensor_declines_a_record_of_several_storages(tmp_path: Path) -> None:
    mapped, record, offset = _mapped_record(tmp_path, {"a": torch.ones(3), "b": torch.zeros(2)}, offset=7)
    assert record_tensor(record, offset, mapped) is None
    del record


@pytest.mark.timeout(120)
def test_dcp_load_through_the_mapped_reader_restores_every_value(tmp_path: Path) -> None:
    saved = {
        "w": torch.randn(300, 17),
        "half": torch.randn(5, 5).half(),
        "ids": torch.arange(11),
        "empty": torch.empty(0),
        "extra": {"step": 7, "name": "run"},
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # no process group: DCP says it runs alone
        dcp.save(saved, checkpoint_id=tmp_path, no_dist=True)
        target = {
            "w": torch.zeros(300, 17),
            "half": torch.zeros(5, 5).half(),
            "ids": torch.zeros(11, dtype=torch.long),
            "empty": torch.empty(0),
            "extra": {"step": 0, "name": ""},
        }
        dcp.load(target, storage_reader=MappedReader(tmp_path), no_dist=True)
    for key in ("w", "half", "ids", "empty"):
        assert torch.equal(target[key], saved[key]), key
    assert target["extra"] == {"step": 7, "name": "run"}


@pytest.mark.timeout(120)
def test_the_mapped_reader_reads_a_file_received_into_memory_and_absent_from_the_folder(
    tmp_path: Path,
) -> None:
    # A restore receives a peer's shard file into this process's memory (shard_restore.recv_memory): the
    # reader copies from that map; the folder holds only the metadata.
    saved = {"w": torch.randn(257, 9), "ids": torch.arange(13), "extra": {"step": 3}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # no process group: DCP says it runs alone
        dcp.save(saved, checkpoint_id=tmp_path, no_dist=True)
    in_memory = {}
    for path in sorted(tmp_path.glob("*.distcp")):
        data = path.read_bytes()
        mapped = mmap.mmap(-1, len(data))
        mapped[:] = data
        in_memory[path.name] = mapped
        path.unlink()  # only the memory copy is left
    target = {"w": torch.zeros(257, 9), "ids": torch.zeros(13, dtype=torch.long), "extra": {"step": 0}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(target, storage_reader=MappedReader(tmp_path, in_memory), no_dist=True)
    assert torch.equal(target["w"], saved["w"]) and torch.equal(target["ids"], saved["ids"])
    assert target["extra"] == {"step": 3}
    assert not list(tmp_path.glob("*.distcp")), "nothing was written back into the folder"
    for mapped in in_memory.values():
        mapped.close()  # no tensor views it: the restored values are copies
