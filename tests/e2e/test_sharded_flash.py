"""Sharded flash checkpoints (elastic.save_sharded under an agent's shared memory) and their restore from
whatever the job holds: a node's own memory, the replicas it keeps for a peer (hash-checked), the disk.

Real worker processes on gloo (tests/support/ckpt_worker.py); two fake nodes are two shared-memory folders."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from ckpt_world import WORKER, results, run_world

from agent.checkpoints import sharded_persist
from elastic.checkpoint import shard_layout as sl

sys.path.insert(0, str(WORKER.parent))
from ckpt_worker import expected_tensors  # noqa: E402


def node_env(folders: list[Path], per_node: int):
    """Ranks ``per_node`` to a node: each node's shared memory and the real local rank."""

    def env(rank: int) -> dict[str, str]:
        return {
            "ELASTIC_SHM_DIR": str(folders[rank // per_node]),
            "ELASTIC_LOCAL_RANK": str(rank % per_node),
            "GROUP_RANK": str(rank // per_node),
        }

    return env


def replicate(source: Path, holder: Path, node: str) -> None:
    """What a peer's agent keeps of ``source``'s newest sharded step: its files and their sha256."""
    step, save_id, data = sl.committed(source / sl.SHARDED_SUBDIR)[0]
    root = holder / sl.REPLICAS_SUBDIR / node / sl.SHARDED_SUBDIR
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / sl.tmp_dir_name(step, save_id)
    shutil.copytree(data, tmp)
    sl.write_json(tmp / sl.HASHES, {p.name: sl.sha256_file(p) for p in tmp.iterdir() if p.is_file()})
    sl.commit(root, tmp, step, save_id)


def replicated_files(node: Path) -> dict[str, int]:
    """The data files (name: size) holding the plain values ("rep", "meta") of ``node``'s newest step."""
    from torch.distributed.checkpoint import FileSystemReader

    data = sl.committed(node / sl.SHARDED_SUBDIR)[0][2]
    metadata = FileSystemReader(data).read_metadata()
    names = {
        info.relative_path
        for index, info in metadata.storage_data.items()
        if index.fqn.split(".")[0] in ("rep", "meta")
    }
    sizes = sl.read_manifest(data)  # every data file of the step, with its size
    assert sizes is not None
    return {name: sizes[name] for name in names}


def check_full(out: Path, scale: float) -> None:
    full = torch.load(out / "full.pt", weights_only=True)
    for name, tensor in expected_tensors().items():
        assert torch.equal(full[name], tensor * scale), name


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_sharded_flash_saves_stay_in_memory_and_a_lost_node_is_restored_from_its_replica(
    tmp_path: Path,
) -> None:
    nodes = [tmp_path / "shmA", tmp_path / "shmB"]
    for folder in nodes:
        folder.mkdir()
    run_world(4, ["sharded-steps", str(tmp_path), "-", "3"], tmp_path / "save", node_env(nodes, 2))
    for node, ranks in zip(nodes, ([0, 1], [2, 3]), strict=True):
        steps = sl.committed(node / sl.SHARDED_SUBDIR)
        assert [s for s, _, _ in steps] == [3, 2], "memory keeps the newest two saves"
        data = steps[0][2]
        names = sorted(p.name for p in data.iterdir())
        data_files = [f"__{r}_0.distcp" for r in ranks]
        digests = [name + sl.DIGEST_SUFFIX for name in data_files]  # each written at the save (the digest)
        assert names == sorted([".metadata", "manifest.json", *data_files, *digests])
        assert not list((node / sl.SHARDED_SUBDIR).glob("*.tmp")), "no temp folder left"

    # Each node's keeper persists its part to a disk folder of its own (no shared file system): no folder
    # holds a whole step, the union does; a world of 3 without shared memory restores it from the disks.
    disks = [tmp_path / "diskA", tmp_path / "diskB"]
    for node, disk in zip(nodes, disks, strict=True):
        step, save_id, data = sl.committed(node / sl.SHARDED_SUBDIR)[0]
        outcome = sharded_persist.persist(
            data,
            disk / sl.SHARDED_SUBDIR,
            step=step,
            save_id=save_id,
            round_=1,
            keep=2,
            copy=shutil.copyfileobj,
        )
        assert outcome.published and not outcome.committed
    from_disks = tmp_path / "from-disks"
    from_disks.mkdir()
    run_world(
        3,
        ["sharded-load", str(from_disks), "-"],
        from_disks / "logs",
        lambda rank: {"ELASTIC_CKPT_DIR": str(disks[min(rank, 1)])},
    )
    assert [r["step"] for r in results(from_disks, 3)] == [3, 3, 3]
    check_full(from_disks, 3.0)

    # The same world over both nodes' memory: every rank reads its own shards, held by its node; only the
    # file holding the plain (replicated, saved once) values travels, to the node that lacks it.
    same = tmp_path / "same-world"
    same.mkdir()
    run_world(4, ["sharded-load", str(same), "-"], same / "logs", node_env(nodes, 2))
    assert [r["step"] for r in results(same, 4)] == [3, 3, 3, 3]
    plain = replicated_files(nodes[0])
    for node, writer in zip(nodes, (0, 2), strict=True):
        own = {p.name for p in sl.committed(node / sl.SHARDED_SUBDIR)[0][2].iterdir()}
        expected = sum(size for name, size in plain.items() if name not in own)
        assert results(same, 4)[writer]["received"] == expected, "only the replicated values' file moves"
    assert results(same, 4)[1]["received"] == results(same, 4)[3]["received"] == 0, "one receiver per node"
    check_full(same, 3.0)

    # Node B is lost; A holds B's newest step as a replica: the world of 2 restores step 3 from A alone.
    replicate(nodes[1], nodes[0], "B")
    out = tmp_path / "restored"
    out.mkdir()
    run_world(2, ["sharded-load", str(out), "-"], out / "logs", node_env([nodes[0]], 2))
    assert [r["step"] for r in results(out, 2)] == [3, 3]
    check_full(out, 3.0)
    assert [r["received"] for r in results(out, 2)] == [0, 0], "A holds all: its own files and B's replica"
    assert not (nodes[0] / "restore").exists() or not list((nodes[0] / "restore").iterdir())

    # A world of 3 over both nodes' memory: B's rank (no replica needed) gets A's files over the group.
    out3 = tmp_path / "restored3"
    out3.mkdir()
    env = node_env(nodes, 2)
    run_world(3, ["sharded-load", str(out3), "-"], out3 / "logs", env)
    assert [r["step"] for r in results(out3, 3)] == [3, 3, 3]
    check_full(out3, 3.0)
    sizes = {p.name: p.stat().st_size for p in sl.committed(nodes[0] / sl.SHARDED_SUBDIR)[0][2].iterdir()}
    # Rank 2 (node B) re-shards: it reads the last third of each tensor, in A's __1_0 and B's own files.
    # Re-sharding: rank 2 (node B) reads its rows from B's own files and the plain values from A's __1_0
    # (not __0_0, which it does not read); A holds B's replica, so it lacks nothing.
    assert [r["received"] for r in results(out3, 3)] == [0, 0, sizes["__1_0.distcp"]]

    # A damaged replica is refused at restore (its digest differs from the one recorded when it was
    # received) and left out: with node B gone, no step is whole any more.
    shutil.rmtree(nodes[1])
    replica = sl.committed(nodes[0] / sl.REPLICAS_SUBDIR / "B" / sl.SHARDED_SUBDIR)[0][2]
    victim = replica / "__2_0.distcp"
    data = bytearray(victim.read_bytes())
    data[-100] ^= 0xFF
    victim.write_bytes(bytes(data))
    bad = tmp_path / "bad"
    bad.mkdir()
    with pytest.raises(AssertionError) as failed:
        run_world(2, ["sharded-load", str(bad), "-"], bad / "logs", node_env([nodes[0]], 2))
    logs = (bad / "logs" / "rank0.log").read_text()
    assert "is damaged" in logs and "differs from the recorded" in logs, str(failed.value)[-2000:]
    assert "no step in full" in logs, "the damaged file was left out, never loaded"
    assert json.loads((replica / sl.HASHES).read_text())["__2_0.distcp"]

    # Without the replica, node A holds half of every step: starting fresh would lose the job's progress.
    shutil.rmtree(nodes[0] / sl.REPLICAS_SUBDIR)
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    with pytest.raises(AssertionError) as failed:
        run_world(2, ["sharded-load", str(fresh), "-"], fresh / "logs", node_env([nodes[0]], 2))
    logs = (fresh / "logs" / "rank0.log").read_text()
    assert "no step in full" in logs and "--ckpt-reset" in logs, str(failed.value)[-2000:]
