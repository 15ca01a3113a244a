"""Unit tests of the worker library: backend choice, torch-free import, process-group init, checkpoints."""

from __future__ import annotations

import datetime
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from ports import free_port
from torch import nn

import elastic
from elastic import distributed
from elastic.checkpoint import layout
from elastic.checkpoint import replicated as checkpoint
from elastic.checkpoint.replicated import CheckpointError, load_latest, save

REPO_ROOT = Path(__file__).resolve().parents[2]
LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def model_and_optimizer() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(8, 4)).pow(2).mean().backward()
    optimizer.step()  # populates the momentum buffers, so the optimizer state is not empty
    return model, optimizer


def files(ckpt_dir: Path) -> list[str]:
    return sorted(p.name for p in ckpt_dir.iterdir())


@pytest.fixture(autouse=True)
def no_launcher_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (*LAUNCHER_ENV, "ELASTIC_CKPT_DIR", "ELASTIC_PG_TIMEOUT_S"):
        monkeypatch.delenv(name, raising=False)


# --- elastic package and process group ------------------------------------------------------------------


@pytest.mark.timeout(10)
def test_backend_is_nccl_with_cuda_and_gloo_without() -> None:
    assert elastic.backend_for_device(cuda_available=True) == "nccl"
    assert elastic.backend_for_device(cuda_available=False) == "gloo"


@pytest.mark.timeout(60)
def test_import_elastic_does_not_import_torch() -> None:
    code = "import elastic, sys; assert 'torch' not in sys.modules, 'import elastic pulled in torch'"
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=50
    )
    assert result.returncode == 0, result.stderr


@pytest.mark.timeout(10)
def test_lazy_names_resolve_to_the_worker_api() -> None:
    assert elastic.__version__ == "0.1.0"
    assert elastic.save is checkpoint.save
    assert elastic.load_latest is checkpoint.load_latest
    assert elastic.CheckpointError is checkpoint.CheckpointError
    assert elastic.init_process_group is distributed.init_process_group
    assert elastic.destroy_process_group is distributed.destroy_process_group
    assert elastic.distributed is distributed
    assert set(elastic.__all__) <= set(dir(elastic))
    with pytest.raises(AttributeError, match="no_such_name"):
        _ = elastic.no_such_name


@pytest.mark.timeout(10)
def test_init_process_group_names_the_missing_launcher_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    with pytest.raises(RuntimeError, match=r"MASTER_PORT.*elastic-run"):
        elastic.init_process_group()


@pytest.mark.timeout(10)
def test_process_group_timeout_comes_from_env_else_300_s() -> None:
    assert distributed._timeout_from_env({}) == datetime.timedelta(seconds=300)
    assert distributed._timeout_from_env({"ELASTIC_PG_TIMEOUT_S": "12.5"}) == datetime.timedelta(seconds=12.5)
    for bad in ("soon", "0", "-3"):
        with pytest.raises(ValueError, match="ELASTIC_PG_TIMEOUT_S"):
            distributed._timeout_from_env({"ELASTIC_PG_TIMEOUT_S": bad})


@pytest.mark.timeout(60)
def test_one_process_group_on_cpu_uses_gloo_and_init_is_idempotent(monkeypatch: pytest.MonkeyPatch) -> None:
    env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"}
    for name, value in {**env, "MASTER_PORT": str(free_port())}.items():
        monkeypatch.setenv(name, value)
    try:
        assert elastic.init_process_group() == "gloo"
        assert torch.distributed.get_world_size() == 1
        assert elastic.init_process_group() == "gloo"  # second call: no error, same group
    finally:
        elastic.destroy_process_group()
    assert not torch.distributed.is_initialized()
    elastic.destroy_process_group()  # safe when nothing is initialized


# --- checkpoints ------------------------------------------------------------------------------------------


@pytest.mark.timeout(30)
def test_checkpoint_round_trip_restores_model_optimizer_and_rng(tmp_path: Path) -> None:
    model, optimizer = model_and_optimizer()
    rng = torch.get_rng_state()
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "rng": rng, "note": "x"}

    path = save(state, 7, tmp_path, rank=0)

    assert path == tmp_path / "step_0000000007.pt"
    assert (tmp_path / "latest").read_text() == "step_0000000007.pt"
    loaded = load_latest(tmp_path)
    assert loaded is not None
    loaded_state, step = loaded
    assert step == 7
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded_state["model"][name], tensor)
    restored_model, restored_optimizer = model_and_optimizer()
    restored_optimizer.load_state_dict(loaded_state["optimizer"])
    assert restored_optimizer.state_dict()["param_groups"] == optimizer.state_dict()["param_groups"]
    assert torch.equal(loaded_state["rng"], rng)
    assert loaded_state["note"] == "x"


@pytest.mark.timeout(30)
def test_save_keeps_only_the_newest_checkpoints(tmp_path: Path) -> None:
    for step in (10, 20, 30, 40, 50):
        save({"step_value": torch.tensor(step)}, step, tmp_path, keep=2, rank=0)

    assert files(tmp_path) == ["latest", "step_0000000040.pt", "step_0000000050.pt"]
    loaded = load_latest(tmp_path)
    assert loaded is not None
    assert loaded[1] == 50
    assert loaded[0]["step_value"].item() == 50


@pytest.mark.timeout(30)
def test_leftover_temp_file_of_a_killed_save_is_never_loaded(tmp_path: Path) -> None:
    save({"w": torch.ones(2)}, 10, tmp_path, rank=0)
    # What a save killed midway leaves: a newer, torn temp file named after its (now dead) writer.
    writer = subprocess.Popen([sys.executable, "-c", "pass"])
    writer.wait()
    tag = f"{layout.host_tag()}.{writer.pid}.deadbeef"
    (tmp_path / f".step_0000000020.pt.{tag}.tmp").write_bytes(b"torn")

    loaded = load_latest(tmp_path)

    assert loaded is not None and loaded[1] == 10
    (tmp_path / f".latest.{tag}.tmp").write_bytes(b"step_00")
    mine = layout.temp_path(tmp_path / "step_0000000040.pt")  # a live writer's (this process): kept
    mine.write_bytes(b"in progress")
    assert len(list(tmp_path.glob("*.tmp"))) == 3
    save({"w": torch.ones(2)}, 30, tmp_path, rank=0)
    assert list(tmp_path.glob("*.tmp")) == [mine], "the next save removes dead writers' leftovers only"


@pytest.mark.timeout(30)
def test_marker_naming_a_missing_file_falls_back_to_the_newest_checkpoint(tmp_path: Path) -> None:
    save({"w": torch.zeros(1)}, 10, tmp_path, rank=0)
    save({"w": torch.zeros(1)}, 20, tmp_path, rank=0)
    (tmp_path / "latest").write_text("step_0000000099.pt")

    loaded = load_latest(tmp_path)

    assert loaded is not None and loaded[1] == 20
    (tmp_path / "latest").unlink()
    loaded = load_latest(tmp_path)
    assert loaded is not None and loaded[1] == 20


@pytest.mark.timeout(30)
def test_unreadable_newest_checkpoint_falls_back_to_an_older_one(tmp_path: Path) -> None:
    save({"w": torch.zeros(1)}, 10, tmp_path, rank=0)
    save({"w": torch.zeros(1)}, 20, tmp_path, rank=0)
    (tmp_path / "step_0000000020.pt").write_bytes(b"not a checkpoint")

    loaded = load_latest(tmp_path)
    assert loaded is not None and loaded[1] == 10

    (tmp_path / "step_0000000010.pt").write_bytes(b"")
    with pytest.raises(CheckpointError, match="no loadable checkpoint"):
        load_latest(tmp_path)


@pytest.mark.timeout(10)
def test_load_latest_returns_none_without_checkpoints(tmp_path: Path) -> None:
    assert load_latest(tmp_path) is None
    assert load_latest(tmp_path / "never-created") is None


@pytest.mark.timeout(10)
def test_only_global_rank_zero_writes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ckpt_dir = tmp_path / "ckpt"

    assert save({"w": torch.ones(1)}, 5, ckpt_dir, rank=1) is None
    monkeypatch.setenv("RANK", "3")
    assert save({"w": torch.ones(1)}, 5, ckpt_dir) is None

    assert not ckpt_dir.exists()
    monkeypatch.setenv("RANK", "0")
    assert save({"w": torch.ones(1)}, 5, ckpt_dir) == ckpt_dir / "step_0000000005.pt"


@pytest.mark.timeout(10)
def test_checkpoint_dir_comes_from_argument_or_env_else_a_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(ValueError, match="ELASTIC_CKPT_DIR"):
        save({"w": torch.ones(1)}, 1, rank=0)
    with pytest.raises(ValueError, match="ELASTIC_CKPT_DIR"):
        load_latest()

    monkeypatch.setenv("ELASTIC_CKPT_DIR", str(tmp_path))
    assert save({"w": torch.ones(1)}, 1, rank=0) == tmp_path / "step_0000000001.pt"
    loaded = load_latest()
    assert loaded is not None and loaded[1] == 1


@pytest.mark.timeout(10)
def test_save_rejects_bad_arguments(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="dict"):
        save([1, 2], 1, tmp_path, rank=0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="step"):
        save({}, -1, tmp_path, rank=0)
    with pytest.raises(ValueError, match="keep"):
        save({}, 1, tmp_path, keep=0, rank=0)


def test_collectives_put_tensors_on_the_rank_gpu_for_nccl_and_on_the_cpu_otherwise() -> None:
    from elastic.collectives import collective_device

    assert collective_device("nccl", current_cuda_device=3) == torch.device("cuda", 3)
    assert collective_device("NCCL", current_cuda_device=0) == torch.device("cuda", 0)
    assert collective_device("gloo") == torch.device("cpu")
    assert collective_device("cpu:gloo,cuda:nccl", current_cuda_device=1) == torch.device("cuda", 1)


def test_a_token_file_open_to_group_or_others_gets_a_warning(tmp_path) -> None:
    from elastic.control.auth import create_token_file, loose_permissions_warning

    path = tmp_path / "tok"
    create_token_file(path)
    assert loose_permissions_warning(path) is None, "created 0600"
    path.chmod(0o644)
    warning = loose_permissions_warning(path)
    assert warning is not None and "chmod 600" in warning and "644" in warning and "\n" not in warning


def test_printable_escapes_control_characters_into_one_line() -> None:
    from elastic.text import printable

    assert printable("plain text: ok") == "plain text: ok"
    assert printable("x\nFAKE [elastic.master] job_succeeded") == "x\\nFAKE [elastic.master] job_succeeded"
    assert printable("\x1b[2Jwiped\r\t\x7f\x9b") == "\\x1b[2Jwiped\\r\\t\\x7f\\x9b"
    assert "\n" not in printable("a\nb\nc")
