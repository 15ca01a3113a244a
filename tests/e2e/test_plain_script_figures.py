"""The master's step-based figures for an unmodified torchrun-style script (tests/support/plain_ddp.py: DDP,
gloo, no ``import elastic``): progress comes only from the optimizer-step hook elastic-run installs
(elastic.autoprogress). After a worker SIGKILL under a real ``elastic-master``, its ``/metrics`` shows one
restart, an observation in every recovery phase and a goodput strictly between 0 and 1."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import e2e
import httpx
import pytest
from e2e import wait_until
from multinode_cluster import START_S, TOKEN, assert_succeeded, start_cluster
from prometheus_client.parser import text_string_to_metric_families

from elastic.control.protocol import JOB_HEADER
from master.job.accounting import PHASES

launch = e2e.launch  # the fixture

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).resolve().parents[1] / "support" / "plain_ddp.py"


def metrics(address: str, job_id: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """The master's ``/metrics``: ``{(sample name, sorted labels without job_id): value}``."""
    headers = {"Authorization": f"Bearer {TOKEN}", JOB_HEADER: job_id}
    text = httpx.get(f"http://{address}/metrics", headers=headers, timeout=10, trust_env=False).text
    return {
        (s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "job_id"))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def observed_phases(samples: dict) -> dict[str, float]:
    """Observations of each recovery phase (any cause)."""
    counts: dict[str, float] = {}
    for (name, labels), value in samples.items():
        if name == "elastic_recovery_seconds_count":
            phase = dict(labels)["phase"]
            counts[phase] = counts.get(phase, 0.0) + value
    return counts


@pytest.mark.timeout(300)
def test_a_worker_sigkill_in_an_unmodified_script_shows_a_restart_every_phase_and_a_goodput(launch, tmp_path):
    cluster = start_cluster(launch, tmp_path, "1:1")
    agent = cluster.agent("node-a", [str(SCRIPT), "300"])
    agent.wait_for(r"^\[rank0\]:step=40 rank=0 restart=0$", START_S)
    before = metrics(cluster.address, cluster.job_id)
    assert 0 < before[("elastic_goodput_ratio", ())] <= 1, "training: goodput measured from the hook's steps"
    (worker,) = agent.worker_pids("plain_ddp.py")
    os.kill(worker, signal.SIGKILL)
    agent.wait_for(r"^\[rank0\]:step=20 rank=0 restart=1$", START_S)
    after = wait_until(
        lambda: (
            (m := metrics(cluster.address, cluster.job_id))
            and all(observed_phases(m).get(p, 0) >= 1 for p in PHASES)
            and m
        ),
        START_S,
        "every recovery phase observed",
    )
    assert after[("elastic_restarts_total", ())] == 1, after
    assert set(observed_phases(after)) >= set(PHASES) and all(observed_phases(after)[p] == 1 for p in PHASES)
    assert 0 < after[("elastic_goodput_ratio", ())] < 1, after
    assert_succeeded(agent)
