"""The agent's progress line (agent/observe/progress.py): its format, and ``elastic-run`` printing it every
``--progress-interval`` seconds with the workers' real steps, and not at all with ``--quiet``."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from e2e import elastic_run_argv, launch  # noqa: F401 - launch is a fixture

from agent.observe.progress import ProgressSample, progress_line, steps_per_s

pytestmark = pytest.mark.timeout(120)


def sample(at: float, step: int | None, **fields) -> ProgressSample:
    base = dict(
        at=at,
        state="running",
        round=3,
        step=step,
        step_time_s=0.25,
        world_size=16,
        nnodes=2,
        restarts=1,
        max_restarts=3,
        ckpt_step=1100,
        persisted_step=1000,
    )
    return ProgressSample(**{**base, **fields})


def test_the_line_names_round_step_rate_world_restarts_and_checkpoints():
    line = progress_line(sample(40.0, 1200), sample(10.0, 1050))
    assert line == (
        "progress: round 3, step 1200, 5 steps/s, world 16 (2 nodes), restarts 1/3, "
        "checkpoint step 1100 (on disk 1000)"
    )


def test_the_rate_comes_from_the_step_time_without_an_earlier_line_of_the_same_round():
    assert steps_per_s(sample(40.0, 1200), None) == 4.0
    assert steps_per_s(sample(40.0, 5), sample(10.0, 1050, round=2)) == 4.0, "a new round restarts the count"


def test_a_node_between_rounds_says_so():
    waiting = sample(
        1.0, None, state="waiting", round=0, world_size=None, ckpt_step=None, persisted_step=None
    )
    assert progress_line(waiting) == "progress: no round yet, waiting, restarts 1/3, checkpoint -"


STEPPER = """
import time
from elastic.report import report
for step in range(1, 400):
    report(step)
    time.sleep(0.02)
"""


def run_stepper(launch, tmp_path: Path, *flags: str):  # noqa: F811
    script = tmp_path / "stepper.py"
    script.write_text(STEPPER)
    argv = elastic_run_argv("--standalone", "--nproc-per-node", "2", "--no-warm-start", *flags, str(script))
    return launch(argv, name="agent")


@pytest.mark.slow
def test_elastic_run_prints_the_progress_line_every_interval(launch, tmp_path: Path):  # noqa: F811
    proc = run_stepper(launch, tmp_path, "--progress-interval", "0.5")
    first = proc.wait_for(
        r"progress: round 1, step (\d+), [\d.]+ steps/s, world 2 \(1 node\), restarts 0/3", 60
    )
    later = proc.wait_for(r"progress: round 1, step (\d+), ", 30, after=first.end())
    assert int(later.group(1)) > int(first.group(1)), "the step advances from one line to the next"
    assert proc.wait(60) == 0


@pytest.mark.slow
def test_quiet_prints_no_progress_line(launch, tmp_path: Path):  # noqa: F811
    proc = run_stepper(launch, tmp_path, "--progress-interval", "0.2", "--quiet")
    assert proc.wait(60) == 0
    assert "job succeeded" in proc.output(), "the agent ran its round"
    assert not re.search(r"progress: ", proc.output())
