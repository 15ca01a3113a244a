"""A committed sharded save in a node's memory folder, as a worker's save leaves it, for the
replication tests."""

from __future__ import annotations

from pathlib import Path

from elastic.checkpoint import shard_layout as sl


def fake_save(folder: Path, step: int, save_id: str, payload: bytes) -> Path:
    """A committed sharded step in a node's memory folder, as a worker's save leaves it."""
    root = folder / sl.SHARDED_SUBDIR
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / sl.tmp_dir_name(step, save_id)
    tmp.mkdir()
    (tmp / "__0_0.distcp").write_bytes(payload)
    (tmp / "__1_0.distcp").write_bytes(payload[::-1])
    (tmp / sl.METADATA).write_bytes(b"meta")
    sl.write_json(tmp / sl.MANIFEST, {"files": {"__0_0.distcp": len(payload), "__1_0.distcp": len(payload)}})
    return sl.commit(root, tmp, step, save_id)
