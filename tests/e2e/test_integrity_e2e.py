"""The integrity guard end to end: ``elastic-run --standalone --nproc-per-node 3`` (a real agent, master
and gloo workers of tests/support/integrity_train.py under ``elastic.run``). A bit flipped in one rank's
weights and a one-shot NaN in one rank's gradient are each detected at their step, the rank is named,
every rank rolls back in process to the newest verified step, and the final weights are bitwise those of
a run without the fault; every sample of the surviving lineage is trained exactly once. A spike that recurs
at the same step after the rollback reaches the master (events ``integrity_detected``,
``integrity_rolled_back``) and stops the job for good: elastic-run exits 3 naming the step and its
samples."""

from __future__ import annotations

import re
from pathlib import Path

import e2e
import pytest
import torch
from e2e import REPO, elastic_run_argv
from multinode_cluster import EXIT_S, agent_env, assert_succeeded

launch = e2e.launch

pytestmark = pytest.mark.slow

SCRIPT = REPO / "tests" / "support" / "integrity_train.py"
STEPS = 24
DETECTED = re.compile(r"^\[rank0\]:integrity step=(\d+) kind=(\w+) ranks=([\d,]*) rollback_to=(\d+)$", re.M)


def train(launch, tmp_path: Path, name: str, fault: str = ""):
    env = agent_env()
    if fault:
        env["ELASTIC_TEST_INTEGRITY_FAULT"] = fault
    samples = tmp_path / name / "samples"
    samples.mkdir(parents=True)
    argv = elastic_run_argv(
        "--standalone", "--nproc-per-node", "3", "--quiet", str(SCRIPT), "--steps", str(STEPS),
        "--final-weights", str(tmp_path / f"{name}.pt"), "--sample-log", str(samples),
    )  # fmt: skip
    job = launch(argv, name=name, env=env)
    assert_succeeded(job)
    return job, torch.load(tmp_path / f"{name}.pt"), samples


def samples_once(folder: Path) -> bool:
    """Every step 1..STEPS logged by each rank (its newest line wins), and no index twice in an epoch."""
    per_epoch: dict[int, list[str]] = {}
    for path in folder.glob("rank*.log"):
        newest: dict[int, tuple[int, list[str]]] = {}
        for line in path.read_text().splitlines():
            step_text, epoch_text, *rows = line.split()
            newest[int(step_text)] = (int(epoch_text), rows)
        if sorted(newest) != list(range(1, STEPS + 1)):
            return False
        for epoch, rows in newest.values():
            per_epoch.setdefault(epoch, []).extend(rows)
    return all(len(rows) == len(set(rows)) for rows in per_epoch.values())


def bitwise_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture
def clean(launch, tmp_path):
    job, weights, samples = train(launch, tmp_path, "clean")
    assert not DETECTED.search(job.output()), "a fault-free run had a detection"
    assert samples_once(samples)
    return weights


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    ("fault", "kind", "named", "rolled_back_to"),
    [("flip:12:1:30", "mismatch", "1", 11), ("nan:9:2", "non_finite", "2", 8)],
    ids=["bit_flip", "nan_gradient"],
)
def test_a_one_shot_fault_is_named_rolled_back_and_ends_bitwise_equal(
    launch, tmp_path, clean, fault, kind, named, rolled_back_to
):
    job, weights, samples = train(launch, tmp_path, "faulty", fault)
    found = DETECTED.findall(job.output())
    step = int(fault.split(":")[1])
    assert found == [(str(step), kind, named, str(rolled_back_to))], job.output()[-3000:]  # within 1 step
    assert job.output().count("integrity rollback in process") == 3, "every rank rolled back, in process"
    assert bitwise_equal(weights, clean)
    assert samples_once(samples)


@pytest.mark.timeout(180)
def test_a_spike_that_recurs_after_the_rollback_stops_the_job_for_good_with_exit_3(launch, tmp_path):
    env = agent_env()
    env["ELASTIC_TEST_INTEGRITY_FAULT"] = "spikeall:22"  # past the spike rule's warm-up of 20 losses
    argv = elastic_run_argv("--standalone", "--nproc-per-node", "2", str(SCRIPT), "--steps", str(STEPS))
    job = launch(argv, name="recurring", env=env)
    code = job.wait(EXIT_S)
    out = job.output()
    assert code == 3, f"exited {code}:\n{out[-4000:]}"
    assert DETECTED.findall(out) == [("22", "spike", "", "20"), ("22", "spike", "", "20")], out[-3000:]
    assert out.count("integrity rollback in process") == 2, "one rollback on every rank, then the stop"
    # The master's events (its log lines: "KIND: message") and the job's final line.
    assert re.search(r"integrity_detected: integrity: step 22: a loss spike$", out, re.M), out[-3000:]
    assert re.search(r"integrity_rolled_back: integrity: rolled back in process to verified step 20", out)
    assert re.search(r"recurring integrity fault\): step 22: a loss spike recurred .*samples \[\d+", out)
