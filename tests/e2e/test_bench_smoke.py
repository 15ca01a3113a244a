"""The benchmarks in bench/ run end to end in their --smoke mode (tiny sizes, one run per tool), print a
table, and leave no process behind; run_all keeps the sections of docs/benchmarks.md it does not own."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from bench_runs import run_bench  # noqa: E402

from bench.run_all import update_section  # noqa: E402

SMOKE_TOOLS = {
    "node_loss": ["--tools", "elastic-run,elastic-run-inprocess"],
    "scale_up": ["--tools", "elastic-run,torchrun-noshare"],
}


@pytest.mark.slow
@pytest.mark.timeout(420)
@pytest.mark.parametrize("script", ["recovery", "node_loss", "scale_up", "rendezvous", "launch"])
def test_benchmark_smoke(script: str, tmp_path: Path) -> None:
    out = tmp_path / "report.md"
    argv = [f"bench/{script}.py", "--smoke", "--workdir", str(tmp_path / "work"), "--markdown-out", str(out)]
    # Keep CI time in bounds: torchrun needs ~50 s to recover from a node loss (keep-alive + 30 s last call)
    # and its default shared store deadlocks on scale-up until a 60 s timeout; the full runs measure both.
    argv += SMOKE_TOOLS.get(script, [])
    proc, left = run_bench(argv, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = out.read_text()
    assert "elastic-run" in report and "| ---" in report, report
    assert "command: `python bench/" in report
    assert not left, f"processes left behind by bench/{script}.py: {left}"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_run_all_writes_its_section_and_keeps_others(tmp_path: Path) -> None:
    doc = tmp_path / "benchmarks.md"
    doc.write_text("# Benchmarks: elastic-run vs torchrun\n\n## Checkpoint\n\nflash numbers stay here\n")
    proc, left = run_bench(
        ["bench/run_all.py", "--smoke", "--only", "launch", "--doc", str(doc), "--timeout", "280"],
        timeout=290,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    text = doc.read_text()
    assert "flash numbers stay here" in text
    assert "<!-- bench:launch:begin -->" in text and "| elastic-run" in text
    assert text.index("About these numbers") < text.index("## Checkpoint") < text.index("## Launch overhead")
    assert not left


def test_update_section_replaces_only_its_own_block() -> None:
    text = "# T\n\n## Checkpoint\n\nkept\n"
    once = update_section(text, "launch", "Launch overhead", "table 1")
    assert "kept" in once and "table 1" in once
    twice = update_section(once, "launch", "Launch overhead", "table 2")
    assert "table 1" not in twice and "table 2" in twice and twice.count("## Launch overhead") == 1
    top = update_section(twice, "about", "About these numbers", "about text", top=True)
    assert top.startswith("# T\n\n## About these numbers\n")
    assert top.index("About") < top.index("Checkpoint") < top.index("Launch overhead")
