"""Platforms from their environment: one pure step that turns what a scheduler sets in a node's environment
into ``elastic-run`` option values, so that ``elastic-run script.py`` needs no other flag there.

:func:`detect` reads a mapping (the environment, plus the host name and fully qualified name the caller
looked up) and returns a :class:`Platform`: its name, the option values it derives (``nnodes``,
``nproc_per_node``, ``rdzv_endpoint``, ``rdzv_id``, ``node_id``) and every variable it read, or None when no
platform's variables are there. :func:`apply` puts those values into the parsed options where the command
line did not give them (explicit flags win), and :func:`start_line` is the one line the agent logs at start.

What each platform sets, and where that was read (each unit test fixture names the same source):

- **PyTorchJob** (Kubeflow training-operator v1, ``kubeflow.org/v1``;
  ``pkg/controller.v1/pytorch/elastic.go``, ``master.go``, ``envvar.go``). Elastic (an ``elasticPolicy``):
  ``PET_RDZV_ENDPOINT`` (``<job>-worker-0:<port>``), ``PET_RDZV_BACKEND`` (c10d), ``PET_NNODES`` (``N`` or
  ``MIN:MAX``), ``PET_NPROC_PER_NODE`` (``PET_N_PROC_PER_NODE`` in releases before 1.7), ``PET_RDZV_ID``,
  ``PET_MAX_RESTARTS``; torchrun reads them as its flags' defaults, and so does elastic-run. Static (a
  Master replica): ``MASTER_ADDR`` (``<job>-master-0``), ``MASTER_PORT``, and per pod ``WORLD_SIZE`` (the
  number of *pods*) and ``RANK`` (the pod's index): they give the node count, never a process's rank or
  world size (the agent sets those for each worker).
- **TrainJob** (Kubeflow Trainer v2, ``trainer.kubeflow.org/v1alpha1``;
  ``pkg/runtime/framework/plugins/torch/torch.go``): ``PET_NNODES``, ``PET_NPROC_PER_NODE``,
  ``PET_NODE_RANK`` (the Job completion index), ``PET_MASTER_ADDR`` (``<job>-node-0-0.<job>``),
  ``PET_MASTER_PORT`` (29400). Static: the node count is fixed, so after a pod loss the job goes on only
  while ``--nnodes``'s minimum remains (pass ``--nnodes MIN:N`` to train on without the replacement).
- **JobSet and indexed Jobs** (JobSet ``jobset.x-k8s.io/v1alpha2``, ``api/jobset/v1alpha2/jobset_types.go``;
  Kubernetes indexed Jobs, batch/v1 ``completionMode: Indexed``): ``JOB_COMPLETION_INDEX`` and the stable
  host name ``<jobset>-<replicatedJob>-<jobIndex>-<podIndex>`` (an indexed Job: ``<job>-<index>``); the
  master is the pod whose indexes are all 0, at the same DNS domain as this pod. Neither sets the node count:
  give ``--nnodes`` (or ``PET_NNODES``).
- **SLURM** (``srun``'s task environment, Slurm 23.02+ ``srun(1)``, "OUTPUT ENVIRONMENT VARIABLES"): one
  agent per node; ``SLURM_JOB_ID`` (the job id), ``SLURM_NNODES``, ``SLURM_NODEID`` (else
  ``SLURM_PROCID``: the node rank), ``SLURM_JOB_NODELIST`` (its first host is the master's, expanded here:
  ``n[01-02],m3``), ``SLURM_RESTART_COUNT`` (the job's requeues); the first host is looked up with
  ``scontrol show node NAME`` (its NodeAddr) by the caller when its name does not resolve.
- **SkyPilot** (``docs.skypilot.co``, "Environment variables", v0.9): ``SKYPILOT_NODE_RANK``,
  ``SKYPILOT_NODE_IPS`` (one address a line; the first is the head node's, where the master runs),
  ``SKYPILOT_NUM_NODES``, ``SKYPILOT_NUM_GPUS_PER_NODE`` and ``SKYPILOT_TASK_ID`` (stable across a managed
  job's recoveries: the job id).

The master port, where the platform names none: ``MASTER_PORT`` if set, else 29400 (torchrun's c10d port).
Standard library only; no I/O (the caller passes what it looked up).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from elastic import errors

#: torchrun's default port of the c10d rendezvous, used where a platform names no port.
DEFAULT_PORT = 29400

#: The option values a platform may set (the names of :mod:`agent.cli.main`'s parameters).
OPTIONS = ("nnodes", "nproc_per_node", "rdzv_endpoint", "rdzv_id", "node_id")


class PlatformError(errors.UsageError, ValueError):
    """The environment names a platform but misses (or garbles) a value elastic-run needs; one line."""


@dataclass(frozen=True)
class Platform:
    """What :func:`detect` found: the platform's name, the option values it derives from the environment
    (only those it could derive), the variables it read (in reading order) and notes for the start line."""

    name: str
    values: dict[str, str] = field(default_factory=dict)
    used: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()


class _Reader:
    """Reads variables from the environment and remembers which it read."""

    def __init__(self, environ: Mapping[str, str]) -> None:
        self.environ = environ
        self.used: list[str] = []

    def has(self, *names: str) -> bool:
        return all(self.environ.get(n, "") != "" for n in names)

    def get(self, name: str) -> str | None:
        value = self.environ.get(name)
        if value is None or value == "":
            return None
        if name not in self.used:
            self.used.append(name)
        return value.strip()

    def need(self, name: str, platform: str) -> str:
        value = self.get(name)
        if value is None:
            raise PlatformError(f"{platform}: {name} is not set")
        return value

    def count(self, name: str, platform: str) -> int:
        value = self.need(name, platform)
        try:
            number = int(value)
        except ValueError:
            raise PlatformError(f"{platform}: {name}={value!r} is not a number") from None
        if number < 0:
            raise PlatformError(f"{platform}: {name}={value!r} is negative")
        return number


def detect(
    environ: Mapping[str, str],
    *,
    hostname: str = "",
    fqdn: str = "",
    node_addr: Callable[[str], str | None] | None = None,
) -> Platform | None:
    """The platform whose variables ``environ`` holds, or None; raises :class:`PlatformError` when they are
    incomplete.

    ``hostname``: this host's name (``HOSTNAME`` where set, else the caller's ``socket.gethostname()``);
    ``fqdn``: its fully qualified name (JobSet's and indexed Jobs' master is in the same domain).
    ``node_addr``: for SLURM, the address of a node name that does not resolve (``scontrol show node``'s
    NodeAddr), or None to leave the name as it is. Checked in this order, the most specific first:
    TrainJob, PyTorchJob (elastic, then static), SLURM, SkyPilot, JobSet, indexed Job."""
    r = _Reader(environ)
    host = environ.get("HOSTNAME") or hostname
    if r.has("PET_NODE_RANK", "PET_MASTER_ADDR"):
        return _trainjob(r, host)
    if r.has("PET_RDZV_ENDPOINT"):
        return _pytorchjob_elastic(r, host)
    if r.has("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK"):
        return _pytorchjob_static(r, host)
    if r.has("SLURM_JOB_ID", "SLURM_JOB_NODELIST") and (r.has("SLURM_NODEID") or r.has("SLURM_PROCID")):
        return _slurm(r, node_addr)
    if r.has("SKYPILOT_NODE_RANK", "SKYPILOT_NODE_IPS"):
        return _skypilot(r)
    if r.has("JOB_COMPLETION_INDEX") and host:
        return _indexed(r, host, fqdn)
    return None


def _nproc(r: _Reader) -> dict[str, str]:
    value = r.get("PET_NPROC_PER_NODE") or r.get("PET_N_PROC_PER_NODE")
    return {"nproc_per_node": value} if value else {}


def _trainjob(r: _Reader, host: str) -> Platform:
    name = "TrainJob (Kubeflow Trainer v2)"
    nodes = r.count("PET_NNODES", name)
    rank = r.count("PET_NODE_RANK", name)
    addr = r.need("PET_MASTER_ADDR", name)
    port = r.get("PET_MASTER_PORT") or str(DEFAULT_PORT)
    values = {"nnodes": str(nodes), "rdzv_endpoint": f"{addr}:{port}", **_nproc(r)}
    # Pods are <trainjob>-node-<jobIndex>-<podIndex>, the master <trainjob>-node-0-0.<trainjob>.
    named = re.fullmatch(r"(?P<job>.+)-node-\d+-\d+", host.split(".")[0]) if host else None
    job = named["job"] if named else addr.split(".", 1)[-1]
    values["rdzv_id"] = job
    values["node_id"] = host or f"{job}-node-{rank}"
    return Platform(name, values, tuple(r.used), (f"node rank {rank}",))


def _pytorchjob_elastic(r: _Reader, host: str) -> Platform:
    name = "PyTorchJob (Kubeflow training-operator v1, elastic)"
    endpoint = r.need("PET_RDZV_ENDPOINT", name)
    values = {"rdzv_endpoint": endpoint, **_nproc(r)}
    nnodes = r.get("PET_NNODES")
    if nnodes is None:
        raise PlatformError(f"{name}: PET_NNODES is not set")
    values["nnodes"] = nnodes
    backend = r.get("PET_RDZV_BACKEND")
    # The rendezvous host is <job>-worker-0 (elastic.go): the job's name, where PET_RDZV_ID is not set.
    job = r.get("PET_RDZV_ID") or re.sub(r"-worker-\d+$", "", endpoint.rsplit(":", 1)[0].split(".")[0])
    values["rdzv_id"] = job
    if host:
        values["node_id"] = host
    notes = (f"backend {backend} (the elastic master serves it)",) if backend and backend != "c10d" else ()
    return Platform(name, values, tuple(r.used), notes)


def _pytorchjob_static(r: _Reader, host: str) -> Platform:
    name = "PyTorchJob (Kubeflow training-operator v1, static)"
    addr = r.need("MASTER_ADDR", name)
    port = r.count("MASTER_PORT", name)
    # WORLD_SIZE and RANK count pods here (envvar.go: the replicas of every type; a worker's index + 1):
    # the node count and this pod's index, never a worker process's world size or rank.
    pods = r.count("WORLD_SIZE", name)
    rank = r.count("RANK", name)
    job = re.sub(r"-master-\d+$", "", addr.split(".")[0])
    values = {"nnodes": str(pods), "rdzv_endpoint": f"{addr}:{port}", "rdzv_id": job, **_nproc(r)}
    if host:
        values["node_id"] = host
    return Platform(name, values, tuple(r.used), (f"pod {rank} of {pods}",))


def _slurm(r: _Reader, node_addr: Callable[[str], str | None] | None) -> Platform:
    name = "SLURM (srun)"
    job = r.need("SLURM_JOB_ID", name)
    rank = r.count("SLURM_NODEID", name) if r.has("SLURM_NODEID") else r.count("SLURM_PROCID", name)
    nodelist = r.need("SLURM_JOB_NODELIST", name)
    try:
        hosts = expand_nodelist(nodelist)
    except ValueError as exc:
        raise PlatformError(f"{name}: SLURM_JOB_NODELIST={nodelist!r}: {exc}") from None
    first = hosts[0]
    addr = (node_addr(first) if node_addr is not None else None) or first
    port = r.get("MASTER_PORT") or str(DEFAULT_PORT)
    nodes = r.count("SLURM_NNODES", name) if r.has("SLURM_NNODES") else len(hosts)
    values = {
        "nnodes": str(nodes),
        "rdzv_endpoint": f"{addr}:{port}",
        "rdzv_id": f"slurm-{job}",
        "node_id": f"slurm-{job}-node{rank}",
    }
    notes = [f"node rank {rank}", f"master on {first}" + (f" ({addr})" if addr != first else "")]
    restarts = r.get("SLURM_RESTART_COUNT")
    if restarts:
        notes.append(f"requeued {restarts} time(s)")
    return Platform(name, values, tuple(r.used), tuple(notes))


def _skypilot(r: _Reader) -> Platform:
    name = "SkyPilot"
    rank = r.count("SKYPILOT_NODE_RANK", name)
    ips = [line.strip() for line in r.need("SKYPILOT_NODE_IPS", name).splitlines() if line.strip()]
    if not ips:
        raise PlatformError(f"{name}: SKYPILOT_NODE_IPS lists no address")
    nodes = r.count("SKYPILOT_NUM_NODES", name) if r.has("SKYPILOT_NUM_NODES") else len(ips)
    port = r.get("MASTER_PORT") or str(DEFAULT_PORT)
    values = {"nnodes": str(nodes), "rdzv_endpoint": f"{_bracket(ips[0])}:{port}", "node_id": f"node{rank}"}
    task = r.get("SKYPILOT_TASK_ID")
    if task:
        values["rdzv_id"] = _job_id(task)
    gpus = r.get("SKYPILOT_NUM_GPUS_PER_NODE")
    if gpus and gpus.isdigit() and int(gpus) > 0:
        values["nproc_per_node"] = gpus
    return Platform(name, values, tuple(r.used), (f"node rank {rank}",))


def _indexed(r: _Reader, host: str, fqdn: str) -> Platform:
    index = r.count("JOB_COMPLETION_INDEX", "indexed Job")
    short = host.split(".")[0]
    domain = fqdn.split(".", 1)[1] if "." in fqdn else ""
    jobset = re.fullmatch(r"(?P<prefix>.+)-(?P<job>\d+)-(?P<pod>\d+)", short)
    if jobset is not None and int(jobset["pod"]) == index:
        name, prefix = "JobSet", jobset["prefix"]
        master = f"{prefix}-0-0"
        notes = (f"job index {jobset['job']}, pod index {index}",)
    else:
        plain = re.fullmatch(rf"(?P<prefix>.+)-{index}", short)
        if plain is None:
            raise PlatformError(
                f"indexed Job: JOB_COMPLETION_INDEX={index} but the host name {short!r} is not "
                "<job>-<index> or <jobset>-<replicatedJob>-<jobIndex>-<podIndex>; pass --rdzv-endpoint"
            )
        name, prefix = "indexed Job", plain["prefix"]
        master = f"{prefix}-0"
        notes = (f"completion index {index}",)
    values = {
        "rdzv_endpoint": f"{master}.{domain}:{DEFAULT_PORT}" if domain else f"{master}:{DEFAULT_PORT}",
        "rdzv_id": prefix,
        "node_id": short,
    }
    nnodes = r.get("PET_NNODES")
    if nnodes:
        values["nnodes"] = nnodes
    return Platform(name, values, tuple(r.used), notes)


def _bracket(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def _job_id(text: str) -> str:
    """A job id made of ``text``: the master's job ids are at most 128 characters, without spaces."""
    return re.sub(r"[^A-Za-z0-9._-]", "-", text)[:128]


def expand_nodelist(nodelist: str) -> list[str]:
    """SLURM's compact host list as host names, in order: ``n[1-2],m[07,09-10]`` → n1 n2 m07 m09 m10
    (zero padding kept; several bracket groups in one name multiply). Raises ValueError when malformed."""
    hosts: list[str] = []
    for entry in _split_top(nodelist):
        if entry.count("[") != entry.count("]") or re.search(r"\[[^\]]*\[", entry):
            raise ValueError("unbalanced brackets")
        names = [""]
        for literal, group in re.findall(r"([^\[\]]*)(?:\[([^\[\]]*)\])?", entry):
            if not literal and not group:
                continue
            parts = [literal + value for value in _expand_group(group)] if group else [literal]
            names = [name + part for name in names for part in parts]
        hosts.extend(n for n in names if n)
    if not hosts:
        raise ValueError("no host")
    return hosts


def _split_top(text: str) -> list[str]:
    """Split at the commas outside brackets."""
    out, depth, current = [], 0, ""
    for ch in text.strip():
        depth += {"[": 1, "]": -1}.get(ch, 0)
        if depth < 0:
            raise ValueError("unbalanced brackets")
        if ch == "," and depth == 0:
            out.append(current)
            current = ""
        else:
            current += ch
    out.append(current)
    return [part for part in out if part]


def _expand_group(group: str) -> list[str]:
    values = []
    for item in group.split(","):
        low, sep, high = item.partition("-")
        if not low.isdigit() or (sep and not high.isdigit()):
            raise ValueError(f"bad range {item!r}")
        if not sep:
            values.append(low)
            continue
        width = len(low)
        if int(high) < int(low):
            raise ValueError(f"bad range {item!r}")
        values.extend(str(n).zfill(width) for n in range(int(low), int(high) + 1))
    return values


def apply(opts: dict[str, Any], explicit: frozenset[str], platform: Platform) -> dict[str, Any]:
    """``opts`` with the platform's values where the command line gave none (explicit flags win; a value
    that came from a ``PET_*`` variable is the platform's own and is replaced by the same or a fuller one).
    The platform's endpoint is torchrun's c10d spelling: the agent at that address hosts the master. A
    master given on the command line (``--master``, ``--rdzv-endpoint``, ``--master-addr/--master-port``)
    or ``--standalone`` keeps the platform's endpoint out."""
    merged = dict(opts)
    own_master = bool(explicit & {"master", "rdzv_endpoint", "master_addr", "master_port", "standalone"})
    for key, value in platform.values.items():
        if key in explicit or (key == "rdzv_endpoint" and own_master):
            continue
        merged[key] = value
    if "rdzv_endpoint" in platform.values and not own_master:
        # The platform's PET_MASTER_ADDR/PET_MASTER_PORT (click read them as torchrun's flags) are in the
        # endpoint now; left set, they would name a second rendezvous.
        merged["master"], merged["master_addr"], merged["master_port"] = "", None, None
    return merged


#: Options a platform's variables stand for: never "given" by the user (no torchrun warning for them).
CONSUMED = frozenset({*OPTIONS, "node_rank", "master_addr", "master_port", "rdzv_backend"})


def start_line(platform: Platform, applied: Mapping[str, Any], explicit: frozenset[str]) -> str:
    """The one line logged at start: the platform, what it set and from which variables."""
    taken = ", ".join(
        f"{key.replace('_', '-')} {applied[key]}"
        for key in OPTIONS
        if key in platform.values and key not in explicit
    )
    kept = sorted(k.replace("_", "-") for k in platform.values if k in explicit)
    parts = [f"platform {platform.name}: {taken or 'nothing taken'}"]
    if kept:
        parts.append(f"given on the command line: {', '.join('--' + k for k in kept)}")
    parts.extend(platform.notes)
    parts.append(f"from {', '.join(platform.used)}")
    return "; ".join(parts)
