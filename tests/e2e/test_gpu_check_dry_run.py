"""bench/gpu_check.py's dry run: without a GPU every CUDA check prints a skip line and the CPU
twin of every part (gloo, CPU tensors, the zygote's no-CUDA-before-fork check, the flash save) a figure,
in the table and in the JSON, and nothing is left running."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from bench_runs import run_bench  # noqa: E402

from bench import gpu_check  # noqa: E402


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_dry_run_skips_every_cuda_check_and_measures_every_cpu_twin(tmp_path: Path) -> None:
    out = tmp_path / "gpu.json"
    # torchrun's twin is left out to keep the suite short: on 2 busy cores its restart alone can take
    # half a minute (bench/recovery.py measures it); --budget-s high so that no part is skipped for time.
    argv = ["bench/gpu_check.py", "--dry-run", "--small", "--budget-s", "900", "--json", str(out)]
    argv += ["--tools", "elastic-run,elastic-run-inprocess", "--workdir", str(tmp_path / "work")]
    proc, left = run_bench(argv, timeout=400)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert not left, f"processes left behind by bench/gpu_check.py: {left}"
    data = json.loads(out.read_text())
    assert data["mode"] == "dry-run"
    assert [p["part"] for p in data["parts"]] == [1, 2, 3, 4, 5]
    rows = data["rows"]
    expected = {(check, device) for part in gpu_check.PARTS for check, device in part.checks(False)}
    assert {(r["check"], r["device"]) for r in rows} == expected

    for row in (r for r in rows if r["device"] == "cuda"):
        assert row["status"] == "skip", row
        assert f"| {row['check']} | cuda | skip |" in proc.stdout  # its line in the table
    twins = [r for r in rows if r["device"] == "cpu" and r["note"] != "not in --tools"]
    for row in twins:
        if row["part"] == 5 and row["status"] == "absent":
            continue  # the integrity guard is not in this tree yet: nothing to measure
        assert row["status"] == "ok", row
        assert row["figures"], row
        if row["check"] not in (gpu_check.P2_ZYGOTE, gpu_check.P2_POISON):  # those are yes/no checks
            assert any(type(v) in (int, float) for v in row["figures"].values()), row
    assert {r["part"] for r in twins} == {1, 2, 3, 4, 5}

    figures = {r["check"]: r["figures"] for r in twins}
    assert figures[gpu_check.p2_check("elastic-run-inprocess")]["survivor_pid_kept"] == "1/1"
    zygote = figures[gpu_check.P2_ZYGOTE]
    assert zygote == {"forked_by_zygote": True, "nvidia_device_fds": 0, "libcuda_mapped": False}, zygote
    poison = figures[gpu_check.P2_POISON]
    assert poison["worker_execd"] and poison["trained"], poison
    blocked = figures[f"{gpu_check.P4_W2} (gloo)"]
    assert blocked["released"] is True, blocked


def test_wheels_cover_every_dependency_but_torch() -> None:
    names = {gpu_check.re.split(r"[<>=!~ ]", r)[0] for r in gpu_check.requirements()}
    assert "torch" not in names
    assert {"fastapi", "pydantic", "psutil", "click"} <= names
    assert set(gpu_check.AGENT_MODULES.values()) == names  # each checked module comes from one of them
    assert gpu_check.AGENT_MODULES["starlette"] == "fastapi"
