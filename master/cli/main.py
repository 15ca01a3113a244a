"""``elastic-master``: the job master daemon, ``elastic-master status`` and ``elastic-master readmit``."""

from __future__ import annotations

import errno
import logging
import os
import socket
import sys
import time
from collections.abc import Callable

import click

from elastic import errors
from elastic.control import job_settings as ms
from elastic.control.auth import TokenError, job_token
from elastic.control.cli_options import job_policy_options, job_settings_from
from elastic.control.listener_rules import MASTER_API, UNAUTHENTICATED, Auth, check_listener
from elastic.control.tls import (
    TLS_CA_ENV,
    TLS_CERT_ENV,
    TLS_KEY_ENV,
    TLSConfigError,
    client_context,
    server_context,
)
from elastic.text import LOG_FORMATS, configure_logging, reconfigure_logging
from master.cli.options import (
    bind_metrics,
    connection_options,
    connection_settings,
    observability_options,
    observability_settings,
)
from master.service.settings import ServerSettings

log = logging.getLogger(__name__)

CONTEXT = {"help_option_names": ["-h", "--help"], "max_content_width": 110}

#: The node field of the master's log lines.
MASTER_NODE = "master"
#: Default ``--bind-timeout``: long enough for a convenience master's job, or a step-down, to end.
DEFAULT_BIND_TIMEOUT_S = 30.0
#: Seconds between two binds of a port in use.
BIND_RETRY_S = 0.5


class _BadFileError(click.ClickException, errors.UsageError):
    """A bad file or address on the command line: exit 2, like a bad flag, with no usage line."""

    exit_code = 2


def _check_tls(cert: str | None, key: str | None) -> None:
    """Both TLS files or neither, and usable: checked before the port is bound, as a one-line error."""
    if bool(cert) != bool(key):
        raise click.UsageError("--tls-cert and --tls-key go together: give both (https) or neither (http)")
    if cert and key:
        try:
            server_context(cert, key)
        except TLSConfigError as exc:
            raise _BadFileError(str(exc)) from None


@click.group(context_settings=CONTEXT, invoke_without_command=True)
@click.option("--host", default="0.0.0.0", show_default=True, help="Address to listen on.")
@click.option(
    "--port", type=click.IntRange(0, 65535), default=29400, show_default=True, help="Port to listen on."
)
@click.option("--job-id", default=None, help="Id of the job this master serves (required to serve).")
@click.option("--nnodes", default="1:1", show_default=True, help="Number of nodes, N or MIN:MAX.")
@job_policy_options(embedded=False)
@click.option(
    "--max-restarts",
    type=click.IntRange(min=0),
    default=ms.DEFAULT_MAX_RESTARTS,
    show_default=True,
    help="Job-wide restarts after worker failures (membership changes are free).",
)
@click.option(
    "--flap-limit",
    type=click.IntRange(min=0),
    default=ms.DEFAULT_FLAP_LIMIT,
    show_default=True,
    help="Exclude a node id lost (declared dead, or its agent restarted) more than this many times within "
    "--flap-window; 0 turns this off.",
)
@click.option(
    "--flap-window",
    type=click.FloatRange(min=0, min_open=True),
    default=ms.DEFAULT_FLAP_WINDOW_S,
    show_default=True,
    help="Seconds over which a node's losses count for --flap-limit.",
)
@click.option(
    "--flap-cooldown",
    type=click.FloatRange(min=0, min_open=True),
    default=ms.DEFAULT_FLAP_COOLDOWN_S,
    show_default=True,
    help="Seconds a flapping node stays excluded before a join is accepted again ('elastic-master "
    "readmit' lifts it earlier).",
)
@click.option(
    "--suspect-count",
    type=click.IntRange(min=0),
    default=ms.DEFAULT_SUSPECT_COUNT,
    show_default=True,
    help="Exclude a node as suspect hardware (its agent exits 4) once the integrity guard names it the odd "
    "replica this many times within --suspect-window ('elastic-master readmit' lifts it); 0 turns this off.",
)
@click.option(
    "--suspect-window",
    type=click.FloatRange(min=0, min_open=True),
    default=ms.DEFAULT_SUSPECT_WINDOW_S,
    show_default=True,
    help="Seconds over which a node's namings as the odd replica count for --suspect-count.",
)
@click.option(
    "--straggler-policy",
    type=click.Choice(ms.STRAGGLER_POLICIES),
    default="report",
    show_default=True,
    help="What happens to a straggler (--straggler-factor): report (status and events only); evict (flagged "
    "for --straggler-window steps: removed from the next round while --nnodes MIN remain, its agent exits 4, "
    "excluded for --straggler-cooldown); replace (the same, only when a spare takes its slot).",
)
@click.option(
    "--straggler-window",
    type=click.IntRange(min=1),
    default=ms.DEFAULT_STRAGGLER_WINDOW,
    show_default=True,
    help="Steps of its own a node stays flagged as a straggler before --straggler-policy evict|replace acts.",
)
@click.option(
    "--straggler-cooldown",
    type=click.FloatRange(min=0, min_open=True),
    default=ms.DEFAULT_STRAGGLER_COOLDOWN_S,
    show_default=True,
    help="Seconds an evicted straggler stays excluded ('elastic-master readmit' lifts it earlier).",
)
@click.option(
    "--token-file",
    type=click.Path(dir_okay=False),
    default=None,
    help="Bearer token file; created with a random token if missing. Re-read when it changes: the new "
    "token is accepted at once, the previous one for one --heartbeat-timeout more (docs/security.md).",
)
@click.option(
    "--store",
    "store_url",
    default="memory://",
    show_default=True,
    help="Where job state lives: memory:// or etcd://[USER@]HOST:PORT[,HOST:PORT] (durable; enables standby "
    "masters and restarts without stopping training).",
)
@click.option(
    "--store-wait",
    type=click.FloatRange(min=0),
    default=0.0,
    show_default=True,
    help="Seconds to wait at start for an unreachable --store (etcd restarting or paused) before exiting "
    "with its error; 0: exit at once. Set it where a supervisor restarts the master (a standby): a restart "
    "during an etcd outage then waits for etcd instead of exiting.",
)
@click.option(
    "--store-password-file",
    type=click.Path(dir_okay=False),
    default=None,
    help="File holding the password of the etcd user named in --store (etcd with authentication on).",
)
@click.option(
    "--tls-cert",
    type=click.Path(dir_okay=False),
    envvar=TLS_CERT_ENV,
    default=None,
    help="Serve https with this PEM certificate (chain); needs --tls-key. Agents then need --tls-ca. "
    f"Default: {TLS_CERT_ENV}.",
)
@click.option(
    "--tls-key",
    type=click.Path(dir_okay=False),
    envvar=TLS_KEY_ENV,
    default=None,
    help=f"The certificate's PEM private key (unencrypted). Default: {TLS_KEY_ENV}.",
)
@click.option(
    "--exit-on-job-end",
    is_flag=True,
    help="Stop serving once the job ended and its agents learned it, and exit with the job's code: 0 only "
    "when it succeeded and its newest checkpoint step is durable, 1 when retryable (or not durable), 3 when "
    "failed for good (docs/cli.md, Exit codes). For a master per job (a Kubernetes Job, a SLURM step).",
)
@click.option(
    "--bind-timeout",
    type=click.FloatRange(min=0),
    default=DEFAULT_BIND_TIMEOUT_S,
    show_default=True,
    help="Seconds to retry binding --host:--port while another process holds it (an elastic-run agent's "
    "convenience master of this job, a master stepping down), one line saying so; then exit 1.",
)
@observability_options
@connection_options
@click.option(
    "--log-format",
    type=click.Choice(LOG_FORMATS),
    default="text",
    show_default=True,
    help="Log lines: text (TIME LEVEL master [LOGGER] MESSAGE, TIME in ISO 8601 UTC) or json (one object a "
    "line: time, level, node, logger, message, exc_info).",
)
# The installed distribution's version (importlib.metadata), looked up only when asked for.
@click.version_option(package_name="elastic-run", prog_name="elastic-master", message="%(prog)s %(version)s")
@click.pass_context
def cli(ctx: click.Context, **opts) -> None:
    """Serve one elastic job: rendezvous rounds, heartbeats, failure verdicts.

    \b
    Example:
      elastic-master --port 29400 --job-id j1 --nnodes 2:4 --token-file tok
    """
    reconfigure_logging(MASTER_NODE, opts["log_format"])
    if ctx.invoked_subcommand is not None:
        return
    if not opts["job_id"]:
        raise click.UsageError("--job-id is required to serve a job")
    try:
        low, high = ms.parse_nnodes(opts["nnodes"])
        job = job_settings_from(
            opts,
            job_id=opts["job_id"],
            min_nodes=low,
            max_nodes=high,
            flap_limit=opts["flap_limit"],
            flap_window_s=opts["flap_window"],
            flap_cooldown_s=opts["flap_cooldown"],
            suspect_count=opts["suspect_count"],
            suspect_window_s=opts["suspect_window"],
            straggler_policy=opts["straggler_policy"],
            straggler_window=opts["straggler_window"],
            straggler_cooldown_s=opts["straggler_cooldown"],
        )
    except ms.SettingsError as exc:
        raise click.UsageError(str(exc)) from None
    _check_tls(opts["tls_cert"], opts["tls_key"])
    try:
        token = job_token(opts["token_file"], create=True)  # a missing --token-file is created
    except (TokenError, OSError) as exc:
        raise click.UsageError(str(exc)) from None
    if token is None:
        raise click.UsageError("pass --token-file PATH (created if missing) or set ELASTIC_TOKEN")
    from master.cli.options import check_store, open_store, read_password_file
    from master.http.serving import bind_socket, serve_forever  # web stack only when serving
    from master.service.fault_hook import tick_fault_from_env
    from master.service.supervision import MasterFailure
    from master.store.base import StoreError

    try:
        tick_fault_s = tick_fault_from_env()  # the test hook (master/service/fault_hook.py)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    settings = ServerSettings(
        job=job,
        token=token,
        # Re-read when it changes (a rotated Kubernetes Secret): ELASTIC_TOKEN cannot change, a file can.
        token_file=os.path.abspath(opts["token_file"]) if opts["token_file"] else None,
        host=opts["host"],
        port=opts["port"],
        store_url=opts["store_url"],
        tls_cert=opts["tls_cert"],
        tls_key=opts["tls_key"],
        exit_on_job_end=opts["exit_on_job_end"],
    )
    settings = connection_settings(observability_settings(settings, opts), opts)
    try:
        password = read_password_file(opts["store_password_file"]) if opts["store_password_file"] else None
    except StoreError as exc:
        raise click.BadParameter(str(exc), param_hint="--store-password-file") from None
    try:
        check_store(settings.store_url, job.job_id, password=password, wait_s=opts["store_wait"])
    except StoreError as exc:
        raise click.ClickException(str(exc)) from None
    for warning in check_listener(MASTER_API, settings.host, auth=Auth.SECRET, tls=bool(settings.tls_cert)):
        log.warning("%s", warning)  # the master always has a secret token: only warnings, never a refusal
    sock = _bind(settings.host, settings.port, opts["bind_timeout"], bind_socket)
    host, port = sock.getsockname()[:2]
    # The plain line is unchanged (scripts and tests match it to its end); TLS adds a suffix.
    log.info("listening on %s:%d%s", host, port, " (https)" if settings.tls_cert else "")
    settings, metrics_sock = bind_metrics(settings, opts["metrics_port"], bind_socket)
    store = open_store(settings.store_url, job.job_id, password=password)
    try:
        code = serve_forever(settings, sock, store, metrics_sock, tick_fault_s=tick_fault_s)
    except MasterFailure as exc:  # it resigned already: a standby or the process supervisor takes over
        raise click.ClickException(str(exc)) from None
    if code is not None:  # --exit-on-job-end: the job's code (master.service.service.end_code)
        ctx.exit(code)


def _bind(host: str, port: int, timeout_s: float, bind: Callable[[str, int], socket.socket]) -> socket.socket:
    """Bind the API's listener. A port in use is retried for ``timeout_s`` (``--bind-timeout``), with one
    line at the first refusal: on a node where an agent hosts this job's master in convenience mode (or a
    master steps down) the port frees when that master stops; who bound first wins. Then exit 1."""
    deadline = time.monotonic() + timeout_s
    said = False
    while True:
        try:
            return bind(host, port)
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE or time.monotonic() >= deadline:
                raise click.ClickException(f"cannot listen on {host}:{port}: {exc.strerror}") from None
            if not said:
                log.warning(
                    "%s:%d is in use (an elastic-run agent's convenience master of this job, a master "
                    "stepping down, or another service): retrying for up to %gs (--bind-timeout)",
                    host,
                    port,
                    timeout_s,
                )
                said = True
            time.sleep(BIND_RETRY_S)  # a bind has nothing to wait on: the holder frees it when it exits


def client_options(command: Callable) -> Callable:
    """The options of a command that calls the leading master: where it is, the job, the token, TLS."""
    for option in reversed(
        [
            click.option(
                "--master", "master", required=True, help="Master HOST:PORT (comma-separated for several)."
            ),
            click.option("--job-id", required=True, help="Job id."),
            click.option(
                "--token-file", type=click.Path(dir_okay=False), default=None, help="Bearer token file."
            ),
            click.option(
                "--tls-ca",
                type=click.Path(dir_okay=False),
                envvar=TLS_CA_ENV,
                default=None,
                help="Speak https and verify the master's certificate with this PEM CA file. Default: "
                f"{TLS_CA_ENV}.",
            ),
        ]
    ):
        command = option(command)
    return command


@cli.command()
@client_options
@click.option("--json", "as_json", is_flag=True, help="Print the raw JSON status.")
@click.option(
    "--watch",
    is_flag=True,
    help="A live view in the terminal (nodes, the round and why it waits, goodput, checkpoints, recent "
    "events), redrawn every --interval until Ctrl-C.",
)
@click.option(
    "--interval",
    type=click.FloatRange(min=0.1),
    default=2.0,
    show_default=True,
    help="Seconds between two redraws of --watch.",
)
def status(
    master: str,
    job_id: str,
    token_file: str | None,
    tls_ca: str | None,
    as_json: bool,
    watch: bool,
    interval: float,
) -> None:
    """Print the job's nodes: id, rank, state, heartbeat age, restarts, round, world size, step time and
    flags (straggler, node-check verdict), then the node-check figures when the job ran a check, the
    nodes whose checkpoint persists fail, with the error, and what the round waits for."""
    from elastic.control.error_table import MasterError
    from master.cli.status import render_status

    if watch and as_json:
        raise click.UsageError("--watch and --json exclude each other (--json is for scripts)")
    client = _client(master, job_id, token_file, tls_ca)
    if watch:
        _watch(client, interval)
        return
    try:
        job = client.status()
    except MasterError as exc:
        raise _master_error(exc) from None
    finally:
        client.close()
    if as_json:
        click.echo(job.model_dump_json(indent=2))
        return
    if job_token(token_file, warn_loose=False) is None:  # the master took the token anyone can derive
        click.echo(
            f"auth: {UNAUTHENTICATED}: anyone who reaches the master controls the job (docs/security.md)"
        )
    click.echo(render_status(job))


@cli.command()
@click.argument("node_id")
@client_options
def readmit(node_id: str, master: str, job_id: str, token_file: str | None, tls_ca: str | None) -> None:
    """Re-admit NODE_ID, excluded for flapping (or as suspect hardware), before its cool-down ends: its next
    join is accepted (docs/failures.md, "Flapping nodes"; docs/integrity.md)."""
    from elastic.control.error_table import MasterError

    client = _client(master, job_id, token_file, tls_ca)
    try:
        reply = client.readmit(node_id)
    except MasterError as exc:
        raise _master_error(exc) from None
    finally:
        client.close()
    click.echo(reply.message)


def _master_error(exc: Exception) -> click.ClickException:
    """A failed call to the master as one line: exit 2 when the address is no elastic-master or the token is
    refused (fix the command: docs/cli.md's table, "a refused or missing token"), else 1."""
    from elastic.control.error_table import ErrorCode, MasterRejectedError, NotAMasterError

    refused = isinstance(exc, MasterRejectedError) and exc.code == ErrorCode.UNAUTHORIZED  # 401, or 429
    if isinstance(exc, NotAMasterError) or refused:
        return _BadFileError(str(exc))
    return click.ClickException(str(exc))


def _client(master: str, job_id: str, token_file: str | None, tls_ca: str | None):
    """A :class:`elastic.control.client.MasterClient` for an operator's command; bad options are usage
    errors."""
    from elastic.control.addresses import parse_addresses
    from elastic.control.auth import derived_token
    from elastic.control.client import MasterClient

    try:
        addresses = parse_addresses(master)
        token = job_token(token_file, warn_loose=False) or derived_token(job_id)
        if tls_ca:
            client_context(tls_ca)  # a bad CA file is a usage error, before any connection
    except (ValueError, TokenError) as exc:  # TLSConfigError is a ValueError
        raise click.UsageError(str(exc)) from None
    return MasterClient(addresses, job_id, token, tls_ca=tls_ca)


def _watch(client, interval: float) -> None:
    """``status --watch``: the live view until Ctrl-C; a refused request (wrong token or job) ends it."""
    from rich.console import Console

    from elastic.control.error_table import MasterError
    from master.cli.status import watch

    console = Console()
    try:
        if not console.is_terminal:
            raise click.UsageError("--watch needs a terminal; use the plain table or --json in scripts")
        client.status()  # a wrong token or job id is one line and exit 1, not a view that says so forever
        watch(client.status, interval, console, errors=(MasterError,))  # later: shown in the view, retried
    except MasterError as exc:
        raise _master_error(exc) from None
    finally:
        client.close()


def main(argv: list[str] | None = None) -> None:
    """Console entry point: one-line errors, exit 2 for bad input."""
    configure_logging(MASTER_NODE)  # until the options say otherwise (cli)
    try:
        code = cli.main(args=argv, prog_name="elastic-master", standalone_mode=False)
    except click.UsageError as exc:
        hint = exc.ctx.command_path if exc.ctx else "elastic-master"  # 'elastic-master status' for status
        print(f"elastic-master: error: {exc.format_message()} (see '{hint} --help')", file=sys.stderr)
        sys.exit(2)
    except click.ClickException as exc:
        print(f"elastic-master: error: {exc.format_message()}", file=sys.stderr)
        sys.exit(exc.exit_code)
    except click.Abort:
        sys.exit(130)
    sys.exit(code if isinstance(code, int) else 0)
