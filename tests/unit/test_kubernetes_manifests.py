"""The Kubernetes manifests under deploy/kubernetes/ are valid, and do what docs/kubernetes.md says they do.

Validity, for Kubernetes 1.31:

- every built-in resource with ``kubernetes_validate.validate(obj, "1.31", strict=True)``: its strict schemas
  refuse unknown fields (the package's command line only warns, and exits 0, for a kind it has no schema
  for, so the test calls the Python API and refuses any kind it cannot check);
- PyTorchJob (kubeflow.org/v1), whose schema no registry ships: its own fields against the models of the
  ``kubeflow-training`` package (unknown fields, types and required fields), every embedded pod template
  wrapped as a Pod and validated as above;
- JobSet (jobset.x-k8s.io/v1alpha2): its own fields against tests/data/jobset-v1alpha2.schema.json (derived
  from the upstream CRD, which it names with its release and commit), every embedded Job template wrapped
  as a Job and validated as above.

Behaviour: the pod failure policies follow the exit-code table, /dev/shm is a memory volume within the
pod's memory limit, the grace period leaves time for the last persist, the masters are probed on /healthz
and /readyz, and the masters and agents of each variant agree on the job id, node range and addresses.
"""

from __future__ import annotations

import copy
import functools
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click
import jsonschema  # type: ignore[import-untyped]  # no stubs in the test extra; used for validate() only
import kubernetes_validate  # type: ignore[import-untyped]  # ships no type information
import pytest
import yaml  # type: ignore[import-untyped]  # no stubs in the test extra; safe_load_all only
from kubeflow.training import models as kubeflow_models  # type: ignore[import-untyped]  # generated, untyped

from agent.cli.main import cli as run_cli
from master.cli.main import cli as master_cli

REPO = Path(__file__).resolve().parents[2]
MANIFESTS = REPO / "deploy" / "kubernetes"
DOCKERFILE = REPO / "deploy" / "Dockerfile"
JOBSET_SCHEMA = REPO / "tests" / "data" / "jobset-v1alpha2.schema.json"
K8S_VERSION = "1.31"
PYTORCHJOB_API = "kubeflow.org/v1"
JOBSET_API = "jobset.x-k8s.io/v1alpha2"
#: JobSet's rule for failure policy rule names (its API documentation; the CRD does not check it).
JOBSET_RULE_NAME = re.compile(r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$")
#: The exit-code table (docs/kubernetes.md): what a pod failure policy does with each agent exit code.
WORKER_ACTIONS = {1: "Count", 2: "FailJob", 3: "FailJob", 4: "Count", 137: "Count", 143: "Count"}
MASTER_ACTIONS = {1: "Count", 2: "FailJob", 3: "FailJob", 137: "Count", 143: "Count"}
#: The least grace an agent's pod gets to stop its workers and persist its newest checkpoint, and a
#: master's to step down (at most 2 s to save) and drain (at most 5 s).
AGENT_GRACE_S = 120
MASTER_GRACE_S = 10
#: Flags the manifests use that another change adds to the commands (the names are fixed); the check
#: holds them to the spelling, and to the command once it has them.
FIXED_ELSEWHERE = {"elastic-master": {"--exit-on-job-end"}}
COMMANDS: dict[str, click.Command] = {"elastic-run": run_cli, "elastic-master": master_cli}


class Invalid(Exception):
    """A manifest that Kubernetes (or its operator) would refuse; the message names the file and field."""


# ---------------------------------------------------------------------------------------------------------
# Loading and validating


@functools.cache
def _parsed() -> tuple[tuple[str, dict[str, Any]], ...]:
    found = []
    for path in sorted(MANIFESTS.glob("*.yaml")):
        for obj in yaml.safe_load_all(path.read_text(encoding="utf-8")):
            if obj is not None:
                found.append((path.name, obj))
    return tuple(found)


def documents() -> list[tuple[str, dict[str, Any]]]:
    """``(file name, object)`` for every YAML document under deploy/kubernetes/ (a copy: parsed once)."""
    return copy.deepcopy(list(_parsed()))


def _builtin(obj: dict[str, Any], where: str) -> None:
    try:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
    except kubernetes_validate.ValidationError as exc:
        field = ".".join(str(p) for p in exc.path)
        raise Invalid(f"{where}: {obj['kind']} {field}: {exc.message}") from None
    except kubernetes_validate.SchemaNotFoundError as exc:
        raise Invalid(f"{where}: {exc.message}: no schema, so it cannot be checked") from None


def _as_pod(template: dict[str, Any], where: str) -> None:
    _builtin({"apiVersion": "v1", "kind": "Pod", **_meta_and_spec(template, where)}, f"{where} (as a Pod)")


def _as_job(template: dict[str, Any], where: str) -> None:
    _builtin(
        {"apiVersion": "batch/v1", "kind": "Job", **_meta_and_spec(template, where)}, f"{where} (as a Job)"
    )


def _meta_and_spec(template: Any, where: str) -> dict[str, Any]:
    if not isinstance(template, dict) or not isinstance(template.get("spec"), dict):
        raise Invalid(f"{where}: a template needs a spec")
    return {"metadata": template.get("metadata") or {"name": "template"}, "spec": template["spec"]}


def _object_meta(meta: Any, where: str) -> None:
    """``meta`` checked as the ObjectMeta it is, on a ConfigMap (the smallest kind that has one)."""
    _builtin({"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta}, f"{where}.metadata")


#: The kubeflow-training models' scalar type names, as Python types.
_SCALARS: dict[str, tuple[type, ...]] = {
    "str": (str,),
    "int": (int,),
    "bool": (bool,),
    "Quantity": (str, int),
}


def _kubeflow(value: Any, type_name: str, where: str, pods: list[tuple[str, Any]]) -> Any:
    """``value`` checked against the kubeflow-training model ``type_name``: unknown fields, types and the
    models' required fields. Embedded pod templates are collected into ``pods`` (checked by the caller);
    a type this walk does not know is refused rather than passed."""
    if type_name.startswith("list["):
        if not isinstance(value, list):
            raise Invalid(f"{where}: a list expected, not {value!r}")
        return [_kubeflow(v, type_name[5:-1], f"{where}[{i}]", pods) for i, v in enumerate(value)]
    if type_name.startswith("dict(str, "):
        if not isinstance(value, dict):
            raise Invalid(f"{where}: a mapping expected, not {value!r}")
        return {k: _kubeflow(v, type_name[10:-1], f"{where}.{k}", pods) for k, v in value.items()}
    if type_name in _SCALARS:
        if not isinstance(value, _SCALARS[type_name]) or (type_name == "int" and isinstance(value, bool)):
            raise Invalid(f"{where}: {type_name} expected, not {value!r}")
        return value
    if type_name == "V1PodTemplateSpec":
        pods.append((where, value))
        return value
    if type_name == "V1ObjectMeta":
        _object_meta(value, where.rpartition(".")[0])
        return value
    model = getattr(kubeflow_models, type_name, None)
    if model is None:
        raise Invalid(f"{where}: {type_name} is not checked by this test: check it before using it")
    if not isinstance(value, dict):
        raise Invalid(f"{where}: an object ({type_name}) expected, not {value!r}")
    by_json = {json_name: attr for attr, json_name in model.attribute_map.items()}
    kwargs = {}
    for key, item in value.items():
        if key not in by_json:
            raise Invalid(f"{where}.{key}: unknown field of {type_name}")
        attr = by_json[key]
        kwargs[attr] = _kubeflow(item, model.openapi_types[attr], f"{where}.{key}", pods)
    try:
        model(**kwargs)  # the generated constructor refuses a missing required field
    except ValueError as exc:
        raise Invalid(f"{where}: {type_name}: {exc}") from None
    return value


def _jobset_schema() -> dict[str, Any]:
    return json.loads(JOBSET_SCHEMA.read_text(encoding="utf-8"))


def validate(obj: dict[str, Any], where: str) -> None:
    """Raise :class:`Invalid` unless ``obj`` is valid (see the module doc); a kind without a check is
    invalid too, never passed."""
    if not isinstance(obj, dict) or "kind" not in obj or "apiVersion" not in obj:
        raise Invalid(f"{where}: not a Kubernetes object")
    api, kind = obj["apiVersion"], obj["kind"]
    where = f"{where}: {kind} {obj.get('metadata', {}).get('name', '?')}"
    if (api, kind) == (PYTORCHJOB_API, "PyTorchJob"):
        pods: list[tuple[str, Any]] = []
        _kubeflow(obj, "KubeflowOrgV1PyTorchJob", where, pods)
        if "metadata" not in obj:
            raise Invalid(f"{where}: no metadata")
        for path, template in pods:
            _as_pod(template, path)
    elif (api, kind) == (JOBSET_API, "JobSet"):
        try:
            jsonschema.Draft202012Validator(_jobset_schema()).validate(obj)
        except jsonschema.ValidationError as exc:
            field = ".".join(str(p) for p in exc.absolute_path)
            raise Invalid(f"{where}: {field}: {exc.message}") from None
        _object_meta(obj.get("metadata"), where)
        for i, rjob in enumerate(obj["spec"].get("replicatedJobs", [])):
            _as_job(rjob["template"], f"{where}.spec.replicatedJobs[{i}].template")
        for i, policy in enumerate(obj["spec"].get("volumeClaimPolicies", [])):
            for j, claim in enumerate(policy.get("templates", [])):
                claim_obj = {"apiVersion": "v1", "kind": "PersistentVolumeClaim", **claim}
                _builtin(claim_obj, f"{where}.spec.volumeClaimPolicies[{i}].templates[{j}]")
    else:
        _builtin(obj, where)


# ---------------------------------------------------------------------------------------------------------
# What the manifests hold


@dataclass
class PodTemplate:
    """One pod template of the manifests, with the Job spec that runs it (None: not a Job's)."""

    where: str
    template: dict[str, Any]
    job: dict[str, Any] | None

    @property
    def spec(self) -> dict[str, Any]:
        return self.template["spec"]

    def containers(self, command: str) -> list[dict[str, Any]]:
        return [c for c in self.spec["containers"] if c.get("command", [None])[0] == command]

    def volume(self, mount_path: str, container: dict[str, Any]) -> dict[str, Any]:
        mount = next(m for m in container.get("volumeMounts", []) if m["mountPath"] == mount_path)
        return next(v for v in self.spec.get("volumes", []) if v["name"] == mount["name"])


def pod_templates() -> Iterator[PodTemplate]:
    for name, obj in documents():
        kind, spec = obj["kind"], obj.get("spec", {})
        where = f"{name}: {kind} {obj['metadata']['name']}"
        if kind in ("StatefulSet", "Deployment"):
            yield PodTemplate(where, spec["template"], None)
        elif kind == "Job":
            yield PodTemplate(where, spec["template"], spec)
        elif kind == "JobSet":
            for rjob in spec["replicatedJobs"]:
                job = rjob["template"]["spec"]
                yield PodTemplate(f"{where} {rjob['name']}", job["template"], job)
        elif kind == "PyTorchJob":
            for rtype, replica in spec["pytorchReplicaSpecs"].items():
                yield PodTemplate(f"{where} {rtype}", replica["template"], None)


def agent_pods() -> list[PodTemplate]:
    return [p for p in pod_templates() if p.containers("elastic-run")]


def master_pods() -> list[PodTemplate]:
    return [p for p in pod_templates() if p.containers("elastic-master")]


def the(kind: str, file: str) -> dict[str, Any]:
    """The one object of ``kind`` in ``file``."""
    (obj,) = [o for n, o in documents() if n == file and o["kind"] == kind]
    return obj


def options(container: dict[str, Any]) -> dict[str, str]:
    """The container's command-line options as ``{--name: value}`` (as spelled; "" for a flag), checked
    against the command's own click options: each is one of them, written ``--name=value`` when it takes a
    value; an elastic-run container's options end at the training script."""
    command = container["command"][0]
    known = {name: p for p in COMMANDS[command].params if isinstance(p, click.Option) for name in p.opts}
    found: dict[str, str] = {}
    for arg in container.get("args", []):
        if not arg.startswith("-"):
            assert command == "elastic-run", f"{command}: {arg!r} is not an option"
            break
        name, sep, value = arg.partition("=")
        option = known.get(name)
        if option is None:
            assert name in FIXED_ELSEWHERE.get(command, ()), f"{command} has no option {name}"
            found[name] = value
            continue
        assert option.is_flag != bool(sep), f"{command} {arg}: write --name=value, and flags alone"
        found[name] = value
    return found


def the_container(pod: PodTemplate, command: str) -> dict[str, Any]:
    (container,) = pod.containers(command)
    return container


def quantity(text: str | int) -> float:
    """A Kubernetes resource quantity in bytes (the suffixes the manifests use)."""
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12}
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([A-Za-z]*)", str(text))
    assert match and match.group(2) in ("", *units), f"quantity {text!r}"
    return float(match.group(1)) * units.get(match.group(2), 1)


def failure_action(job: dict[str, Any], container: str, code: int) -> str:
    """What the Job's podFailurePolicy does when ``container`` exits with ``code`` (first rule that
    matches; Count when none does, Kubernetes' default)."""
    for rule in job.get("podFailurePolicy", {}).get("rules", []):
        on = rule.get("onExitCodes")
        if on is None or on.get("containerName", container) != container:
            continue
        if (code in on["values"]) == (on["operator"] == "In"):
            return str(rule["action"])
    return "Count"


def nnodes(container: dict[str, Any]) -> tuple[int, int]:
    low, _, high = options(container)["--nnodes"].partition(":")
    return int(low), int(high or low)


# ---------------------------------------------------------------------------------------------------------
# Validity


def test_every_manifest_validates_for_kubernetes_1_31() -> None:
    docs = documents()
    kinds = {o["kind"] for _, o in docs}
    assert {"JobSet", "PyTorchJob", "Job", "StatefulSet", "Secret", "PodDisruptionBudget"} <= kinds
    for name, obj in docs:
        validate(obj, name)


def test_the_jobset_schema_names_its_source_and_version() -> None:
    schema = _jobset_schema()
    source = schema["x-source"]
    assert source["repository"] == "https://github.com/kubernetes-sigs/jobset"
    assert re.fullmatch(r"v\d+\.\d+\.\d+", source["release"])
    assert re.fullmatch(r"[0-9a-f]{40}", source["commit"])
    assert source["apiVersion"] == JOBSET_API and source["path"].endswith("jobset.x-k8s.io_jobsets.yaml")
    assert source["release"] in schema["$comment"] and source["commit"] in schema["$comment"]
    jsonschema.Draft202012Validator.check_schema(schema)


def _with(file: str, kind: str, change: Any) -> dict[str, Any]:
    obj = copy.deepcopy(the(kind, file))
    change(obj)
    return obj


def _pod_spec_of(obj: dict[str, Any]) -> dict[str, Any]:
    if obj["kind"] == "JobSet":
        return obj["spec"]["replicatedJobs"][-1]["template"]["spec"]["template"]["spec"]
    if obj["kind"] == "PyTorchJob":
        return obj["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]
    return obj["spec"]["template"]["spec"]


@pytest.mark.parametrize(
    ("file", "kind"),
    [
        ("indexed-job.yaml", "Job"),
        ("master-statefulset.yaml", "StatefulSet"),
        ("jobset.yaml", "JobSet"),
        ("pytorchjob.yaml", "PyTorchJob"),
    ],
)
def test_an_unknown_field_in_a_pod_spec_is_refused(file: str, kind: str) -> None:
    validate(the(kind, file), file)
    garbage = _with(file, kind, lambda o: _pod_spec_of(o).update(shmSize="64Gi"))
    with pytest.raises(Invalid, match="shmSize"):
        validate(garbage, file)
    in_container = _with(file, kind, lambda o: _pod_spec_of(o)["containers"][0].update(gpus=8))
    with pytest.raises(Invalid, match="gpus"):
        validate(in_container, file)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (lambda o: o["spec"]["failurePolicy"].update(maxRestart=2), "maxRestart"),
        (lambda o: o["spec"]["replicatedJobs"][0].update(replica=2), "replica"),
        (lambda o: o["spec"]["successPolicy"].update(operator="Most"), "Most"),
        (lambda o: o["spec"]["failurePolicy"]["rules"][0].update(action="Retry"), "Retry"),
        (lambda o: o["spec"]["replicatedJobs"][0].update(replicas="1"), "'1'"),
        (lambda o: o["spec"]["network"].update(publishNotReadyAddress=True), "publishNotReadyAddress"),
        (
            lambda o: o["spec"]["replicatedJobs"][1]["template"]["spec"].update(backofLimitPerIndex=1),
            "backofLimit",
        ),
        (lambda o: o.update(apiVersion="jobset.x-k8s.io/v1"), "v1"),
    ],
)
def test_a_wrong_jobset_field_is_refused(change: Any, match: str) -> None:
    with pytest.raises(Invalid, match=match):
        validate(_with("jobset.yaml", "JobSet", change), "jobset.yaml")


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (lambda o: o["spec"]["elasticPolicy"].update(minReplica=2), "minReplica"),
        (lambda o: o["spec"]["pytorchReplicaSpecs"]["Worker"].update(replicas="4"), "replicas"),
        (lambda o: o["spec"].pop("runPolicy"), "run_policy"),
        (lambda o: o["spec"]["runPolicy"].update(cleanPodPolicy=True), "cleanPodPolicy"),
        (lambda o: o["metadata"].update(lables={}), "lables"),
    ],
)
def test_a_wrong_pytorchjob_field_is_refused(change: Any, match: str) -> None:
    with pytest.raises(Invalid, match=match):
        validate(_with("pytorchjob.yaml", "PyTorchJob", change), "pytorchjob.yaml")


def test_a_kind_without_a_schema_is_refused_not_passed() -> None:
    with pytest.raises(Invalid, match="cannot be checked"):
        validate({"apiVersion": "example.com/v1", "kind": "TrainJob", "metadata": {"name": "x"}}, "x.yaml")


# ---------------------------------------------------------------------------------------------------------
# Behaviour


def test_every_command_line_option_in_the_manifests_is_one_the_command_has() -> None:
    containers = [c for p in pod_templates() for c in p.spec["containers"] if c["command"][0] in COMMANDS]
    assert len(containers) >= 5
    for container in containers:
        options(container)  # asserts each option


def test_every_variable_a_command_line_names_is_defined_in_the_pod() -> None:
    # Kubernetes leaves an undefined $(VAR) as it is: the agent would get a literal "$(VAR)".
    for pod in pod_templates():
        injected = (
            {"JOB_COMPLETION_INDEX"} if pod.job and pod.job.get("completionMode") == "Indexed" else set()
        )
        for container in pod.spec["containers"]:
            defined = set(injected)
            for env in container.get("env", []):  # an env value sees only the variables before it
                for name in re.findall(r"\$\((\w+)\)", env.get("value", "")):
                    assert name in defined, f"{pod.where}: env {env['name']} uses $({name}) before it is set"
                defined.add(env["name"])
            for arg in container.get("command", []) + container.get("args", []):
                for name in re.findall(r"\$\((\w+)\)", arg):
                    assert name in defined, f"{pod.where}: {arg!r} uses $({name}), which the pod does not set"


def test_job_pod_failure_policies_follow_the_exit_code_table() -> None:
    jobs = [(p, "elastic-run", WORKER_ACTIONS) for p in agent_pods() if p.job is not None]
    jobs += [(p, "elastic-master", MASTER_ACTIONS) for p in master_pods() if p.job is not None]
    assert len(jobs) == 3  # the indexed Job, the JobSet's workers and its masters
    for pod, command, table in jobs:
        job, container = pod.job, the_container(pod, command)
        assert job is not None
        assert {code: failure_action(job, container["name"], code) for code in table} == table, pod.where
        first = job["podFailurePolicy"]["rules"][0]  # evicted, preempted, drained: never counted
        assert first["action"] == "Ignore" and first["onPodConditions"][0]["type"] == "DisruptionTarget"
        # One pod's loss replaces that pod only: retries per index, pods replaced once gone, no restarts
        # in place that would hide the exit code from the policy.
        assert job["completionMode"] == "Indexed" and job["backoffLimitPerIndex"] >= 1, pod.where
        assert job["podReplacementPolicy"] == "Failed" and pod.spec["restartPolicy"] == "Never", pod.where


def test_worker_jobs_run_one_pod_per_node_and_tolerate_losing_the_spare_nodes() -> None:
    for pod in agent_pods():
        low, high = nnodes(the_container(pod, "elastic-run"))
        if pod.job is not None:
            assert pod.job["completions"] == pod.job["parallelism"] == high, pod.where
            assert pod.job["maxFailedIndexes"] == high - low, pod.where
    job = the("PyTorchJob", "pytorchjob.yaml")["spec"]
    container = the_container(next(p for p in agent_pods() if "PyTorchJob" in p.where), "elastic-run")
    policy = job["elasticPolicy"]
    assert (policy["minReplicas"], policy["maxReplicas"]) == nnodes(container)
    assert job["pytorchReplicaSpecs"]["Worker"]["replicas"] == policy["maxReplicas"]
    assert job["nprocPerNode"] == options(container)["--nproc-per-node"]
    # A failed agent restarts in its pod: its /dev/shm, and the checkpoints in it, stay.
    assert job["pytorchReplicaSpecs"]["Worker"]["restartPolicy"] == "OnFailure"
    assert job["runPolicy"]["cleanPodPolicy"] == "None"  # the first success kills no pod still persisting
    assert container["name"] == "pytorch" and set(job["pytorchReplicaSpecs"]) == {"Worker"}


def test_dev_shm_is_a_memory_volume_within_the_pod_memory_limit() -> None:
    pods = agent_pods()
    assert len(pods) == 3
    for pod in pods:
        container = the_container(pod, "elastic-run")
        shm = pod.volume("/dev/shm", container)["emptyDir"]
        assert shm["medium"] == "Memory" and "sizeLimit" in shm, pod.where
        # The files in a memory volume count against the container's memory limit.
        limit = quantity(container["resources"]["limits"]["memory"])
        assert quantity(shm["sizeLimit"]) < limit, pod.where


def test_the_grace_period_leaves_time_for_the_final_persist() -> None:
    for pod in agent_pods():
        assert pod.spec["terminationGracePeriodSeconds"] >= AGENT_GRACE_S, pod.where
    for pod in master_pods():
        assert pod.spec["terminationGracePeriodSeconds"] >= MASTER_GRACE_S, pod.where


def test_masters_are_probed_on_healthz_and_readyz_of_their_api_port() -> None:
    pods = master_pods()
    assert len(pods) == 2  # the long-lived StatefulSet and the JobSet's masters
    for pod in pods:
        container = the_container(pod, "elastic-master")
        port = int(options(container)["--port"])
        named = {p["name"]: p["containerPort"] for p in container["ports"]}
        for probe, path in (("livenessProbe", "/healthz"), ("readinessProbe", "/readyz")):
            get = container[probe]["httpGet"]
            assert get["path"] == path and named.get(get["port"], get["port"]) == port, (pod.where, probe)


def test_long_lived_masters_and_their_agents_agree() -> None:
    sts = the("StatefulSet", "master-statefulset.yaml")
    service = the("Service", "master-statefulset.yaml")
    pdb = the("PodDisruptionBudget", "master-statefulset.yaml")
    master = options(the_container(PodTemplate("", sts["spec"]["template"], None), "elastic-master"))
    assert "--exit-on-job-end" not in master  # long-lived: it outlives the job
    assert sts["spec"]["replicas"] >= 2 and sts["spec"]["serviceName"] == service["metadata"]["name"]
    assert service["spec"]["clusterIP"] == "None"  # each master by its own name
    labels = sts["spec"]["template"]["metadata"]["labels"]
    for selector in (service["spec"]["selector"], pdb["spec"]["selector"]["matchLabels"]):
        assert selector.items() <= labels.items()
    assert pdb["spec"]["maxUnavailable"] == 1
    name, domain = sts["metadata"]["name"], service["metadata"]["name"]
    addresses = [f"{name}-{i}.{domain}:{master['--port']}" for i in range(sts["spec"]["replicas"])]
    users = [p for p in agent_pods() if p.job is None or "JobSet" not in p.where]
    assert len(users) == 2  # the PyTorchJob and the indexed Job
    for pod in users:
        agent = options(the_container(pod, "elastic-run"))
        assert agent["--master"].split(",") == addresses, pod.where
        assert (agent["--job-id"], agent["--nnodes"]) == (master["--job-id"], master["--nnodes"]), pod.where
    policy = the("PyTorchJob", "pytorchjob.yaml")["spec"]["elasticPolicy"]
    assert policy["rdzvId"] == master["--job-id"]
    assert f"{policy['rdzvHost']}:{policy['rdzvPort']}" in addresses


def test_the_jobset_ends_with_its_masters_and_fails_for_good_only_on_a_final_exit_code() -> None:
    jobset = the("JobSet", "jobset.yaml")
    spec, name = jobset["spec"], jobset["metadata"]["name"]
    rjobs = {r["name"]: r for r in spec["replicatedJobs"]}
    masters_job = rjobs["master"]["template"]["spec"]
    master_pod = PodTemplate("jobset master", masters_job["template"], masters_job)
    master = options(the_container(master_pod, "elastic-master"))
    workers_job = rjobs["workers"]["template"]["spec"]
    workers_pod = PodTemplate("jobset workers", workers_job["template"], workers_job)
    agent = options(the_container(workers_pod, "elastic-run"))
    assert "--exit-on-job-end" in master and master["--job-id"] == agent["--job-id"]
    assert master["--nnodes"] == agent["--nnodes"]
    # Every master by its stable host name: <jobset>-master-<job index>-<pod index>.<subdomain>.
    port, count = master["--port"], masters_job["completions"]
    expected = [f"$(JOBSET_NAME)-master-0-{i}.$(JOBSET_NAME):{port}" for i in range(count)]
    assert agent["--master"].split(",") == expected
    assert rjobs["master"]["replicas"] == 1 and spec["network"]["enableDNSHostnames"] is True
    assert "subdomain" not in spec["network"]  # the default, the JobSet's name, is what the names above use
    assert masters_job["successPolicy"]["rules"] == [{"succeededCount": 1}]  # one master's exit 0 is enough
    assert spec["successPolicy"] == {"operator": "All", "targetReplicatedJobs": ["master"]}
    rules = spec["failurePolicy"]["rules"]
    assert all(JOBSET_RULE_NAME.match(rule["name"]) for rule in rules)
    assert rules[0]["action"] == "FailJobSet" and rules[0]["onJobFailureReasons"] == ["PodFailurePolicy"]
    assert spec["startupPolicy"]["startupPolicyOrder"] == "InOrder" and list(rjobs) == ["master", "workers"]
    anti = master_pod.spec["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert anti[0]["labelSelector"]["matchLabels"]["jobset.sigs.k8s.io/jobset-name"] == name


def test_every_pod_reads_the_token_from_the_secret_and_checkpoints_to_the_claim() -> None:
    secret = the("Secret", "token-secret.yaml")
    claim = the("PersistentVolumeClaim", "checkpoint-pvc.yaml")
    # The placeholder must be refused if applied unchanged: the commands require 16 bytes.
    assert len(secret["stringData"]["token"].encode()) < 16
    for pod in pod_templates():
        for command in ("elastic-run", "elastic-master"):
            for container in pod.containers(command):
                folder, _, key = options(container)["--token-file"].rpartition("/")
                source = pod.volume(folder, container)["secret"]
                assert (source["secretName"], key) == (secret["metadata"]["name"], "token"), pod.where
                assert source["defaultMode"] == 0o400, pod.where  # the commands warn about a wider mode
                if command == "elastic-run":
                    ckpt = options(container)["--ckpt-dir"]
                    volume = pod.volume("/" + ckpt.split("/")[1], container)
                    assert volume["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]


def test_the_manifests_run_the_image_the_dockerfile_builds() -> None:
    dockerfile = DOCKERFILE.read_text(encoding="utf-8")
    images = {
        c["image"] for p in pod_templates() for c in p.spec["containers"] if c["command"][0] in COMMANDS
    }
    assert len(images) == 1
    (image,) = images
    assert f"docker build -f deploy/Dockerfile -t {image} ." in dockerfile
    workdir = re.search(r"^WORKDIR (\S+)$", dockerfile, re.M)
    assert workdir
    copied = dict(re.findall(r"^COPY (\S+) (\S+)$", dockerfile, re.M))
    for source in copied:
        assert (REPO / source).exists(), f"deploy/Dockerfile copies {source}, which the repository lacks"
    for pod in agent_pods():
        args = the_container(pod, "elastic-run")["args"]
        script = next(a for a in args if not a.startswith("-"))
        relative = script.removeprefix(workdir.group(1) + "/")
        assert copied.get(relative) == f"./{relative}", f"{pod.where}: the image has no {script}"
