"""Checkpoints outlive the launcher: what the agent persists to ``--ckpt-dir`` loads in a Python that has
torch and not this project: replicated checkpoints with plain ``torch.load(path, weights_only=True)``,
sharded ones with ``torch.distributed.checkpoint.load`` at world 1.

A real flash save (the worker's writer, into a real keeper's shared-memory folder), a real keeper persisting
it (agent/checkpoints/persist.py converts the flash bytes to torch's format on the way), then a separate
interpreter started with ``-I -S`` and only torch's site-packages on its path loads the file: it proves
``elastic`` is not importable there, and hands what it loaded back through a plain ``torch.save``.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from agent.checkpoints.keeper import CheckpointKeeper
from elastic.checkpoint import flash, layout
from elastic.checkpoint import replicated as checkpoint
from elastic.checkpoint import shard_layout as sl

#: Runs with torch only: no elastic, no agent, no repository on sys.path (-I: no cwd, no PYTHONPATH;
#: -S: no site-packages, so no editable-install hook of this project).
TORCH_ONLY = """
import importlib.util, sys
sys.path.append(sys.argv[1])
for name in ("elastic", "agent", "master"):
    assert importlib.util.find_spec(name) is None, f"{name} is importable here"
import torch
payload = torch.load(sys.argv[2], weights_only=True)
torch.save(payload, sys.argv[3])
print("loaded step", payload["step"])
"""


def torch_site_packages() -> str:
    return str(Path(torch.__file__).resolve().parent.parent)


def load_without_elastic(path: Path, out: Path) -> Any:
    """``torch.load(path, weights_only=True)`` in a Python where only torch is importable; its result."""
    done = subprocess.run(
        [sys.executable, "-I", "-S", "-c", TORCH_ONLY, torch_site_packages(), str(path), str(out)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=out.parent,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return torch.load(out, weights_only=True)


def training_state() -> dict[str, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    for _ in range(2):
        model(torch.randn(6, 4)).pow(2).sum().backward()
        optimizer.step()
    return {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "epoch": 3,
        "loss": 0.125,
        "name": "run ✓",
        "scheduler": None,
        "flags": (True, False),
        "history": [1.5, float("nan"), -(2**40)],
    }


def assert_equal(a: Any, b: Any, path: str = "") -> None:
    assert type(a) is type(b), (path, type(a), type(b))
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, path
        assert torch.equal(a, b), path
    elif isinstance(a, dict):
        assert list(a) == list(b), path
        for key in a:
            assert_equal(a[key], b[key], f"{path}/{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_equal(x, y, f"{path}/{i}")
    elif isinstance(a, float) and math.isnan(a):
        assert math.isnan(b), path
    else:
        assert a == b, (path, a, b)


@pytest.fixture
def keeper(tmp_path: Path) -> Iterator[CheckpointKeeper]:
    root = tmp_path / "shm"
    root.mkdir()
    keeper = CheckpointKeeper("job1", "node-a", ckpt_dir=tmp_path / "ckpt", root=root).start()
    try:
        yield keeper
    finally:
        flash.close_all()  # unmap the writer's segments
        keeper.stop()


@pytest.mark.timeout(180)
def test_a_persisted_replicated_checkpoint_loads_with_torch_alone(
    keeper: CheckpointKeeper, tmp_path: Path
) -> None:
    state = training_state()
    writer = flash.writer_for(keeper.folder, 2, lambda folder: 1 << 40)
    memory = writer.save(state, 265, on_commit=lambda: None)
    assert flash.is_flash(memory.read_bytes()[:16]), "the worker's copy is in the flash format"
    keeper.on_checkpoint(0, 265, str(memory), round_number=1)
    assert keeper.wait_idle(60)
    persisted = tmp_path / "ckpt" / layout.step_file_name(265)
    assert persisted.is_file()

    found = checkpoint.load_latest(tmp_path / "ckpt")
    assert found is not None
    restored, step = found
    assert step == 265
    plain = load_without_elastic(persisted, tmp_path / "plain.pt")
    assert plain["step"] == 265
    assert_equal(plain["state"], restored)
    assert_equal(plain["state"], state)
    nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2)).load_state_dict(
        plain["state"]["model"]
    )


@pytest.mark.timeout(60)
def test_a_flash_file_it_cannot_convert_is_persisted_as_it_is_with_a_warning(
    keeper: CheckpointKeeper, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    state = {"w": torch.arange(3.0)}
    memory = flash.writer_for(keeper.folder, 2, lambda folder: 1 << 40).save(state, 4, on_commit=lambda: None)
    flash.close_all()
    newer = bytearray(memory.read_bytes())
    newer[8:12] = (flash.VERSION + 1).to_bytes(4, "little")  # a flash version this agent does not know
    memory.write_bytes(newer)
    keeper.on_checkpoint(0, 4, str(memory), round_number=1)
    assert keeper.wait_idle(60)
    assert (tmp_path / "ckpt" / layout.step_file_name(4)).read_bytes() == bytes(newer)
    assert "persisted in elastic's flash format, which needs elastic.load" in caplog.text


@pytest.mark.timeout(60)
def test_files_of_earlier_versions_still_load(tmp_path: Path) -> None:
    """elastic.load_latest reads a folder that mixes the new files with flash files persisted verbatim by
    earlier versions and torch.save files of the disk mode; the newest is restored whichever its format."""
    folder = tmp_path / "ckpt"
    folder.mkdir()
    old_flash = {"w": torch.arange(4.0), "note": "flash, persisted verbatim"}
    memory = tmp_path / "shm"
    memory.mkdir()
    try:
        written = flash.writer_for(memory, 2, lambda folder: 1 << 40).save(
            old_flash, 10, on_commit=lambda: None
        )
        (folder / layout.step_file_name(10)).write_bytes(written.read_bytes())
    finally:
        flash.close_all()
    torch.save({"step": 11, "state": {"w": torch.ones(2)}}, folder / layout.step_file_name(11))
    found = checkpoint.load_latest(folder)
    assert found is not None and found[1] == 11
    (folder / layout.step_file_name(11)).unlink()
    found = checkpoint.load_latest(folder)
    assert found is not None and found[1] == 10
    assert_equal(found[0], old_flash)


#: A worker at world 1 (gloo): ``save`` saves a model's and an optimizer's state with elastic.save_sharded
#: (a flash save into the keeper's folder); ``load`` restores it from the disk folder with
#: elastic.load_sharded (no agent) into fresh state. Either writes the state, flattened to DCP's keys.
SHARDED_WORKER = """
import sys, torch, torch.distributed as dist
from torch import nn
import elastic
mode, pg_file, out = sys.argv[1:4]
dist.init_process_group("gloo", init_method="file://" + pg_file, rank=0, world_size=1)
torch.manual_seed(0 if mode == "save" else 1)  # the load's state differs until it is loaded
model = nn.Linear(4, 3)
optimizer = torch.optim.AdamW(model.parameters())
model(torch.randn(2, 4)).sum().backward()
optimizer.step()  # the optimizer's state exists: DCP loads into the entries the state has
state = {"model": model.state_dict(), "optim": optimizer.state_dict(), "epoch": 3, "name": "run"}
state["none"] = None
if mode == "save":
    elastic.save_sharded(state, 5)
else:
    assert elastic.load_sharded(state, ckpt_dir=sys.argv[4]) == 5
def flat(prefix, value, into):
    if isinstance(value, dict):
        for key, item in value.items():
            flat(f"{prefix}{key}.", item, into)
    elif isinstance(value, list) and prefix.endswith("param_groups."):
        for i, item in enumerate(value):
            flat(f"{prefix}{i}.", item, into)
    else:
        into[prefix[:-1]] = value
    return into
torch.save(flat("", state, {}), out)
dist.destroy_process_group()
"""

#: torch only (see TORCH_ONLY): dcp.load of the persisted step at world 1, without a process group, into
#: state made from the checkpoint's own metadata.
DCP_TORCH_ONLY = """
import importlib.util, sys
sys.path.append(sys.argv[1])
for name in ("elastic", "agent", "master"):
    assert importlib.util.find_spec(name) is None, f"{name} is importable here"
import warnings
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
warnings.simplefilter("ignore")  # "assuming the intent is to load in a single process": it is
folder = sys.argv[2]
metadata = dcp.FileSystemReader(folder).read_metadata().state_dict_metadata
state = {}
for key, meta in metadata.items():
    tensor = isinstance(meta, TensorStorageMetadata)
    state[key] = torch.empty(meta.size, dtype=meta.properties.dtype) if tensor else None
dcp.load(state, checkpoint_id=folder)
torch.save(state, sys.argv[3])
"""


def run_sharded_worker(mode: str, tmp_path: Path, env: dict[str, str], *extra: str) -> dict[str, Any]:
    out = tmp_path / f"{mode}.pt"
    done = subprocess.run(
        [sys.executable, "-c", SHARDED_WORKER, mode, str(tmp_path / f"pg-{mode}"), str(out), *extra],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return torch.load(out, weights_only=True)


@pytest.mark.timeout(300)
def test_a_persisted_sharded_checkpoint_loads_with_dcp_alone(
    keeper: CheckpointKeeper, tmp_path: Path
) -> None:
    base = {k: v for k, v in os.environ.items() if not k.startswith("ELASTIC_")}
    base |= {"LOCAL_RANK": "0", "RANK": "0", "WORLD_SIZE": "1", "GROUP_RANK": "0"}
    base["ELASTIC_AGENT_SOCKET"] = str(tmp_path / "nobody.sock")  # reports go nowhere
    saved = run_sharded_worker("save", tmp_path, {**base, "ELASTIC_SHM_DIR": str(keeper.folder)})
    memory = keeper.folder / sl.SHARDED_SUBDIR / sl.step_link_name(5)
    keeper.on_checkpoint(0, 5, str(memory), round_number=1)
    assert keeper.wait_idle(60)
    disk = tmp_path / "ckpt" / sl.SHARDED_SUBDIR
    assert sl.latest_step(disk) == 5

    restored = run_sharded_worker("load", tmp_path, base, str(tmp_path / "ckpt"))
    done = subprocess.run(
        [
            *(sys.executable, "-I", "-S", "-c", DCP_TORCH_ONLY, torch_site_packages()),
            *(str(disk / sl.step_link_name(5)), str(tmp_path / "plain.pt")),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    plain = torch.load(tmp_path / "plain.pt", weights_only=True)
    assert sorted(plain) == sorted(restored)
    for key in restored:
        assert_equal(plain[key], restored[key], key)
    assert_equal(restored, saved)
