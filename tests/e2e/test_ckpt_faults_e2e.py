"""Faults on the flash-checkpoint path, end to end: real agents (``python -m agent``), a real master and
real workers (tests/support/ckpt_loop_worker.py, which saves with ``elastic.save`` in a loop).

* workers killed by SIGTERM in the middle of saving a 256 MiB state leave no temp file in the agent's
  shared memory once the workers restarted;
* checkpoint reports of 8 ranks all reach an agent that was stopped (SIGSTOP) for 2 s, and the last
  save is on disk when the job ends;
* a full disk during a persist (a tiny tmpfs in the agent's private mount namespace) shows in
  ``elastic-master status`` within a heartbeat, with the error; the agent then exits 1 (its newest
  checkpoint is not on disk) and keeps the shared-memory copy, saying where.

Waiting is polling with a deadline; the e2e harness kills every process tree it started; each test checks
that no shared-memory folder of its job is left.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import e2e
import httpx
import pytest
from e2e import (
    SHM,
    SUPPORT,
    base_env,
    elastic_master_argv,
    elastic_run_argv,
    shm_folders,
    unique_job,
    wait_until,
)
from tools import require_tool

from agent.checkpoints.shm_folder import folder_name
from elastic.checkpoint import layout
from elastic.control.protocol import API_PREFIX, JOB_HEADER

launch = e2e.launch  # the fixture: starts processes, kills their trees at teardown
jobs = e2e.jobs  # the fixture: removes the shared-memory folders of the test's jobs

WORKER = SUPPORT / "ckpt_loop_worker.py"
RUN_TIMEOUT_S = 150  # other suites share the 2 cores; each torch worker takes seconds to start
HEARTBEAT_S = 0.5
#: Time for the test to notice things on a loaded 2-core machine (log polling, an HTTP round trip).
SLACK_S = 1.0
KEEPER_SUMMARY = r"checkpoint keeper: (\d+) persist requests, (\d+) persisted"


def temp_files(folder: Path) -> list[Path]:
    with contextlib.suppress(FileNotFoundError):
        return [p for p in folder.iterdir() if p.name.endswith(layout.TMP_SUFFIX)]
    return []


def standalone(job: str, nproc: int, *args: str) -> list[str]:
    agent = ["--standalone", "--rdzv-id", job, "--node-id", "n1", "--nproc-per-node", str(nproc)]
    return elastic_run_argv(*agent, "--max-restarts", "5", "--stop-grace", "2", *args)


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_three_sigterms_during_saves_of_256_mib_leave_no_temp_file_in_memory(launch, jobs, tmp_path) -> None:
    job = unique_job("sweep")
    jobs.append(job)
    stop = tmp_path / "stop"
    script = [str(WORKER), "--stop-file", str(stop), "--size-mib", "256", "--idle-from-restart", "3"]
    proc = launch(standalone(job, 1, *script), name="agent")
    memory = SHM / folder_name(job, "n1")

    offset = 0
    for restart in range(3):
        start = proc.wait_for(rf"^\[rank0\]:start restart={restart} pid=(\d+)$", RUN_TIMEOUT_S, after=offset)
        pid = int(start.group(1))

        def saving(pid: int = pid) -> bool:
            names = [layout.parse_temp_name(p.name) for p in temp_files(memory)]
            return any(name is not None and name.pid == pid for name in names)

        wait_until(saving, RUN_TIMEOUT_S, f"worker {pid} to be saving", interval=0.002)
        os.kill(pid, signal.SIGTERM)  # mid-save: its temp file stays behind
        offset = start.end()

    proc.wait_for(r"^\[rank0\]:idle$", RUN_TIMEOUT_S, after=offset)
    assert temp_files(memory) == [], "a killed writer's temp file is left in shared memory"
    reclaimed = re.findall(
        r"removed temp files of killed writes from \S+: ([\d.]+) MiB reclaimed", proc.output()
    )
    assert reclaimed and sum(map(float, reclaimed)) > 0, proc.output()[-4000:]
    stop.touch()
    assert proc.wait(RUN_TIMEOUT_S) == 0, proc.output()[-4000:]
    assert shm_folders(job) == []


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_checkpoint_reports_of_8_ranks_survive_a_stopped_agent_and_the_last_save_reaches_the_disk(
    launch, jobs, tmp_path
) -> None:
    job = unique_job("reliable")
    jobs.append(job)
    ckpt, stop = tmp_path / "ckpt", tmp_path / "stop"
    script = [str(WORKER), "--stop-file", str(stop), "--persist", "--step-time", "0.02"]
    # The embedded master lives in the stopped agent: a heartbeat timeout well above the stop.
    proc = launch(
        standalone(job, 8, "--heartbeat-timeout", "30", "--ckpt-dir", str(ckpt), *script), name="agent"
    )
    memory = SHM / folder_name(job, "n1")
    wait_until(
        lambda: len(re.findall(r"^\[rank\d\]:start ", proc.output(), re.M)) == 8, RUN_TIMEOUT_S, "8 ranks"
    )
    wait_until(lambda: len(layout.checkpoint_files(memory)) > 0, RUN_TIMEOUT_S, "the first save")

    # The fault under test: the agent stays stopped for 2 s while the ranks save (the sleeps are its
    # timeline); halfway, the ranks are told to make their last save, which they do during the stop
    # unless their reports wait for the agent.
    os.kill(proc.pid, signal.SIGSTOP)
    try:
        time.sleep(1.0)
        stop.touch()
        time.sleep(1.0)
    finally:
        os.kill(proc.pid, signal.SIGCONT)

    assert proc.wait(RUN_TIMEOUT_S) == 0, proc.output()[-4000:]
    out = proc.output()
    last = int(re.search(r"^\[rank0\]:saved last_step=(\d+)$", out, re.M).group(1))  # type: ignore[union-attr]
    requests = int(re.search(KEEPER_SUMMARY, out).group(1))  # type: ignore[union-attr]
    assert requests == last, f"{last - requests} of {last} persist requests were lost"
    assert "took no checkpoint report" not in out
    assert (ckpt / "latest").read_text() == layout.step_file_name(last)
    assert shm_folders(job) == []


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_full_disk_during_a_persist_shows_in_master_status_within_a_heartbeat(
    launch, jobs, tmp_path
) -> None:
    unshare = require_tool("unshare")
    job = unique_job("full")
    jobs.append(job)
    token = tmp_path / "tok"
    token.write_text("full-disk-test-token\n")
    master_args = ["--host", "127.0.0.1", "--port", "0", "--job-id", job, "--token-file", str(token)]
    timing = ["--heartbeat-interval", str(HEARTBEAT_S), "--heartbeat-timeout", "10"]
    master = launch(elastic_master_argv(*master_args, *timing), name="master")
    address = "127.0.0.1:" + master.wait_for(r"listening on 127\.0\.0\.1:(\d+)", RUN_TIMEOUT_S).group(1)
    ckpt, stop = tmp_path / "ckpt", tmp_path / "stop"
    ckpt.mkdir()
    agent_args = ["--master", address, "--job-id", job, "--token-file", str(token), "--node-id", "n1"]
    script = [str(WORKER), "--stop-file", str(stop), "--persist", "--size-mib", "1", "--step-time", "0.2"]
    # The agent's --ckpt-dir is a 64 KiB tmpfs, mounted in a mount namespace of its own (we run as root).
    mount = 'mount -t tmpfs -o size=64k tmpfs "$0" && exec "$@"'
    agent = launch(
        [unshare, "--mount", "--propagation", "private", "--", "sh", "-c", mount, str(ckpt)]
        + elastic_run_argv(*agent_args, "--ckpt-dir", str(ckpt), "--stop-grace", "2", *script),
        name="agent",
    )
    headers = {"Authorization": "Bearer full-disk-test-token", JOB_HEADER: job}

    def persist_error() -> str:
        nodes = httpx.get(f"http://{address}{API_PREFIX}/status", headers=headers, timeout=5).json()["nodes"]
        return nodes[0]["persist_error"] if nodes else ""

    agent.wait_for(r"could not persist the checkpoint of step \d+ .*No space left on device", RUN_TIMEOUT_S)
    failed_at = time.monotonic()
    error = wait_until(persist_error, HEARTBEAT_S + 10, "the error in the master's status", interval=0.05)
    took = time.monotonic() - failed_at
    assert took <= HEARTBEAT_S + SLACK_S, f"the error showed {took:.2f}s after the failure"
    assert re.fullmatch(rf"step \d+ to {re.escape(str(ckpt))}: \[Errno 28\] No space left on device.*", error)

    argv = elastic_master_argv("status", "--master", address, "--job-id", job, "--token-file", str(token))
    table = subprocess.run(argv, capture_output=True, text=True, env=base_env(), timeout=60)
    assert table.returncode == 0, table.stderr
    assert re.search(
        r"^persist error on node n1 \(on disk: step -\): step \d+ to .*No space left", table.stdout, re.M
    )
    master.wait_for(r"persist_failed: node n1: checkpoint persist failed: step \d+ .*No space left", 10)

    stop.touch()
    assert agent.wait(RUN_TIMEOUT_S) == 1, agent.output()[-4000:]  # retryable: the newest step is not on disk
    assert re.search(
        r"^elastic-run: the checkpoint of step \d+ is not on disk .* its copy is kept in ",
        agent.output(),
        re.M,
    )
    kept = [p for p in SHM.iterdir() if p.name.startswith(f"elastic-unpersisted-{job}-")]
    assert len(kept) == 1, kept
    shutil.rmtree(kept[0])
    assert shm_folders(job) == []
