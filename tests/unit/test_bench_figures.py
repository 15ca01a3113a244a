"""bench/figures.py draws the benchmarks' figures (SVG) from their ``--json`` output (a small fixture)."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from bench import figures

pytestmark = pytest.mark.timeout(120)


def run(tool: str, to_step: float | None, **extra) -> dict:
    return {"tool": tool, "recovered": to_step is not None, "to_step": to_step, **extra}


# Rank 0 steps every 0.1 s until step 5 at t=1.5, the kill at t=1.55, the restart resumes from step 4
# (step 5 is redone) and steps again from t=3.5.
TIMELINE = [[1.1, 1], [1.2, 2], [1.3, 3], [1.4, 4], [1.5, 5], [3.5, 5], [3.6, 6], [3.7, 7]]
RECOVERY = {
    "benchmark": "recovery",
    "runs": [
        run("elastic-run", 1.9, kill_at=1.55, timeline=TIMELINE),
        run("elastic-run", 2.1, kill_at=1.5, timeline=TIMELINE),
        run("torchrun", 6.0),
        run("torchrun", None),
    ],
}
NODE_LOSS = {"benchmark": "node_loss", "runs": [run("elastic-run", 4.2), run("torchrun", 30.5)]}


def test_goodput_counts_each_step_once_over_the_wall_time():
    points = dict(figures.goodput_timeline(TIMELINE))
    assert points[1.5] == pytest.approx(5 * 0.1 / 1.5)
    assert points[3.5] == pytest.approx(5 * 0.1 / 3.5), "the redone step 5 does not count twice"
    assert points[3.7] == pytest.approx(7 * 0.1 / 3.7)


def test_recovery_times_per_tool_count_runs_that_did_not_recover():
    assert figures.recovery_times(RECOVERY) == {"elastic-run": ([1.9, 2.1], 0), "torchrun": ([6.0], 1)}


def test_the_command_draws_both_figures_as_svg(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    (tmp_path / "recovery.json").write_text(json.dumps(RECOVERY))
    (tmp_path / "node_loss.json").write_text(json.dumps(NODE_LOSS))
    out = tmp_path / "figures"
    code = figures.main(
        ["--out", str(out), str(tmp_path / "recovery.json"), str(tmp_path / "node_loss.json")]
    )
    assert code == 0
    written = capsys.readouterr().out.split()
    assert written == [str(out / "recovery-times.svg"), str(out / "goodput-timeline.svg")]
    for path in written:
        root = ET.parse(path).getroot()
        assert root.tag.endswith("svg")
    times = (out / "recovery-times.svg").read_text()
    assert "1 not recovered" in times and "2.00 s" in times, "labels are text in the SVG"
    assert "worker killed" in (out / "goodput-timeline.svg").read_text()


def test_a_file_that_is_no_benchmark_output_is_a_one_line_error(tmp_path: Path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text("[1, 2]")
    assert figures.main(["--out", str(tmp_path), str(bad)]) == 2
    assert capsys.readouterr().err.strip() == f"figures: error: {bad}: not the --json output of " + (
        "bench/recovery.py or bench/node_loss.py"
    )
