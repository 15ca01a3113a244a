"""End-to-end runs of scripts/train_script.py as real worker processes, started without a launcher.

Each test hands the workers torchrun's environment contract itself (RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR, MASTER_PORT), waits for them with a deadline and kills any survivor by PID.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from ports import free_port

REPO_ROOT = Path(__file__).resolve().parents[2]
SCRIPT = REPO_ROOT / "scripts" / "train_script.py"
RUN_TIMEOUT_S = 90

pytestmark = pytest.mark.slow


@dataclass
class Worker:
    rank: int
    proc: subprocess.Popen[bytes]
    stdout: Path
    stderr: Path

    def output(self) -> str:
        return self.stdout.read_text()

    def errors(self) -> str:
        return self.stderr.read_text()


def worker_env(rank: int, world_size: int, port: int, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC_", "ELASTIC_", "MASTER_"))}
    env.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        OMP_NUM_THREADS="1",
        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])),
        PYTHONUNBUFFERED="1",
    )
    env.update(extra)
    return env


@contextlib.contextmanager
def workers(world_size: int, args: list[str], log_dir: Path, **extra_env: str) -> Iterator[list[Worker]]:
    """Start ``world_size`` workers of the script; on exit kill (by PID) and reap any still running."""
    port = free_port()
    log_dir.mkdir(parents=True, exist_ok=True)
    started: list[Worker] = []
    try:
        for rank in range(world_size):
            stdout, stderr = log_dir / f"rank{rank}.out", log_dir / f"rank{rank}.err"
            # Output goes to files, not pipes, so a chatty worker can never block on a full pipe.
            with stdout.open("wb") as out, stderr.open("wb") as err:
                proc = subprocess.Popen(
                    [sys.executable, str(SCRIPT), *args],
                    env=worker_env(rank, world_size, port, **extra_env),
                    stdout=out,
                    stderr=err,
                    cwd=log_dir,
                )
            started.append(Worker(rank, proc, stdout, stderr))
        yield started
    finally:
        for worker in started:
            if worker.proc.poll() is None:
                worker.proc.kill()
            worker.proc.wait()


def run_to_completion(world_size: int, args: list[str], log_dir: Path, **extra_env: str) -> list[Worker]:
    with workers(world_size, args, log_dir, **extra_env) as started:
        for worker in started:
            worker.proc.wait(timeout=RUN_TIMEOUT_S)
    return started


def assert_succeeded(started: list[Worker]) -> None:
    for worker in started:
        assert worker.proc.returncode == 0, f"rank {worker.rank} failed:\n{worker.errors()}"


def losses(output: str) -> list[float]:
    return [float(x) for x in re.findall(r"^step=\d+ loss=(\d+\.\d{4}) world=\d+$", output, re.MULTILINE)]


@pytest.mark.timeout(120)
def test_single_worker_trains_saves_and_resumes_from_its_checkpoint(tmp_path: Path) -> None:
    ckpt_dir = tmp_path / "ckpt"
    common = ["--ckpt-dir", str(ckpt_dir), "--ckpt-every", "2"]

    (first,) = run_to_completion(1, [*common, "--steps", "4"], tmp_path / "first")

    assert_succeeded([first])
    out = first.output()
    assert "start rank=0 world=1 restart=0 resumed_step=0" in out
    assert re.findall(r"^step=(\d+) ", out, re.MULTILINE) == ["1", "2", "3", "4"]
    assert out.rstrip().endswith("done step=4")
    assert (ckpt_dir / "latest").read_text() == "step_0000000004.pt"

    (second,) = run_to_completion(
        1, [*common, "--steps", "7"], tmp_path / "second", TORCHELASTIC_RESTART_COUNT="1"
    )

    assert_succeeded([second])
    out = second.output()
    assert "start rank=0 world=1 restart=1 resumed_step=4" in out
    assert re.findall(r"^step=(\d+) ", out, re.MULTILINE) == ["5", "6", "7"]
    assert out.rstrip().endswith("done step=7")
    assert (ckpt_dir / "latest").read_text() == "step_0000000007.pt"  # the final save at an odd step


@pytest.mark.timeout(150)
def test_two_gloo_workers_train_the_same_curve_as_one(tmp_path: Path) -> None:
    args = ["--steps", "3", "--ckpt-every", "0"]
    dump = str(tmp_path / "env" / "rank{rank}.json")

    pair = run_to_completion(
        2, [*args, "--ckpt-dir", str(tmp_path / "ckpt2"), "--dump-env", dump], tmp_path / "pair"
    )

    assert_succeeded(pair)
    for worker in pair:
        assert f"start rank={worker.rank} world=2 restart=0 resumed_step=0" in worker.output()
        env = json.loads((tmp_path / "env" / f"rank{worker.rank}.json").read_text())
        assert env["RANK"] == str(worker.rank) and env["WORLD_SIZE"] == "2"
    assert "done step=3" in pair[0].output()
    assert "step=" not in pair[1].output().replace("resumed_step=", ""), "only rank 0 logs steps"

    (single,) = run_to_completion(1, [*args, "--ckpt-dir", str(tmp_path / "ckpt1")], tmp_path / "single")

    assert_succeeded([single])
    # Each rank trains on its shard of the same global batch and DDP averages the gradients, so the
    # loss curve does not depend on the world size (up to float rounding).
    assert losses(pair[0].output()) == pytest.approx(losses(single.output()), abs=2e-4)
    assert len(losses(single.output())) == 3


@pytest.mark.timeout(60)
def test_fail_always_exits_non_zero_with_the_injected_error(tmp_path: Path) -> None:
    args = ["--steps", "3", "--ckpt-dir", str(tmp_path / "ckpt"), "--fail-always"]

    (worker,) = run_to_completion(1, args, tmp_path / "run")

    assert worker.proc.returncode != 0
    assert "start rank=0 world=1" in worker.output()
    assert "RuntimeError: injected failure" in worker.errors()
    assert not (tmp_path / "ckpt").exists()
