"""elastic-run under SLURM: the recipe (deploy/slurm/elastic-run.sbatch) on a real two-node SLURM cluster
(tests/support/slurm_cluster.py: Debian's slurm-wlm 22.05, one slurmctld and two slurmd on this machine),
pre-empted, requeued and resumed, then one node drained; and the pre-emption signal without SLURM.

The SLURM test also keeps tests/data/slurm_env_22.05.txt true: the SLURM variables of one srun task of the
recipe (node 0's, first run; the worker's environment, which is the agent's, filtered to ``SLURM*``). With
``ELASTIC_RECORD_SLURM_ENV=1`` it writes the file; otherwise it checks that the live task sees the same
variable names (values differ per run: job id, ports, folders).
"""

from __future__ import annotations

import datetime
import json
import os
import re
import shutil
import signal
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import e2e
import pytest
from e2e import SHM, TRAIN_SCRIPT, base_env, elastic_run_argv, free_port, unique_job, wait_until
from slurm_cluster import SlurmCluster, require_slurm

from agent.executor.slurm_state import DEFAULT_TTL_S

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "deploy" / "slurm" / "elastic-run.sbatch"
RECORDED_ENV = REPO / "tests" / "data" / "slurm_env_22.05.txt"

STEPS = 30
STEP_TIME_S = 0.3
CKPT_EVERY = 2  # the agents persist steps 2, 4, ...: step 3 reaches the disk only through the pre-emption
HOLD_AT = 3  # the first run's workers wait after step 3, so that the pre-emption finds them there
DRAIN_AT = 12  # the second run: drain n2, then fail a worker on n1, once rank 0 logged this step
# The agents read SLURM's state when they join; their cache must have expired when the drain is ordered,
# or the round after the failure would not see it. Steps HOLD_AT+1..DRAIN_AT run after that join.
assert (DRAIN_AT - HOLD_AT) * STEP_TIME_S > DEFAULT_TTL_S + 0.5
LAST_CALL_S = 10  # both agents join the first round of each run (zygotes import torch meanwhile)
#: Bounds for a loaded 2-core machine: a run's agents start and train their first steps (each imports
#: torch), a job reacts to SLURM (a requeue, a release), a run ends once its last phase began.
START_S = 90.0
SLURM_S = 60.0

launch = e2e.launch  # the fixture: starts processes, kills their trees at teardown
jobs = e2e.jobs  # the fixture: removes the shared-memory folders of the test's jobs


def events_of(text: str) -> list[dict]:
    """The agents' events (``--event-log-handler console``) in the job's output, in order."""
    marker = "[elastic.events] "
    return [json.loads(line.split(marker, 1)[1]) for line in text.splitlines() if marker in line]


def node_env(run_dir: Path, node: str) -> dict[str, str]:
    """The SLURM variables of the worker on ``node`` (its ``--dump-env`` file: ranks follow the join order,
    not SLURM's node ids)."""
    for dump in sorted(run_dir.glob("env-*.json")):
        env = json.loads(dump.read_text())
        if env.get("SLURMD_NODENAME") == node:
            return {k: v for k, v in sorted(env.items()) if k.startswith("SLURM")}
    raise AssertionError(f"no worker environment of node {node} in {run_dir}")


@pytest.fixture
def slurm() -> Iterator[SlurmCluster]:
    """A started two-node cluster; stopped by PID, with whatever its jobs left, at teardown."""
    require_slurm()
    cluster = SlurmCluster()
    try:
        yield cluster.start()
    finally:
        cluster.stop()
        prefixes = (f"elastic-{cluster.first_job_id}", f"elastic-unpersisted-{cluster.first_job_id}")
        for folder in SHM.iterdir():
            if folder.name.startswith(prefixes):
                shutil.rmtree(folder, ignore_errors=True)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_slurm_job_is_preempted_requeued_resumed_and_a_drained_node_refused(slurm: SlurmCluster) -> None:
    run_dir = slurm.base / "run"
    run_dir.mkdir()
    env = base_env(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.update(slurm.env())
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])  # elastic-*
    env.update(
        ELASTIC_PORT=str(free_port()),
        ELASTIC_RUN_DIR=str(run_dir),
        ELASTIC_NPROC="1",
        ELASTIC_MASTER_ARGS=f"--last-call {LAST_CALL_S}",
        ELASTIC_RUN_ARGS="--event-log-handler console",
    )
    script = [str(TRAIN_SCRIPT), "--steps", str(STEPS), "--step-time", str(STEP_TIME_S)]
    script += ["--ckpt-every", str(CKPT_EVERY), "--hold-at-step", str(HOLD_AT), "--batch-size", "32"]
    script += ["--dump-env", str(run_dir / "env-{rank}.json")]
    sbatch = ["sbatch", "--parsable", "--nodes=2", f"--chdir={run_dir}", str(RECIPE), *script]
    job = int(slurm.run(*sbatch, env=env).strip())
    out_file = run_dir / f"elastic-run-{job}.out"

    def out() -> str:
        return out_file.read_text(errors="replace") if out_file.exists() else ""

    def failure(what: str) -> str:
        logs = "\n".join(f"--- {name}:\n{slurm.log(name)[-1500:]}" for name in ("ctld", "d-n1", "d-n2"))
        return f"{what}\n--- job output:\n{out()[-6000:]}\n{logs}"

    def wait_job(until: Callable[[dict[str, str]], object], what: str, timeout: float = START_S) -> None:
        """Wait until ``until(job's fields)``; fail at once, with the logs, when the job ended otherwise."""

        def check() -> object:
            fields = slurm.job(job)
            if fields["JobState"] in ("FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL") and not until(fields):
                raise AssertionError(failure(f"job {job} {fields['JobState']} while waiting for {what}"))
            return until(fields)

        try:
            wait_until(check, timeout, what, interval=0.2)
        except AssertionError as exc:
            raise AssertionError(failure(str(exc))) from None

    def logged(pattern: str) -> Callable[[dict[str, str]], object]:
        return lambda fields: re.search(pattern, out(), re.M)

    # -- first run: both nodes train to step 3, then SLURM's pre-emption warning --------------------------
    wait_job(logged(rf"^\[rank0\]:step={HOLD_AT} "), f"step {HOLD_AT} of the first run")
    first_env = node_env(run_dir, "n1")
    # As --signal=USR1@90 does at the time limit: the job's steps (every srun task), not the batch shell.
    slurm.run("scancel", "--signal=USR1", str(job))
    held = "the job requeued and held for its begin time"
    wait_job(lambda j: j["JobState"] == "PENDING" and j["Reason"] == "BeginTime", held, SLURM_S)
    requeued, text = slurm.job(job), out()
    assert requeued["Restarts"] == "1", requeued
    assert len(re.findall(r"pre-empted \(SIGUSR1\): workers stopped", text)) == 2, failure("two pre-empted")
    assert re.search(r"srun: error: n1: task 0: Exited with exit code 1$", text, re.M), failure("n1 exit")
    assert re.search(r"srun: error: n2: task 1: Exited with exit code 1$", text, re.M), failure("n2 exit")
    assert "agents exited 1, job outcome none: exit 1" in text, failure("the batch shell went on")
    assert f"requeueing job {job} (run 1 of at most 10)" in text
    # The newest flash step (3) is on disk: the periodic persists stopped at step 2.
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == f"step_{HOLD_AT:010d}.pt"

    assert first_env["SLURM_NODEID"] == "0" and first_env["SLURMD_NODENAME"] == "n1", first_env
    assert first_env["SLURM_JOB_ID"] == str(job) and first_env["SLURM_JOB_NODELIST"] == "n[1-2]"
    assert "SLURM_RESTART_COUNT" not in first_env
    if os.environ.get("ELASTIC_RECORD_SLURM_ENV") == "1":
        RECORDED_ENV.write_text("".join(f"{k}={v}\n" for k, v in first_env.items()))
    recorded = dict(line.split("=", 1) for line in RECORDED_ENV.read_text().splitlines())
    assert set(first_env) == set(recorded), (
        "SLURM's task environment changed: record it again with ELASTIC_RECORD_SLURM_ENV=1",
        set(first_env) ^ set(recorded),
    )

    # -- the requeued run: released early (not after SLURM's 120 s), it resumes from step 3 ---------------
    # Not within the second of the requeue: slurmd compares job credentials to the requeue's revocation
    # with one-second resolution, and refuses a launch in that second ("Job N already killed"): the job
    # would fail. (SubmitTime is the requeue's time, in whole seconds.)
    requeued_at = datetime.datetime.fromisoformat(requeued["SubmitTime"])
    later = requeued_at + datetime.timedelta(seconds=2)
    wait_until(lambda: datetime.datetime.now() >= later, SLURM_S, "two seconds past the requeue's")
    wait_until(lambda: set(slurm.node_states().values()) == {"idle"}, SLURM_S, "the nodes idle again")
    slurm.run("scontrol", "update", f"JobId={job}", "StartTime=now")
    begin = len(out())
    wait_job(logged(rf"^\[rank0\]:step={DRAIN_AT} "), f"step {DRAIN_AT} of the rerun")
    assert re.search(
        rf"^\[rank0\]:start rank=0 world=2 restart=0 resumed_step={HOLD_AT}$", out()[begin:], re.M
    )
    assert node_env(run_dir, "n1")["SLURM_RESTART_COUNT"] == "1"

    # -- drain n2 while it trains; a worker failure on n1 opens the next round, which n2 must not join -----
    slurm.run("scontrol", "update", "NodeName=n2", "State=DRAIN", "Reason=elastic-e2e")
    assert slurm.node_states()["n2"] == "draining"
    started = [e for e in events_of(out()[begin:]) if e["name"] == "workers_started" and e["node_id"] == "n1"]
    last_step = max(int(s) for s in re.findall(r"^\[rank0\]:step=(\d+) ", out(), re.M))
    os.kill(started[-1]["pids"][0], signal.SIGKILL)
    wait_job(lambda j: j["JobState"] == "COMPLETED", "the job completed")
    text = out()[begin:]
    assert slurm.job(job)["ExitCode"] == "0:0"
    refused = "SLURM reports node n2 draining (sinfo): this node does not join the next round"
    assert f"elastic-run: error: {refused}" in text, failure("n2 refused")
    assert re.search(r"srun: error: n2: task 1: Exited with exit code 4$", text, re.M), failure("n2 exit 4")
    # The failure followed n2's loss: the master may leave it uncharged (restart 0).
    resumed = re.search(r"^\[rank0\]:start rank=0 world=1 restart=\d resumed_step=(\d+)$", text, re.M)
    assert resumed and int(resumed.group(1)) >= last_step, failure("n1 alone resumes where it was")
    assert re.search(rf"^\[rank0\]:done step={STEPS}$", text, re.M)
    assert "agents exited 4, job outcome 0: exit 0" in text, failure("the job's outcome is the master's")
    node_left = [
        event
        for event in map(json.loads, (run_dir / "master-events-1.jsonl").read_text().splitlines())
        if event["kind"] == "node_left" and event["node"] == "n2"
    ]
    assert [event["message"] for event in node_left] == [f"node n2 left ({refused})"]  # where operators look


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_sigusr1_stops_persists_the_newest_step_and_exits_1(launch, tmp_path: Path, jobs: list[str]) -> None:
    """Without SLURM: the agent handles the pre-emption signal itself. Before, SIGUSR1's default action
    killed it (exit -10) with the newest step only in memory. The node is named as under SLURM
    (SLURMD_NODENAME) but no sinfo is on PATH: the drain check fails open, with a warning."""
    job = unique_job("preempt")
    jobs.append(job)
    ckpt = tmp_path / "ckpt"
    env = base_env(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", SLURMD_NODENAME="n9")
    env["PATH"] = str(Path(sys.executable).parent)  # python and elastic-run, no sinfo
    script = [str(TRAIN_SCRIPT), "--steps", "50", "--ckpt-every", str(CKPT_EVERY), "--batch-size", "32"]
    argv = elastic_run_argv("--standalone", "--rdzv-id", job, "--ckpt-dir", str(ckpt), *script)
    proc = launch([*argv, "--hold-at-step", str(HOLD_AT)], name="agent", env=env)
    proc.wait_for(rf"^\[rank0\]:step={HOLD_AT} ", START_S)
    os.kill(proc.pid, signal.SIGUSR1)
    assert proc.wait(START_S) == 1, proc.output()[-4000:]
    out = proc.output()
    assert "cannot read SLURM's state of node n9: sinfo is not installed; joining anyway" in out
    assert "pre-empted (SIGUSR1): workers stopped" in out
    assert (ckpt / "latest").read_text().strip() == f"step_{HOLD_AT:010d}.pt"
