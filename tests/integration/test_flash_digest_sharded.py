"""The digest of sharded flash checkpoints: each rank's data files get one at the save (``<file>.xxh3``),
replicas carry theirs in ``hashes.json``; a file failing its digest at restore is left out and the ranks
choose again (a peer's replica of it, else an older step), never loading damaged bytes.

Real worker processes on gloo (tests/support/ckpt_worker.py); two fake nodes are two shared-memory folders
of one rank each."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
import torch
from ckpt_world import WORKER, results, run_world

from elastic.checkpoint import shard_layout as sl

sys.path.insert(0, str(WORKER.parent))
from ckpt_worker import expected_tensors  # noqa: E402


def node_env(folders: list[Path]):
    def env(rank: int) -> dict[str, str]:
        return {"ELASTIC_SHM_DIR": str(folders[rank]), "ELASTIC_LOCAL_RANK": "0", "GROUP_RANK": str(rank)}

    return env


def replicate(source: Path, holder: Path, node: str) -> Path:
    """What a peer's agent keeps of ``source``'s newest sharded step: its files and their digests."""
    step, save_id, data = sl.committed(source / sl.SHARDED_SUBDIR)[0]
    root = holder / sl.REPLICAS_SUBDIR / node / sl.SHARDED_SUBDIR
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / sl.tmp_dir_name(step, save_id)
    tmp.mkdir()
    files = [
        p for p in data.iterdir() if sl.file_id(p.name) is not None or p.name in (sl.METADATA, sl.MANIFEST)
    ]
    for path in files:  # what the replication sends: no .xxh3 files
        shutil.copyfile(path, tmp / path.name)
    sl.write_json(tmp / sl.HASHES, {p.name: sl.file_digest(tmp / p.name) for p in files})
    return sl.commit(root, tmp, step, save_id)


def flip(path: Path, offset: int = -100) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def loaded_scale(out: Path) -> float:
    full = torch.load(out / "full.pt", weights_only=True)
    name, tensor = next(iter(expected_tensors().items()))
    return float(full[name].flatten()[1] / tensor.flatten()[1])


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_damaged_shard_is_left_out_for_a_peers_replica_or_an_older_step(tmp_path: Path) -> None:
    nodes = [tmp_path / "shmA", tmp_path / "shmB"]
    for folder in nodes:
        folder.mkdir()
    run_world(2, ["sharded-steps", str(tmp_path), "-", "3"], tmp_path / "save", node_env(nodes))
    for node in nodes:
        data = sl.committed(node / sl.SHARDED_SUBDIR)[0][2]
        for path in data.glob("__*_*.distcp"):
            recorded = sl.digest_path(path).read_text()
            assert recorded == sl.file_digest(path), "the writer's digest of what it wrote"
            assert sl.check_file(path) == ""
    # Each node keeps the other's newest step as a replica (--replicas 1).
    replicate(nodes[0], nodes[1], "A")
    replicas_of_b = replicate(nodes[1], nodes[0], "B")

    # A's own file of step 3 flips a bit: found at restore, left out; B's replica of it completes step 3.
    own = sl.committed(nodes[0] / sl.SHARDED_SUBDIR)[0][2] / "__0_0.distcp"
    flip(own)
    assert "differs from the recorded" in sl.check_file(own)
    peer = tmp_path / "from-peer"
    peer.mkdir()
    run_world(2, ["sharded-load", str(peer), "-"], peer / "logs", node_env(nodes))
    assert [r["step"] for r in results(peer, 2)] == [3, 3]
    assert loaded_scale(peer) == 3.0
    assert results(peer, 2)[0]["received"] == own.stat().st_size, "A received its file from B's replica"
    # A's shard of "big" (65 rows, 130 KiB) went straight into its tensor, the small ones by copy.
    assert results(peer, 2)[0]["direct"] == 65 * 512 * 4
    assert "failed its digest check" in (peer / "logs" / "rank0.log").read_text()

    # Now B's replica of A's file is damaged too: no good copy of it anywhere, so step 3 is incomplete and
    # both ranks restore step 2 together.
    flip(sl.committed(nodes[1] / sl.REPLICAS_SUBDIR / "A" / sl.SHARDED_SUBDIR)[0][2] / "__0_0.distcp")
    older = tmp_path / "older"
    older.mkdir()
    run_world(2, ["sharded-load", str(older), "-"], older / "logs", node_env(nodes))
    assert [r["step"] for r in results(older, 2)] == [2, 2]
    assert loaded_scale(older) == 2.0
    assert (replicas_of_b / sl.HASHES).is_file()
