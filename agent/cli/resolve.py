"""Resolution of ``elastic-run``'s parsed options into frozen :class:`~agent.settings.AgentSettings`.

The options are declared in :mod:`agent.cli.main`; :func:`resolve` reads them top to bottom, once: the node
count and the worker command, the master addresses and whether this agent hosts the master, torchrun's
flags (judged by :mod:`agent.cli.torchrun`), the job settings, this node's address, TLS, the token and the
metrics listener. Every bad value is a click usage error (one line, exit 2), raised before anything starts.
"""

from __future__ import annotations

import logging
import os
import pathlib
import re
import secrets
import shutil
import socket
import subprocess
import sys
import uuid
from collections.abc import Mapping
from typing import Any

import click
from click.core import ParameterSource

from agent.checkpoints.persist import check_folder
from agent.cli import platforms, torchrun
from agent.executor.net import is_local_host, local_address_for, store_ports
from agent.settings import AgentSettings
from elastic.control import job_settings as ms
from elastic.control.addresses import parse_addresses, split_address
from elastic.control.auth import TokenError, derived_token, job_token
from elastic.control.cli_options import job_settings_from
from elastic.control.listener_rules import (
    AGENT_METRICS,
    MASTER_API,
    UNAUTHENTICATED,
    Auth,
    ListenerRuleError,
    check_listener,
)
from elastic.control.protocol import valid_host
from elastic.text import ALWAYS_SHOWN

log = logging.getLogger(__name__)


def given_options(ctx: click.Context) -> frozenset[str]:
    """Names of the options the user gave, on the command line or through their ``PET_*`` variable."""
    given = (ParameterSource.COMMANDLINE, ParameterSource.ENVIRONMENT)
    return frozenset(name for name in ctx.params if ctx.get_parameter_source(name) in given)


def explicit_options(ctx: click.Context) -> frozenset[str]:
    """Names of the options given on the command line (they win over any platform's environment)."""
    return frozenset(n for n in ctx.params if ctx.get_parameter_source(n) is ParameterSource.COMMANDLINE)


def resolve_platform(
    o: dict[str, Any], explicit: frozenset[str], given: frozenset[str], environ: Mapping[str, str]
) -> tuple[dict[str, Any], frozenset[str], platforms.Platform | None]:
    """The first resolve step: the options with the values of the platform ``environ`` names
    (:mod:`agent.cli.platforms`; explicit flags win), the options the user gave (less those the platform's
    variables stand for) and the platform, or None. Logs the one start line that names the platform and
    every value it took. A platform whose variables are incomplete is a usage error (exit 2)."""
    hostname = socket.gethostname()
    try:
        found = platforms.detect(
            environ,
            hostname=hostname,
            # getfqdn may ask DNS: only for the platforms whose master is named from this pod's domain
            fqdn=socket.getfqdn() if environ.get("JOB_COMPLETION_INDEX") else "",
            node_addr=_slurm_node_addr,
        )
    except platforms.PlatformError as exc:
        raise click.UsageError(f"{exc} (or give the flags it stands for on the command line)") from None
    if found is None:
        return o, given, None
    applied = platforms.apply(o, explicit, found)
    log.info("%s", platforms.start_line(found, applied, explicit), extra=ALWAYS_SHOWN)
    return applied, explicit | (given - platforms.CONSUMED), found


def _slurm_node_addr(name: str) -> str | None:
    """A SLURM node's address when its name does not resolve here: ``scontrol show node NAME``'s NodeAddr
    (None when the name resolves, or scontrol cannot say)."""
    try:
        socket.getaddrinfo(name, None)
        return None
    except (OSError, UnicodeError):
        pass
    try:
        out = subprocess.run(
            ["scontrol", "show", "node", name], capture_output=True, text=True, timeout=10, check=False
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    match = re.search(r"\bNodeAddr=(\S+)", out)
    return match.group(1) if match else None


def resolve(o: dict[str, Any], given: frozenset[str] = frozenset()) -> tuple[AgentSettings, str | None]:
    """Resolve the CLI into frozen settings; returns (settings, address to embed a master at or None).

    ``given``: the options the user gave (see :func:`given_options`); torchrun flags that cannot apply
    here are warned about only then, once each."""
    try:
        min_nodes, max_nodes = ms.parse_nnodes(o["nnodes"])
    except ms.SettingsError as exc:
        raise click.BadParameter(str(exc).removeprefix("--nnodes "), param_hint="--nnodes") from None
    nproc = _nproc(o["nproc_per_node"])
    argv = _worker_argv(o["training_script"], o["training_script_args"], o["module"], o["no_python"])
    if o["master"] and o["rdzv_endpoint"] and o["master"] != o["rdzv_endpoint"]:
        raise click.UsageError("--master and --rdzv-endpoint name the same thing: give one of them")
    endpoint = o["master"] or o["rdzv_endpoint"]
    # Convenience mode (this agent hosts the master when none answers) only where torchrun's command line
    # says a node hosts the rendezvous: its c10d spelling, or its static one (--master-addr/--master-port,
    # or none: 127.0.0.1:29500); or when asked for. A mistyped --master is waited for, never hosted.
    convenience = o["host_master"] or (not o["master"] and o["rdzv_backend"] == "c10d")
    if not endpoint and not o["standalone"] and (o["master_addr"] or max_nodes > 1):
        endpoint = f"{o['master_addr'] or '127.0.0.1'}:{o['master_port'] or 29500}"
        convenience = True
    standalone = o["standalone"] or not endpoint
    if standalone and max_nodes > 1:
        raise click.UsageError(
            f"--nnodes {o['nnodes']} needs a master: pass --master HOST:PORT "
            "(or --rdzv-endpoint); --standalone is for single-node jobs"
        )
    masters: tuple[str, ...] = ()
    if not standalone:
        try:
            masters = tuple(parse_addresses(endpoint))
        except ValueError as exc:
            raise click.BadParameter(str(exc), param_hint="--master") from None
    try:
        compat = torchrun.resolve_flags(o, given, nproc=nproc, gpus=visible_gpus(), environ=os.environ)
    except torchrun.FlagError as exc:
        if exc.flag is None:
            raise click.UsageError(str(exc)) from None
        raise click.BadParameter(str(exc), param_hint=exc.flag) from None
    job_id = o["rdzv_id"]
    if standalone and job_id == "none":
        job_id = f"standalone-{uuid.uuid4().hex[:8]}"
    job = job_settings_from(o, job_id=job_id, min_nodes=min_nodes, max_nodes=max_nodes, **compat.job_fields)
    if o["local_addr"] and not valid_host(o["local_addr"]):
        raise click.BadParameter(
            f"{o['local_addr']!r} is not an IP address or a host name", param_hint="--local-addr"
        )
    host = o["local_addr"] or ("127.0.0.1" if standalone else local_address_for(split_address(masters[0])[0]))
    embed = None
    local = len(masters) == 1 and is_local_host(split_address(masters[0])[0])
    if o["host_master"] and not local:
        raise click.UsageError(
            "--host-master needs one --master address, an address of this host"
            + ("; --standalone hosts its own master" if standalone else "")
        )
    if not standalone and local and convenience:
        embed = masters[0]
    tls_ca, tls_cert, tls_key = _tls(o, standalone, embed)
    ckpt_dir = pathlib.Path(o["ckpt_dir"]).resolve() if o["ckpt_dir"] else None
    if ckpt_dir is not None and (problem := check_folder(ckpt_dir)):
        raise click.BadParameter(problem, param_hint="--ckpt-dir")  # before anything starts: exit 2
    # torchrun's spellings (c10d --rdzv-endpoint, --master-addr/--master-port, a platform's variables)
    # without a token are its explicit opt-in to an unauthenticated job; --master never is.
    token, unauthenticated = _token(o["token_file"], job_id, masters, convenience and not o["host_master"])
    replicas = o["replicas"]
    if unauthenticated and replicas:
        if "replicas" in given:
            raise click.UsageError(f"--replicas {replicas} off loopback needs a token: {_NO_TOKEN_HELP}")
        replicas = 0  # the replication keys would be handed to anyone who joins (docs/security.md)
    try:
        ports = store_ports(os.environ)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    settings = AgentSettings(
        argv=argv,
        nproc=nproc,
        job=job,
        token=token,
        # A file can be rotated (re-read after a 401 and by this agent's listeners); ELASTIC_TOKEN cannot.
        token_file=os.path.abspath(o["token_file"]) if o["token_file"] and not unauthenticated else None,
        unauthenticated=unauthenticated,
        node_id=o["node_id"] or f"{socket.gethostname()}-{os.getpid()}",
        node_id_is_default=not o["node_id"],
        masters=masters,
        host_master_at=None,
        tls_ca=tls_ca,
        tls_cert=tls_cert,
        tls_key=tls_key,
        local_addr=host,
        role=o["role"],
        log_dir=pathlib.Path(o["log_dir"]).resolve() if o["log_dir"] else None,
        ckpt_dir=ckpt_dir,
        ckpt_keep=o["ckpt_keep"],
        replicas=replicas,
        replication_lag=o["replication_lag"],
        replication_bandwidth=o["replication_bandwidth"],
        replication_peer_cap=o["replication_peer_cap"],
        ckpt_reset=o["ckpt_reset"],
        stop_grace_s=compat.stop_grace_s,
        master_timeout_s=o["master_timeout"],
        warm_start=not o["no_warm_start"],
        hang_timeout_s=o["hang_timeout"],
        progress_interval_s=0.0 if o["quiet"] else o["progress_interval"],
        metrics_port=o["metrics_port"],
        store_ports=ports,
        output=compat.output,
        per_rank_env=compat.per_rank_env,
        signals=compat.signals,
        event_log_handler=compat.event_log_handler,
    )
    for warning in compat.warnings:
        log.warning("%s", warning)
    if settings.metrics_port is not None:
        _check_metrics_listener(settings)
    return settings, embed


def visible_gpus() -> int:
    """GPU count without importing torch (the agent must start fast)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip() and d.strip() != "-1"])
    return len([p for p in pathlib.Path("/dev").glob("nvidia[0-9]*")])


def _nproc(value: str) -> int:
    """``--nproc-per-node``: a number, or cpu, gpu or auto (torchrun's meaning)."""
    value = str(value).strip().lower()
    if value == "cpu":
        return os.cpu_count() or 1
    if value in ("gpu", "auto"):
        gpus = visible_gpus()
        if value == "gpu" and gpus == 0:
            raise click.BadParameter(
                "'gpu' was asked for but no GPU is visible", param_hint="--nproc-per-node"
            )
        return gpus or (os.cpu_count() or 1)
    try:
        count = int(value)
    except ValueError:
        raise click.BadParameter(
            f"must be a positive integer, cpu, gpu or auto; got {value!r}", param_hint="--nproc-per-node"
        ) from None
    if count < 1:
        raise click.BadParameter(f"must be at least 1, got {count}", param_hint="--nproc-per-node")
    return count


def _worker_argv(script: str, args: tuple[str, ...], module: bool, no_python: bool) -> tuple[str, ...]:
    """The worker command line: ``python -u script args``, ``python -u -m module args`` or the command."""
    if module and no_python:
        raise click.UsageError("--module and --no-python cannot be used together")
    if no_python:
        if not (shutil.which(script) or os.path.exists(script)):
            raise click.UsageError(f"program {script!r} not found (with --no-python it is run as a command)")
        return (script, *args)
    if module:
        return (sys.executable, "-u", "-m", script, *args)
    if not os.path.isfile(script):
        raise click.UsageError(f"training script {script!r} not found")
    return (sys.executable, "-u", script, *args)


_NO_TOKEN_HELP = (
    "a job whose master is not on this machine's loopback needs a token, else anyone who can reach the "
    "master can control the job: create one (elastic-master --token-file tok creates it, or "
    "umask 077; python3 -c 'import secrets; print(secrets.token_urlsafe(32))' > tok), copy it to every "
    "node and pass --token-file tok (or set ELASTIC_TOKEN)"
)


def _token(
    token_file: str | None, job_id: str, masters: tuple[str, ...], unauthenticated_ok: bool = False
) -> tuple[str, bool]:
    """``(token, unauthenticated)``: --token-file, else ELASTIC_TOKEN, else (only where no other machine can
    reach the master: standalone, or a master on loopback) a random or derived one. Off loopback without a
    token: a usage error, unless ``unauthenticated_ok`` (torchrun's spellings of the rendezvous, which
    carry no token in torchrun either): then the derived token, ``unauthenticated`` True and one warning
    line naming the risk and the fix."""
    try:
        token = job_token(token_file)
    except TokenError as exc:
        raise click.BadParameter(str(exc), param_hint="--token-file") from None
    if token is not None:
        return token, False
    if not masters:
        return secrets.token_urlsafe(24), False  # standalone: the embedded master listens on 127.0.0.1 only
    # Torchrun-style command lines on one machine keep working with a derived token; off loopback the
    # listener rules refuse it (the master at that address, maybe hosted by an agent, would accept anyone).
    for address in masters:
        try:
            check_listener(MASTER_API, split_address(address)[0], auth=Auth.DERIVED, tls=False)
        except ListenerRuleError:
            if not unauthenticated_ok:
                raise click.UsageError(_NO_TOKEN_HELP) from None
            log.warning("%s", unauthenticated_warning(address))
            return derived_token(job_id), True
    return derived_token(job_id), False


def unauthenticated_warning(address: str) -> str:
    """The one line an agent of a token-less c10d job logs at start."""
    return (
        f"the job at {address} is {UNAUTHENTICATED} (torchrun's rendezvous spelling, no --token-file): "
        "as with torchrun's c10d store, anyone who can reach that port can join the job, read its status, "
        "and stop or restart every node; peer replication is off. To protect it, create a token (umask "
        "077; python3 -c 'import secrets; print(secrets.token_urlsafe(32))' > tok), copy it to every node "
        "and pass --token-file tok (or set ELASTIC_TOKEN)"
    )


def _tls(o: dict[str, Any], standalone: bool, embed: str | None) -> tuple[str | None, str | None, str | None]:
    """``(tls_ca, tls_cert, tls_key)`` checked: --tls-ca makes the agent speak https to every master
    address; --tls-cert/--tls-key serve the master this agent may host (convenience mode) over https."""
    ca, cert, key = o["tls_ca"], o["tls_cert"], o["tls_key"]
    if bool(cert) != bool(key):
        raise click.UsageError("--tls-cert and --tls-key go together: give both or neither")
    if cert and standalone:
        raise click.UsageError(
            "--tls-cert/--tls-key are for the master an agent hosts for other nodes; the --standalone "
            "master listens on 127.0.0.1 only and speaks plain http"
        )
    if cert and not ca:
        raise click.UsageError(
            "--tls-cert/--tls-key need --tls-ca: every agent, the hosting one included, verifies the "
            "master's certificate"
        )
    if standalone:
        return None, None, None  # the embedded master is on loopback: a CA meant for daemons is not used
    from elastic.control.tls import TLSConfigError, client_context, server_context  # ssl: only when asked for

    try:
        if ca:
            client_context(ca)
    except TLSConfigError as exc:
        raise click.BadParameter(str(exc), param_hint="--tls-ca") from None
    try:
        if cert and key:  # checked even where this agent will not host: a bad file is a typo either way
            server_context(cert, key)
    except TLSConfigError as exc:
        raise click.BadParameter(str(exc), param_hint="--tls-cert/--tls-key") from None
    return ca, cert, key


def _check_metrics_listener(settings: AgentSettings) -> None:
    """The listener rules for ``--metrics-port`` (before anything starts): a usage error, or warnings."""
    auth = Auth.DERIVED if settings.token == derived_token(settings.job.job_id) else Auth.SECRET
    try:
        warnings = check_listener(
            AGENT_METRICS, settings.local_addr or "127.0.0.1", auth=auth, tls=bool(settings.tls_cert)
        )
    except ListenerRuleError as exc:
        raise click.UsageError(f"--metrics-port: {exc}") from None
    for warning in warnings:
        log.warning("%s", warning)
