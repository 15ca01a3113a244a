"""A peer's shard file received straight into the state's tensors (elastic.checkpoint.shard_restore): how
the file is cut into messages, where each tensor record's bytes lie, and which records may skip the copy.
The transfer itself runs between real processes in tests/integration/test_flash_digest_sharded.py."""

from __future__ import annotations

import mmap
import pickle
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader

from elastic.checkpoint.dcp_io import RecordBytes, record_layout
from elastic.checkpoint.shard_restore import DamagedShardsError, Deferred, _direct_target, chunks

CPU = torch.device("cpu")


def test_a_file_is_cut_at_the_large_plain_records_and_sent_whole_around_them() -> None:
    layout = [
        RecordBytes(record=0, start=100, nbytes=1000, plain=True),
        RecordBytes(record=1200, start=1300, nbytes=10, plain=True),  # too small: travels with the rest
        RecordBytes(record=1400, start=1500, nbytes=2000, plain=False),  # strided: copied as DCP does
        RecordBytes(record=3600, start=3700, nbytes=500, plain=True),
    ]
    assert chunks(4300, layout, min_direct=100) == [
        (0, 100, -1),
        (100, 1100, 0),
        (1100, 3700, -1),
        (3700, 4200, 3),
        (4200, 4300, -1),
    ]
    # Every byte travels exactly once, in file order.
    cut = chunks(4300, layout, min_direct=100)
    assert [c[0] for c in cut[1:]] == [c[1] for c in cut[:-1]] and cut[0][0] == 0 and cut[-1][1] == 4300
    assert chunks(4300, layout, min_direct=10_000) == [(0, 4300, -1)]
    assert chunks(1100, layout[:1], min_direct=100) == [(0, 100, -1), (100, 1100, 0)], "no empty message"


def _saved(tmp_path: Path, state: dict) -> tuple[Path, object]:
    folder = tmp_path / "ckpt"
    dcp.save(state, checkpoint_id=folder, no_dist=True)
    return folder, FileSystemReader(folder).read_metadata()


def _layout(folder: Path, metadata) -> tuple[dict[int, RecordBytes], mmap.mmap]:
    name = "__0_0.distcp"
    records = sorted(
        {(i.offset, i.length) for i in metadata.storage_data.values() if i.relative_path == name}
    )
    with open(folder / name, "rb") as f:
        mapped = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
    return {r.record: r for r in record_layout(mapped, records)}, mapped


@pytest.mark.timeout(60)
def test_the_layout_names_where_each_tensor_records_bytes_lie(tmp_path: Path) -> None:
    state = {"w": torch.randn(256, 128), "t": torch.randn(64, 32).t(), "extra": {"step": 3}}
    folder, metadata = _saved(tmp_path, state)
    layout, mapped = _layout(folder, metadata)
    by_key = {idx.fqn: metadata.storage_data[idx] for idx in metadata.storage_data}
    w = layout[by_key["w"].offset]
    assert w.plain and w.nbytes == 256 * 128 * 4
    assert bytes(mapped[w.start : w.start + w.nbytes]) == state["w"].numpy().tobytes()
    assert not layout[by_key["t"].offset].plain, "a transposed tensor's storage is not its elements in order"
    assert by_key["extra.step"].offset not in layout, "a pickled object is not a tensor record"
    mapped.close()


@pytest.mark.timeout(60)
def test_only_a_contiguous_tensor_of_the_records_dtype_and_shape_receives_its_bytes_directly(
    tmp_path: Path,
) -> None:
    folder, metadata = _saved(tmp_path, {"w": torch.randn(256, 128)})
    layout, mapped = _layout(folder, metadata)

    def target_for(value: torch.Tensor) -> torch.Tensor | None:
        planner = DefaultLoadPlanner()
        planner.set_up_planner({"w": value}, metadata, is_coordinator=True)
        (item,) = planner.create_local_plan().items
        rec = layout[metadata.storage_data[item.storage_index].offset]
        return _direct_target(item, rec, metadata, planner, CPU)

    plain = torch.zeros(256, 128)
    found = target_for(plain)
    assert found is not None and found.data_ptr() == plain.data_ptr(), "the state's own memory"
    assert target_for(torch.zeros(128, 256).t()) is None, "a strided tensor: the bytes are copied"
    assert target_for(torch.zeros(256, 128, dtype=torch.float64)) is None, "DCP converts the dtype"
    mapped.close()


def test_a_damage_found_while_loading_reaches_every_rank_intact() -> None:
    # Raised inside DCP's read on one rank, it reaches the others pickled (torch's CheckpointException).
    found = DamagedShardsError(3, {Path("/shm/a/__0_0.distcp"): "digest differs"}, [(1, "__1_0.distcp", "x")])
    back = pickle.loads(pickle.dumps(found))
    assert (back.step, back.bad, back.remote) == (3, found.bad, found.remote)
    assert "digest differs" in str(back) and "x" in str(back)


def test_a_damaged_file_is_left_out_on_the_node_that_holds_it_only() -> None:
    # Ranks 0 and 1 on one node, rank 2 on another; nodes may use the same shared-memory path.
    same_path = Path("/dev/shm/elastic/sharded/step_3/__0_0.distcp")
    sent = Path("/dev/shm/elastic/replicas/n2/sharded/step_3/__2_0.distcp")
    deferred = Deferred([], 0, {}, {"__2_0.distcp": sent}, 3, [7, 7, 9])
    assert deferred.damaged({2: DamagedShardsError(3, {same_path: "bad"})}) == set(), "another node's file"
    assert deferred.damaged({1: DamagedShardsError(3, {same_path: "bad"})}) == {same_path}, "this node's"
    # Rank 2 received __2_0 from rank 1 (this node) and its bytes failed: this node's copy is left out.
    assert deferred.damaged({2: DamagedShardsError(3, {}, [(1, "__2_0.distcp", "differs")])}) == {sent}
    assert deferred.damaged({0: DamagedShardsError(3, {}, [(2, "__2_0.distcp", "differs")])}) == set()
