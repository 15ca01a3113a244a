"""Resolution of ``elastic-run``'s parsed options into frozen :class:`~agent.settings.AgentSettings`.

The options are declared in :mod:`agent.cli.main` (torchrun's in :mod:`agent.cli.torchrun_flags`), single
values checked in :mod:`agent.cli.values`; this module combines them: the master addresses and whether this
agent hosts the master, the job settings, torchrun's compatibility flags, the token and TLS.
"""

from __future__ import annotations

import logging
import os
import pathlib
import socket
import uuid

import click
from click.core import ParameterSource

from agent.cli import values
from agent.cli.torchrun_flags import resolve_torchrun
from agent.executor.net import is_local_host, local_address_for
from agent.settings import DEFAULT_STOP_GRACE_S, AgentSettings
from elastic.control import job_settings as ms
from elastic.control.addresses import parse_addresses, split_address
from elastic.control.protocol import valid_host

log = logging.getLogger(__name__)


def given_options(ctx: click.Context) -> frozenset[str]:
    """Names of the options the user gave, on the command line or through their ``PET_*`` variable."""
    given = (ParameterSource.COMMANDLINE, ParameterSource.ENVIRONMENT)
    return frozenset(name for name in ctx.params if ctx.get_parameter_source(name) in given)


def resolve(o: dict, given: frozenset[str] = frozenset()) -> tuple[AgentSettings, str | None]:
    """Resolve the CLI into frozen settings; returns (settings, address to embed a master at or None).

    ``given``: the options the user gave (see :func:`given_options`); torchrun flags that cannot apply
    here are warned about only then, once each."""
    try:
        min_nodes, max_nodes = ms.parse_nnodes(o["nnodes"])
    except ms.SettingsError as exc:
        raise click.BadParameter(str(exc).removeprefix("--nnodes "), param_hint="--nnodes") from None
    nproc = values.nproc(o["nproc_per_node"])
    argv = values.worker_argv(o["training_script"], o["training_script_args"], o["module"], o["no_python"])
    endpoint = o["rdzv_endpoint"]
    if not endpoint and not o["standalone"] and (o["master_addr"] or max_nodes > 1):
        endpoint = f"{o['master_addr'] or '127.0.0.1'}:{o['master_port'] or 29500}"
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
    rdzv_conf, unknown_rdzv_keys = values.rdzv_conf(o["rdzv_conf"])
    compat = resolve_torchrun(
        o,
        given,
        nproc=nproc,
        gpus=values.visible_gpus(),
        default_stop_grace=DEFAULT_STOP_GRACE_S,
        unknown_rdzv_keys=unknown_rdzv_keys,
    )
    job_id = o["rdzv_id"]
    if standalone and job_id == "none":
        job_id = f"standalone-{uuid.uuid4().hex[:8]}"
    try:
        job = ms.JobSettings(
            job_id=job_id,
            min_nodes=min_nodes,
            max_nodes=max_nodes,
            node_unit=o["node_unit"],
            heartbeat_interval_s=o["heartbeat_interval"],
            heartbeat_timeout_s=o["heartbeat_timeout"],
            max_restarts=o["max_restarts"],
            straggler_factor=o["straggler_factor"],
            node_check=o["node_check"],
            node_check_factor=o["node_check_factor"],
            # --rdzv-conf's join_timeout/last_call_timeout, unless --join-timeout/--last-call are given.
            **{
                key: rdzv_conf[key] if key in rdzv_conf and flag not in given else o[flag]
                for key, flag in (("join_timeout_s", "join_timeout"), ("last_call_s", "last_call"))
            },
        )
    except ms.SettingsError as exc:
        raise click.UsageError(str(exc)) from None
    if o["local_addr"] and not valid_host(o["local_addr"]):
        raise click.BadParameter(
            f"{o['local_addr']!r} is not an IP address or a host name", param_hint="--local-addr"
        )
    host = o["local_addr"] or ("127.0.0.1" if standalone else local_address_for(split_address(masters[0])[0]))
    embed = None
    if not standalone and len(masters) == 1 and is_local_host(split_address(masters[0])[0]):
        embed = masters[0]
    tls_ca, tls_cert, tls_key = values.tls(o, standalone, embed)
    settings = AgentSettings(
        argv=argv,
        nproc=nproc,
        job=job,
        token=values.token(o["token_file"], job_id, masters),
        node_id=o["node_id"] or f"{socket.gethostname()}-{os.getpid()}",
        masters=masters,
        host_master_at=None,
        tls_ca=tls_ca,
        tls_cert=tls_cert,
        tls_key=tls_key,
        local_addr=host,
        role=o["role"],
        log_dir=pathlib.Path(o["log_dir"]).resolve() if o["log_dir"] else None,
        ckpt_dir=pathlib.Path(o["ckpt_dir"]).resolve() if o["ckpt_dir"] else None,
        ckpt_keep=o["ckpt_keep"],
        replicas=o["replicas"],
        replication_lag=o["replication_lag"],
        replication_bandwidth=o["replication_bandwidth"],
        ckpt_reset=o["ckpt_reset"],
        stop_grace_s=compat.stop_grace_s,
        master_timeout_s=o["master_timeout"],
        warm_start=not o["no_warm_start"],
        hang_timeout_s=o["hang_timeout"],
        progress_interval_s=0.0 if o["quiet"] else o["progress_interval"],
        metrics_port=o["metrics_port"],
        output=compat.output,
        per_rank_env=compat.per_rank_env,
        signals=compat.signals,
        event_log_handler=compat.event_log_handler,
    )
    for warning in compat.warnings:
        log.warning("%s", warning)
    if settings.metrics_port is not None:
        values.check_metrics_listener(settings)
    return settings, embed
