"""The pure platform resolver (agent.cli.platforms): each platform's variables, exactly as that platform
sets them for two pods or nodes, give the job's settings; explicit flags win; incomplete variables are one
line. Each fixture names the platform version and the source the variables were read from."""

from __future__ import annotations

import pytest

from agent.cli import platforms
from agent.cli.platforms import Platform, PlatformError, apply, detect, expand_nodelist, start_line

# Kubeflow training-operator v1.7+ (kubeflow.org/v1), PyTorchJob with elasticPolicy {minReplicas 1,
# maxReplicas 2, nProcPerNode 2, rdzvBackend c10d}; pkg/controller.v1/pytorch/elastic.go (generateEnv*:
# PET_RDZV_ENDPOINT = <job>-worker-0:<port of the "pytorchjob-port" container port>) and envvar.go
# (PYTHONUNBUFFERED); pod host names <job>-worker-<index> (genGeneralName).
PYTORCHJOB_ELASTIC = {
    "PYTHONUNBUFFERED": "0",
    "PET_RDZV_ENDPOINT": "bert-worker-0:23456",
    "PET_RDZV_BACKEND": "c10d",
    "PET_NNODES": "1:2",
    "PET_NPROC_PER_NODE": "2",
    "PET_MAX_RESTARTS": "3",
    "KUBERNETES_SERVICE_HOST": "10.96.0.1",
}

# Kubeflow training-operator v1 (kubeflow.org/v1), PyTorchJob with a Master replica and one Worker replica,
# no elasticPolicy; pkg/controller.v1/pytorch/master.go (MASTER_ADDR = <job>-master-0, MASTER_PORT = the
# master's container port) and envvar.go (WORLD_SIZE = every replica type's replicas, RANK = index, +1 for a
# worker).
PYTORCHJOB_STATIC = {
    "PYTHONUNBUFFERED": "0",
    "MASTER_ADDR": "resnet-master-0",
    "MASTER_PORT": "23456",
    "WORLD_SIZE": "2",
    "RANK": "1",
}

# Kubeflow Trainer v2 (trainer.kubeflow.org/v1alpha1), TrainJob "llm" with numNodes 2, numProcPerNode 4;
# pkg/runtime/framework/plugins/torch/torch.go (EnforceMLPolicy: PET_NNODES, PET_NPROC_PER_NODE,
# PET_NODE_RANK from the Job completion index, PET_MASTER_ADDR = <job>-node-0-0.<job>, PET_MASTER_PORT =
# 29400); the pod is JobSet's, host name <job>-node-<jobIndex>-<podIndex>.
TRAINJOB = {
    "PET_NNODES": "2",
    "PET_NPROC_PER_NODE": "4",
    "PET_NODE_RANK": "1",
    "PET_MASTER_ADDR": "llm-node-0-0.llm",
    "PET_MASTER_PORT": "29400",
    "JOB_COMPLETION_INDEX": "1",
    "HOSTNAME": "llm-node-0-1",
}

# JobSet v0.8 (jobset.x-k8s.io/v1alpha2), JobSet "train", replicatedJob "workers" with replicas 2 and
# parallelism 1; api/jobset/v1alpha2/jobset_types.go (labels jobset-name, replicatedjob-name, job-index) and
# the pod host names <jobset>-<replicatedJob>-<jobIndex>-<podIndex> with subdomain <jobset>
# (network.enableDNSHostnames); JOB_COMPLETION_INDEX from the indexed Job (Kubernetes 1.22+, KEP-2214).
JOBSET = {"JOB_COMPLETION_INDEX": "0", "HOSTNAME": "train-workers-1-0"}
JOBSET_FQDN = "train-workers-1-0.train.default.svc.cluster.local"

# Kubernetes batch/v1 Job with completionMode Indexed, completions 2, subdomain "svc" (docs: "Job with
# Pod-to-Pod Communication": host names ${jobName}-${completionIndex}).
INDEXED_JOB = {"JOB_COMPLETION_INDEX": "1", "HOSTNAME": "sim-1"}
INDEXED_FQDN = "sim-1.svc.default.svc.cluster.local"

# Slurm 23.02 srun(1), OUTPUT ENVIRONMENT VARIABLES, for `srun --nodes 2 --ntasks-per-node 1` inside
# `sbatch --nodes 2` (a requeued job: SLURM_RESTART_COUNT).
SLURM = {
    "SLURM_JOB_ID": "4242",
    "SLURM_JOB_NODELIST": "gpu[07-08]",
    "SLURM_NNODES": "2",
    "SLURM_NODEID": "1",
    "SLURM_PROCID": "1",
    "SLURM_LOCALID": "0",
    "SLURM_NTASKS": "2",
    "SLURM_RESTART_COUNT": "1",
    "SLURMD_NODENAME": "gpu08",
}

# SkyPilot v0.9 (docs.skypilot.co, running-jobs/environment-variables: "SkyPilot environment variables"),
# num_nodes 2 with accelerators A100:8, a managed job (SKYPILOT_TASK_ID stays across recoveries).
SKYPILOT = {
    "SKYPILOT_NODE_RANK": "1",
    "SKYPILOT_NODE_IPS": "10.0.0.5\n10.0.0.6\n",
    "SKYPILOT_NUM_NODES": "2",
    "SKYPILOT_NUM_GPUS_PER_NODE": "8",
    "SKYPILOT_TASK_ID": "sky-managed-2024-01-01-00-00-00-000001_my-job_1",
}


def test_pytorchjob_elastic_takes_the_rendezvous_and_node_count_and_the_pod_name():
    found = detect(PYTORCHJOB_ELASTIC, hostname="bert-worker-1")
    assert found is not None and found.name.startswith("PyTorchJob") and "elastic" in found.name
    assert found.values == {
        "rdzv_endpoint": "bert-worker-0:23456",
        "nproc_per_node": "2",
        "nnodes": "1:2",
        "rdzv_id": "bert",
        "node_id": "bert-worker-1",
    }
    assert set(found.used) == {"PET_RDZV_ENDPOINT", "PET_NPROC_PER_NODE", "PET_NNODES", "PET_RDZV_BACKEND"}


def test_pytorchjob_elastic_of_releases_before_1_7_spelled_nproc_with_an_extra_underscore():
    env = {k: v for k, v in PYTORCHJOB_ELASTIC.items() if k != "PET_NPROC_PER_NODE"}
    found = detect({**env, "PET_N_PROC_PER_NODE": "3", "PET_RDZV_ID": "run7"}, hostname="bert-worker-0")
    assert found is not None and found.values["nproc_per_node"] == "3" and found.values["rdzv_id"] == "run7"


def test_pytorchjob_static_counts_pods_from_world_size_never_processes():
    found = detect(PYTORCHJOB_STATIC, hostname="resnet-worker-0")
    assert found is not None and "static" in found.name
    # WORLD_SIZE=2 pods: 2 nodes; RANK is the pod's index, not any worker's rank.
    assert found.values == {
        "nnodes": "2",
        "rdzv_endpoint": "resnet-master-0:23456",
        "rdzv_id": "resnet",
        "node_id": "resnet-worker-0",
    }
    assert "pod 1 of 2" in found.notes


def test_trainjob_is_static_and_names_its_master_pod():
    found = detect(TRAINJOB)
    assert found is not None and found.name.startswith("TrainJob")
    assert found.values == {
        "nnodes": "2",
        "nproc_per_node": "4",
        "rdzv_endpoint": "llm-node-0-0.llm:29400",
        "rdzv_id": "llm",
        "node_id": "llm-node-0-1",
    }
    assert "JOB_COMPLETION_INDEX" not in found.used  # TrainJob is checked before the JobSet it runs on


def test_jobset_master_is_the_pod_whose_indexes_are_zero_in_this_pods_domain():
    found = detect(JOBSET, fqdn=JOBSET_FQDN)
    assert found is not None and found.name == "JobSet"
    assert found.values == {
        "rdzv_endpoint": "train-workers-0-0.train.default.svc.cluster.local:29400",
        "rdzv_id": "train-workers",
        "node_id": "train-workers-1-0",
    }
    assert "nnodes" not in found.values  # JobSet does not say: --nnodes or PET_NNODES
    with_count = detect({**JOBSET, "PET_NNODES": "2"}, fqdn=JOBSET_FQDN)
    assert with_count is not None and with_count.values["nnodes"] == "2"


def test_indexed_job_master_is_index_zero():
    found = detect(INDEXED_JOB, fqdn=INDEXED_FQDN)
    assert found is not None and found.name == "indexed Job"
    assert found.values["rdzv_endpoint"] == "sim-0.svc.default.svc.cluster.local:29400"
    assert found.values["node_id"] == "sim-1" and found.values["rdzv_id"] == "sim"


def test_indexed_job_with_a_host_name_of_another_shape_says_what_to_pass():
    with pytest.raises(PlatformError, match="--rdzv-endpoint"):
        detect({"JOB_COMPLETION_INDEX": "3", "HOSTNAME": "worker"})


def test_slurm_takes_the_first_host_of_the_node_list_and_the_node_id_from_the_node_rank():
    found = detect(SLURM)
    assert found is not None and found.name.startswith("SLURM")
    assert found.values == {
        "nnodes": "2",
        "rdzv_endpoint": "gpu07:29400",
        "rdzv_id": "slurm-4242",
        "node_id": "slurm-4242-node1",
    }
    assert "SLURM_RESTART_COUNT" in found.used and "requeued 1 time(s)" in found.notes


def test_slurm_looks_up_a_first_host_that_does_not_resolve_and_takes_master_port():
    asked = []

    def node_addr(name: str) -> str | None:
        asked.append(name)
        return "10.1.2.7"

    found = detect({**SLURM, "MASTER_PORT": "29511"}, node_addr=node_addr)
    assert asked == ["gpu07"]
    assert found is not None and found.values["rdzv_endpoint"] == "10.1.2.7:29511"
    assert "master on gpu07 (10.1.2.7)" in found.notes


def test_slurm_node_rank_falls_back_to_the_task_rank():
    env = {k: v for k, v in SLURM.items() if k != "SLURM_NODEID"}
    found = detect({**env, "SLURM_PROCID": "0"})
    assert found is not None and found.values["node_id"] == "slurm-4242-node0"


def test_skypilot_master_is_the_head_node_and_the_task_id_is_the_job_id():
    found = detect(SKYPILOT)
    assert found is not None and found.name == "SkyPilot"
    assert found.values == {
        "nnodes": "2",
        "rdzv_endpoint": "10.0.0.5:29400",
        "node_id": "node1",
        "rdzv_id": "sky-managed-2024-01-01-00-00-00-000001_my-job_1",
        "nproc_per_node": "8",
    }


def test_no_platform_variables_no_platform():
    assert detect({"PATH": "/bin", "HOME": "/root"}, hostname="laptop") is None


@pytest.mark.parametrize(
    ("env", "needle"),
    [
        ({**SLURM, "SLURM_NNODES": "two"}, "SLURM_NNODES='two' is not a number"),
        ({**SLURM, "SLURM_JOB_NODELIST": "gpu[07-08"}, "SLURM_JOB_NODELIST"),
        ({**TRAINJOB, "PET_NNODES": ""}, "PET_NNODES is not set"),
        ({**PYTORCHJOB_STATIC, "RANK": "-1"}, "negative"),
        ({**SKYPILOT, "SKYPILOT_NODE_IPS": "\n"}, "SKYPILOT_NODE_IPS"),
    ],
)
def test_incomplete_variables_are_one_line_naming_the_variable(env, needle):
    with pytest.raises(PlatformError) as exc:
        detect(env)
    assert needle in str(exc.value) and "\n" not in str(exc.value)


@pytest.mark.parametrize(
    ("nodelist", "hosts"),
    [
        ("n1", ["n1"]),
        ("n[1-2]", ["n1", "n2"]),
        ("gpu[07-08,10],cpu3", ["gpu07", "gpu08", "gpu10", "cpu3"]),
        ("rack[1-2]-n[1-2]", ["rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2"]),
    ],
)
def test_expand_nodelist(nodelist, hosts):
    assert expand_nodelist(nodelist) == hosts


@pytest.mark.parametrize("bad", ["", "n[1-", "n[2-1]", "n[a-b]", "n]1["])
def test_expand_nodelist_refuses_malformed_lists(bad):
    with pytest.raises(ValueError):
        expand_nodelist(bad)


OPTS = {
    "nnodes": "1:1",
    "nproc_per_node": "1",
    "rdzv_endpoint": "",
    "rdzv_id": "none",
    "node_id": None,
    "master": "",
    "master_addr": "llm-node-0-0.llm",  # click read PET_MASTER_ADDR as torchrun's --master-addr
    "master_port": 29400,
}


def test_apply_fills_what_the_command_line_did_not_give_and_clears_the_pet_master_flags():
    found = detect(TRAINJOB)
    assert found is not None
    merged = apply(OPTS, frozenset(), found)
    assert merged["nnodes"] == "2" and merged["rdzv_endpoint"] == "llm-node-0-0.llm:29400"
    assert merged["node_id"] == "llm-node-0-1" and merged["rdzv_id"] == "llm"
    assert merged["master_addr"] is None and merged["master_port"] is None


def test_explicit_flags_win_over_the_environment():
    found = detect(TRAINJOB)
    assert found is not None
    explicit = frozenset({"nnodes", "node_id"})
    merged = apply({**OPTS, "nnodes": "1:2", "node_id": "mine"}, explicit, found)
    assert merged["nnodes"] == "1:2" and merged["node_id"] == "mine"
    assert merged["nproc_per_node"] == "4"  # not given: the platform's
    line = start_line(found, merged, explicit)
    assert "given on the command line: --nnodes, --node-id" in line
    assert "nnodes 2" not in line


def test_an_explicit_master_keeps_the_platforms_endpoint_out():
    found = detect(SLURM)
    assert found is not None
    merged = apply({**OPTS, "master": "m:29400"}, frozenset({"master"}), found)
    assert merged["master"] == "m:29400" and merged["rdzv_endpoint"] == ""
    assert merged["node_id"] == "slurm-4242-node1"


def test_start_line_names_the_platform_every_value_and_every_variable():
    found = detect(SLURM)
    assert found is not None
    line = start_line(found, apply(OPTS, frozenset(), found), frozenset())
    assert line.startswith("platform SLURM (srun): nnodes 2, ")
    for part in ("rdzv-endpoint gpu07:29400", "rdzv-id slurm-4242", "node-id slurm-4242-node1"):
        assert part in line
    assert "from SLURM_JOB_ID, SLURM_NODEID, SLURM_JOB_NODELIST, SLURM_NNODES, SLURM_RESTART_COUNT" in line
    assert "\n" not in line


def test_platform_values_are_only_options_elastic_run_has():
    for env, kw in (
        (PYTORCHJOB_ELASTIC, {"hostname": "h"}),
        (PYTORCHJOB_STATIC, {"hostname": "h"}),
        (TRAINJOB, {}),
        (JOBSET, {"fqdn": JOBSET_FQDN}),
        (INDEXED_JOB, {"fqdn": INDEXED_FQDN}),
        (SLURM, {}),
        (SKYPILOT, {}),
    ):
        found = detect(env, hostname=kw.get("hostname", ""), fqdn=kw.get("fqdn", ""))
        assert isinstance(found, Platform) and set(found.values) <= set(platforms.OPTIONS)
