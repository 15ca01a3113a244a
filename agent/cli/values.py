"""Checks of single ``elastic-run`` option values, at the edge: the worker count, ``--rdzv-conf``, the
worker command, the job token, the TLS files and the ``--metrics-port`` listener.

Each bad value is a click usage error (one line, exit 2), raised before anything starts;
:mod:`agent.cli.resolve` assembles the checked values into settings.
"""

from __future__ import annotations

import logging
import os
import pathlib
import secrets
import shutil
import sys

import click

from agent.settings import AgentSettings
from elastic.control.addresses import split_address
from elastic.control.auth import (
    TOKEN_ENV,
    TokenError,
    derived_token,
    loose_permissions_warning,
    read_token_file,
)
from elastic.control.listener_rules import AGENT_METRICS, MASTER_API, Auth, ListenerRuleError, check_listener

log = logging.getLogger(__name__)

_RDZV_CONF_KEYS = {"join_timeout": "join_timeout_s", "last_call_timeout": "last_call_s"}


def nproc(value: str) -> int:
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


def visible_gpus() -> int:
    """GPU count without importing torch (the agent must start fast)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip() and d.strip() != "-1"])
    return len([p for p in pathlib.Path("/dev").glob("nvidia[0-9]*")])


def rdzv_conf(text: str) -> tuple[dict[str, float], tuple[str, ...]]:
    """The job settings --rdzv-conf sets, and the keys it names that have no meaning here."""
    out: dict[str, float] = {}
    unknown: list[str] = []
    for item in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep:
            raise click.BadParameter(f"expected KEY=VALUE, got {item!r}", param_hint="--rdzv-conf")
        if key in _RDZV_CONF_KEYS:
            try:
                out[_RDZV_CONF_KEYS[key]] = float(value)
            except ValueError:
                raise click.BadParameter(
                    f"{key} must be a number of seconds", param_hint="--rdzv-conf"
                ) from None
        elif key not in unknown:  # torchrun's timeout, read_timeout, is_host, ...: warned about
            unknown.append(key)
    return out, tuple(unknown)


def worker_argv(script: str, args: tuple[str, ...], module: bool, no_python: bool) -> tuple[str, ...]:
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


def token(token_file: str | None, job_id: str, masters: tuple[str, ...]) -> str:
    """The job's token: --token-file, else ELASTIC_TOKEN, else (only where no other machine can reach the
    master: standalone, or a master on loopback) a random or derived one."""
    if token_file:
        try:
            token = read_token_file(token_file)
        except TokenError as exc:
            raise click.BadParameter(str(exc), param_hint="--token-file") from None
        if warning := loose_permissions_warning(token_file):
            log.warning("%s", warning)
        return token
    if os.environ.get(TOKEN_ENV):
        return os.environ[TOKEN_ENV]
    if not masters:
        return secrets.token_urlsafe(24)  # standalone: the embedded master listens on 127.0.0.1 only
    # Torchrun-style command lines on one machine keep working with a derived token; off loopback the
    # listener rules refuse it (the master at that address, maybe hosted by an agent, would accept anyone).
    for address in masters:
        try:
            check_listener(MASTER_API, split_address(address)[0], auth=Auth.DERIVED, tls=False)
        except ListenerRuleError:
            raise click.UsageError(_NO_TOKEN_HELP) from None
    return derived_token(job_id)


def tls(o: dict, standalone: bool, embed: str | None) -> tuple[str | None, str | None, str | None]:
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
        if cert and key and embed is not None:  # the other nodes of a torchrun-style command never host
            server_context(cert, key)
    except TLSConfigError as exc:
        raise click.BadParameter(str(exc), param_hint="--tls-cert/--tls-key") from None
    return ca, cert, key


def check_metrics_listener(settings: AgentSettings) -> None:
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
