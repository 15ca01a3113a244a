"""Platforms from their environment, end to end: for each platform, two real ``elastic-run`` agents (fake
nodes on this host) started with only that platform's variables (as tests/unit/agent/test_platforms.py
lists them, with its sources) and the script form one job with world size 2; the first hosts the master
(convenience mode). The other is SIGKILLed: the survivor trains on at world 1; its replacement (the same
index, a new process: a new pod or step on the platform) rejoins under the same node id, is not excluded
as flapping, and the job is at world 2 again.

On one host, the platforms' DNS names are loopback addresses (the same variables, the same shapes
otherwise), and the static platforms are given ``--nnodes 1:2`` on the command line so that the survivor
trains on (explicit flags win); JobSet and indexed Jobs, whose master is named from the pod's DNS domain,
are given ``--rdzv-endpoint`` and ``--nnodes`` (their derivation is the unit tests')."""

from __future__ import annotations

import os
import re
import signal
import uuid

import e2e
import pytest
from e2e import base_env, elastic_run_argv, free_port, train_args

launch = e2e.launch  # the fixture: every process tree a test launches is killed at its teardown

pytestmark = pytest.mark.slow

START_S = 90.0
WORLD = r"^\[rank\d\]:start rank=\d+ world={} "


def _pytorchjob_elastic(i: int, port: int, tag: str) -> tuple[dict[str, str], list[str]]:
    env = {
        "PET_RDZV_ENDPOINT": f"127.0.0.1:{port}",
        "PET_RDZV_BACKEND": "c10d",
        "PET_NNODES": "1:2",
        "PET_NPROC_PER_NODE": "1",
        "PET_RDZV_ID": f"ptj-{tag}",
        "HOSTNAME": f"ptj-{tag}-worker-{i}",
        "PYTHONUNBUFFERED": "0",
    }
    return env, []


def _pytorchjob_static(i: int, port: int, tag: str) -> tuple[dict[str, str], list[str]]:
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2", "RANK": str(i)}
    return {**env, "HOSTNAME": f"st{tag}-{'master' if i == 0 else 'worker'}-0"}, ["--nnodes", "1:2"]


def _trainjob(i: int, port: int, tag: str) -> tuple[dict[str, str], list[str]]:
    env = {
        "PET_NNODES": "2",
        "PET_NPROC_PER_NODE": "1",
        "PET_NODE_RANK": str(i),
        "PET_MASTER_ADDR": "127.0.0.1",
        "PET_MASTER_PORT": str(port),
        "JOB_COMPLETION_INDEX": str(i),
        "HOSTNAME": f"tj{tag}-node-0-{i}",
    }
    return env, ["--nnodes", "1:2"]


def _jobset(i: int, port: int, tag: str) -> tuple[dict[str, str], list[str]]:
    env = {"JOB_COMPLETION_INDEX": "0", "HOSTNAME": f"js{tag}-workers-{i}-0"}
    return env, ["--nnodes", "1:2", "--rdzv-endpoint", f"127.0.0.1:{port}"]


def _indexed_job(i: int, port: int, tag: str) -> tuple[dict[str, str], list[str]]:
    env = {"JOB_COMPLETION_INDEX": str(i), "HOSTNAME": f"ij{tag}-{i}"}
    return env, ["--nnodes", "1:2", "--rdzv-endpoint", f"127.0.0.1:{port}"]


def _slurm(i: int, port: int, tag: str) -> tuple[dict[str, str], list[str]]:
    env = {
        "SLURM_JOB_ID": tag,
        "SLURM_JOB_NODELIST": "127.0.0.1",
        "SLURM_NNODES": "2",
        "SLURM_NODEID": str(i),
        "SLURM_PROCID": str(i),
        "SLURM_LOCALID": "0",
        "MASTER_PORT": str(port),
    }
    return env, ["--nnodes", "1:2"]


def _skypilot(i: int, port: int, tag: str) -> tuple[dict[str, str], list[str]]:
    env = {
        "SKYPILOT_NODE_RANK": str(i),
        "SKYPILOT_NODE_IPS": "127.0.0.1\n127.0.0.1\n",
        "SKYPILOT_NUM_NODES": "2",
        "SKYPILOT_TASK_ID": f"sky-{tag}_train_1",
        "MASTER_PORT": str(port),
    }
    return env, ["--nnodes", "1:2"]


PLATFORMS = {
    "PyTorchJob (Kubeflow training-operator v1, elastic)": _pytorchjob_elastic,
    "PyTorchJob (Kubeflow training-operator v1, static)": _pytorchjob_static,
    "TrainJob (Kubeflow Trainer v2)": _trainjob,
    "JobSet": _jobset,
    "indexed Job": _indexed_job,
    "SLURM (srun)": _slurm,
    "SkyPilot": _skypilot,
}


@pytest.mark.timeout(400)
@pytest.mark.parametrize("platform", list(PLATFORMS), ids=lambda p: p.split(" (")[0] + p[-8:])
def test_two_agents_from_the_platforms_environment_form_one_job_survive_a_loss_and_take_back_the_node(
    launch, platform
):
    tag, port = uuid.uuid4().hex[:8], free_port()
    script = train_args(steps=100000, step_time=0.1, ckpt_every=1000)

    def agent(i: int, name: str):
        variables, flags = PLATFORMS[platform](i, port, tag)
        env = base_env(**variables)
        env.pop("ELASTIC_TOKEN", None)  # on loopback the job's derived token is enough
        return launch(elastic_run_argv("--no-warm-start", *flags, *script), name, env)

    first = agent(0, "node0")
    first.wait_for(rf"platform {re.escape(platform)}: ", START_S)
    first.wait_for(r"this agent hosts it \(convenience mode", START_S)
    second = agent(1, "node1")
    for proc in (first, second):
        proc.wait_for(WORLD.format(2), START_S)
    node_id = second.wait_for(r"node-id (\S+?)[;,]", 10).group(1)

    # The loss of the second node: the first (and the master it hosts) trains on at world 1.
    offset = len(first.output())
    os.killpg(second.pid, signal.SIGKILL)
    second.wait(30)
    first.wait_for(WORLD.format(1), START_S, after=offset)
    first.wait_for(r"^\[rank0\]:step=\d+ loss=\S+ world=1$", START_S, after=offset)

    # Its replacement: the same index, so the same node id; taken back, not excluded for flapping.
    offset = len(first.output())
    back = agent(1, "node1-replacement")
    assert back.wait_for(r"node-id (\S+?)[;,]", START_S).group(1) == node_id
    back.wait_for(WORLD.format(2), START_S)
    first.wait_for(WORLD.format(2), START_S, after=offset)
    assert "flapping" not in first.output()[offset:] and back.popen.poll() is None
