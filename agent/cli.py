"""``elastic-run``: torchrun's command line, elastic underneath.

Every torchrun flag keeps its spelling (dashes or underscores) and its ``PET_*`` environment default,
so a torchrun command line works after replacing the command name.
"""

from __future__ import annotations

import logging
import os
import pathlib
import secrets
import shutil
import socket
import sys
import uuid

import click
from click.core import ParameterSource

from agent.cli_torchrun import resolve_torchrun, torchrun_options
from agent.errors import EXIT_CONFIG, AgentError
from agent.net import is_local_host, local_address_for
from agent.progress import DEFAULT_PROGRESS_INTERVAL_S
from agent.settings import (
    DEFAULT_HANG_TIMEOUT_S,
    DEFAULT_MASTER_TIMEOUT_S,
    DEFAULT_STOP_GRACE_S,
    AgentSettings,
)
from elastic import job_settings as ms
from elastic.addresses import parse_addresses, split_address
from elastic.auth import TOKEN_ENV, TokenError, derived_token, loose_permissions_warning, read_token_file
from elastic.cli_options import job_policy_options
from elastic.listener_rules import AGENT_METRICS, MASTER_API, Auth, ListenerRuleError, check_listener
from elastic.master_errors import MasterError
from elastic.protocol import valid_host
from elastic.text import printable

log = logging.getLogger("elastic.agent")

_RDZV_CONF_KEYS = {"join_timeout": "join_timeout_s", "last_call_timeout": "last_call_s"}


def _nproc(value: str) -> int:
    value = str(value).strip().lower()
    if value == "cpu":
        return os.cpu_count() or 1
    if value in ("gpu", "auto"):
        gpus = _visible_gpus()
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


def _visible_gpus() -> int:
    """GPU count without importing torch (the agent must start fast)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip() and d.strip() != "-1"])
    return len([p for p in pathlib.Path("/dev").glob("nvidia[0-9]*")])


def _rdzv_conf(text: str) -> tuple[dict[str, float], tuple[str, ...]]:
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


def _worker_argv(script: str, args: tuple[str, ...], module: bool, no_python: bool) -> tuple[str, ...]:
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


def _token(token_file: str | None, job_id: str, masters: tuple[str, ...]) -> str:
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


def _tls(o: dict, standalone: bool, embed: str | None) -> tuple[str | None, str | None, str | None]:
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
    from elastic.tls import TLSConfigError, client_context, server_context  # ssl: only when asked for

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


CONTEXT = {
    "help_option_names": ["-h", "--help"],
    "auto_envvar_prefix": "PET",
    "allow_interspersed_args": False,
    "max_content_width": 110,
}


@click.command(context_settings=CONTEXT)
@click.option("--nnodes", default="1:1", show_default=True, help="Number of nodes, N or MIN:MAX.")
@click.option(
    "--nproc-per-node",
    "--nproc_per_node",
    "nproc_per_node",
    default="1",
    show_default=True,
    help="Workers per node: a number, cpu, gpu or auto.",
)
@click.option("--standalone", is_flag=True, help="Single-node job with an embedded master on a free port.")
@click.option(
    "--rdzv-endpoint",
    "--rdzv_endpoint",
    "--master",
    "rdzv_endpoint",
    default="",
    help="Job master HOST:PORT (several, comma-separated, for standby masters).",
)
@click.option(
    "--rdzv-id", "--rdzv_id", "--job-id", "rdzv_id", default="none", show_default=True, help="Job id."
)
@click.option(
    "--rdzv-backend",
    "--rdzv_backend",
    "rdzv_backend",
    default="c10d",
    show_default=True,
    help="Accepted for torchrun compatibility; the elastic master is always used.",
)
@click.option(
    "--rdzv-conf",
    "--rdzv_conf",
    "rdzv_conf",
    default="",
    help="torchrun's KEY=VALUE list; join_timeout and last_call_timeout are honoured, others warned about.",
)
@click.option(
    "--max-restarts",
    "--max_restarts",
    "max_restarts",
    type=click.IntRange(min=0),
    default=ms.DEFAULT_MAX_RESTARTS,
    show_default=True,
    help="Job-wide restarts after worker failures.",
)
@click.option(
    "--token-file",
    type=click.Path(dir_okay=False),
    default=None,
    help="File with the job's bearer token (default: ELASTIC_TOKEN, else derived from the job id).",
)
@click.option(
    "--tls-ca",
    type=click.Path(dir_okay=False),
    envvar="ELASTIC_TLS_CA",  # elastic.tls.TLS_CA_ENV, not imported at start (ssl costs milliseconds)
    default=None,
    help="Speak https to the master and verify its certificate with this PEM CA file (default: "
    "ELASTIC_TLS_CA); not used with --standalone.",
)
@click.option(
    "--tls-cert",
    type=click.Path(dir_okay=False),
    default=None,
    help="Convenience mode: the master this agent hosts serves https with this PEM certificate; needs "
    "--tls-key and --tls-ca.",
)
@click.option(
    "--tls-key",
    type=click.Path(dir_okay=False),
    default=None,
    help="Convenience mode: the PEM private key (unencrypted) of --tls-cert.",
)
@click.option("--node-id", default=None, help="Stable id of this node (default: HOSTNAME-PID).")
@click.option(
    "--local-addr",
    "--local_addr",
    "local_addr",
    default=None,
    help="Address other nodes reach this node on (default: the route to the master).",
)
@click.option(
    "--master-addr",
    "--master_addr",
    "master_addr",
    default=None,
    help="torchrun static rendezvous: used as the master host when no --rdzv-endpoint is given.",
)
@click.option(
    "--master-port",
    "--master_port",
    "master_port",
    type=click.IntRange(1, 65535),
    default=None,
    help="torchrun static rendezvous: the master port (default 29500).",
)
@click.option("--role", default="default", show_default=True, help="Worker role name (ROLE_NAME).")
@click.option("-m", "--module", is_flag=True, help="Run the script as a Python module (python -m).")
@click.option("--no-python", "--no_python", "no_python", is_flag=True, help="Run the script as a command.")
@click.option(
    "--log-dir",
    "--log_dir",
    "log_dir",
    type=click.Path(file_okay=False),
    default=None,
    help="Also write each worker's stdout/stderr to LOG_DIR/round<N>/rank<R>/{stdout,stderr}.log.",
)
@torchrun_options()
@click.option(
    "--ckpt-dir",
    type=click.Path(file_okay=False),
    default=None,
    help="Checkpoint folder, exported to workers as ELASTIC_CKPT_DIR; the agent persists the workers' "
    "in-memory checkpoints there in the background.",
)
@click.option(
    "--ckpt-keep",
    type=click.IntRange(min=1),
    default=3,
    show_default=True,
    help="Checkpoints to keep in --ckpt-dir.",
)
@click.option(
    "--replicas",
    type=click.IntRange(min=0, max=64),
    default=1,
    show_default=True,
    help="Peer nodes that hold a copy of this node's sharded memory checkpoints (ring order); 0: none.",
)
@click.option(
    "--replication-lag",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Steps the peers' replicas may lag the newest sharded save before the next save waits.",
)
@click.option(
    "--replication-bandwidth",
    type=click.FloatRange(min=0),
    default=0.0,
    show_default=True,
    help="Cap on the bandwidth of replication to each peer, in MB/s; 0: no cap.",
)
@click.option(
    "--ckpt-reset",
    is_flag=True,
    help="Start this node's first workers without its existing checkpoints (ELASTIC_CKPT_RESET=1 for "
    "elastic.load): give it on every node for a deliberate fresh start; a checkpoint another node holds "
    "is still restored. Use a new --ckpt-dir or job id, so that older files do not shadow the new run.",
)
@job_policy_options(embedded=True)
@click.option(
    "--stop-grace",
    type=click.FloatRange(min=0),
    default=DEFAULT_STOP_GRACE_S,
    show_default=True,
    help="Seconds between SIGTERM and SIGKILL when stopping workers (torchrun: --shutdown-timeout).",
)
@click.option(
    "--master-timeout",
    type=click.FloatRange(min=0, min_open=True),
    default=DEFAULT_MASTER_TIMEOUT_S,
    show_default=True,
    help="Give up after the master is unreachable this long (workers keep training meanwhile), or keeps "
    "refusing this agent's join because a live agent uses its --node-id.",
)
@click.option(
    "--hang-timeout",
    type=click.FloatRange(min=0),
    default=DEFAULT_HANG_TIMEOUT_S,
    show_default=True,
    help="A worker that reported steps and made none for this many seconds, or whose process is stopped "
    "or in disk sleep this long, is hung: its stack is recorded and the world restarts. 0: off.",
)
@click.option(
    "--no-warm-start",
    "no_warm_start",
    is_flag=True,
    help="Always start workers with a fresh interpreter (exec), never from the pre-started one that has "
    "torch imported.",
)
@click.option(
    "--progress-interval",
    type=click.FloatRange(min=0),
    default=DEFAULT_PROGRESS_INTERVAL_S,
    show_default=True,
    help="Seconds between two progress lines of this agent (round, step, steps/s, world, restarts, last "
    "checkpoint). 0: none.",
)
@click.option("--quiet", is_flag=True, help="No progress lines (the same as --progress-interval 0).")
@click.option(
    "--metrics-port",
    type=click.IntRange(0, 65535),
    default=None,
    help="Serve this agent's Prometheus metrics (GET /metrics, the job token as bearer token) on this port "
    "of --local-addr; 0: a free port (logged).",
)
@click.argument("training_script")
@click.argument("training_script_args", nargs=-1, type=click.UNPROCESSED)
def cli(**opts) -> int:
    """Run TRAINING_SCRIPT on this node as part of an elastic job (torchrun-compatible)."""
    settings, embed = _settings(opts, _given(click.get_current_context()))
    # The job-control token stays in the agent: workers (user code, its subprocesses, crash reporters) and
    # the warm-start zygote, whose environments derive from os.environ, never see it.
    os.environ.pop(TOKEN_ENV, None)
    return run_agent(settings, embed)


def _given(ctx: click.Context) -> frozenset[str]:
    """Names of the options the user gave, on the command line or through their ``PET_*`` variable."""
    given = (ParameterSource.COMMANDLINE, ParameterSource.ENVIRONMENT)
    return frozenset(name for name in ctx.params if ctx.get_parameter_source(name) in given)


def _settings(o: dict, given: frozenset[str] = frozenset()) -> tuple[AgentSettings, str | None]:
    """Resolve the CLI into frozen settings; returns (settings, address to embed a master at or None).

    ``given``: the options the user gave (see :func:`_given`); torchrun flags that cannot apply here are
    warned about only then, once each."""
    try:
        min_nodes, max_nodes = ms.parse_nnodes(o["nnodes"])
    except ms.SettingsError as exc:
        raise click.BadParameter(str(exc).removeprefix("--nnodes "), param_hint="--nnodes") from None
    nproc = _nproc(o["nproc_per_node"])
    argv = _worker_argv(o["training_script"], o["training_script_args"], o["module"], o["no_python"])
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
    rdzv_conf, unknown_rdzv_keys = _rdzv_conf(o["rdzv_conf"])
    compat = resolve_torchrun(
        o,
        given,
        nproc=nproc,
        gpus=_visible_gpus(),
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
    tls_ca, tls_cert, tls_key = _tls(o, standalone, embed)
    settings = AgentSettings(
        argv=argv,
        nproc=nproc,
        job=job,
        token=_token(o["token_file"], job_id, masters),
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
        _check_metrics_listener(settings)
    return settings, embed


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


def run_agent(settings: AgentSettings, embed_at: str | None) -> int:
    """Start (or find) the master, then run the agent loop; returns the exit code."""
    from agent import replication
    from agent.ckpt_keeper import KeeperError, keeper_for  # light imports (stdlib, psutil), as the next two
    from agent.warm import WarmLauncher
    from agent.workers import Reaper, WorkerGroup

    reaper = Reaper()
    # The zygote starts first: importing torch is the longest step of a new node's first worker start,
    # and it runs while this agent imports the rest, finds the master and waits for its round.
    launcher = WarmLauncher(reaper, argv_hint=settings.argv) if settings.warm_start else None
    master = client = group = channel = keeper = agent = metrics = None
    try:
        # The HTTP client and pydantic (~0.15 s of imports) only now, while the zygote imports torch.
        from agent.bootstrap import connect_or_host_master
        from agent.channel import ProgressChannel
        from agent.loop import ElasticAgent
        from elastic.client import MasterClient

        master, settings = connect_or_host_master(settings, embed_at)
        client = MasterClient(
            list(settings.masters), settings.job.job_id, settings.token, tls_ca=settings.tls_ca
        )
        group = WorkerGroup(reaper=reaper, launcher=launcher)
        # Checkpoint shared memory of this node; the test hook ELASTIC_PERSIST_DELAY_S slows its persists.
        keeper = keeper_for(
            settings.job.job_id, settings.node_id, settings.ckpt_dir, settings.ckpt_keep, os.environ
        )
        channel = ProgressChannel(on_checkpoint=keeper.on_checkpoint)
        reaper.remove_on_exit(channel.folder)
        keeper.start()
        replication.attach(keeper, settings)  # peer replication of sharded memory checkpoints
        agent = ElasticAgent(settings, client, group, channel, worker_env=keeper.worker_env(), keeper=keeper)
        metrics = _serve_metrics(agent, settings)
        return agent.run()
    except KeeperError as exc:
        raise AgentError(f"cannot set up the checkpoint shared memory: {exc}") from None
    finally:
        if metrics is not None:
            metrics.stop()
        if group is not None:
            group.close()
        if launcher is not None:
            launcher.close()
        if channel is not None:
            channel.close()
        if keeper is not None:
            keeper.stop()  # after the workers: persists what is pending, then frees the memory
        reaper.close()
        if client is not None:
            client.close()
        if master is not None:
            master.stop()
        if agent is not None and agent.failure_summary:
            print(f"elastic-run: job failed: {printable(agent.failure_summary)}", file=sys.stderr, flush=True)


def _serve_metrics(agent, settings: AgentSettings):  # noqa: ANN001, ANN202 - agent.loop / agent.metrics
    """Start the ``--metrics-port`` listener (agent.metrics), or None without the option."""
    if settings.metrics_port is None:
        return None
    from agent.metrics import serve  # prometheus_client only when asked for
    from elastic.tls import TLSConfigError, server_context

    host = settings.local_addr or "127.0.0.1"
    try:
        tls = (
            server_context(settings.tls_cert, settings.tls_key)
            if settings.tls_cert and settings.tls_key
            else None
        )
        return serve(agent, host, settings.metrics_port, tls)
    except TLSConfigError as exc:
        raise AgentError(f"--metrics-port: {exc}", EXIT_CONFIG) from None
    except OSError as exc:
        raise AgentError(
            f"cannot listen on {host}:{settings.metrics_port} (--metrics-port): {exc.strerror or exc}",
            EXIT_CONFIG,
        ) from None


def main(argv: list[str] | None = None) -> None:
    """Console entry point: one-line errors, torchrun-like exit codes."""
    logging.basicConfig(level=logging.INFO, format="[%(name)s] %(message)s", stream=sys.stderr)
    logging.getLogger("httpx").setLevel(logging.WARNING)
    try:
        code = cli.main(args=argv, prog_name="elastic-run", standalone_mode=False)
    except click.UsageError as exc:
        hint = exc.ctx.command_path if exc.ctx else "elastic-run"
        print(f"elastic-run: error: {exc.format_message()} (see '{hint} --help')", file=sys.stderr)
        sys.exit(EXIT_CONFIG)
    except click.ClickException as exc:
        print(f"elastic-run: error: {exc.format_message()}", file=sys.stderr)
        sys.exit(exc.exit_code)
    except click.Abort:
        sys.exit(130)
    except AgentError as exc:
        print(f"elastic-run: error: {exc}", file=sys.stderr)
        sys.exit(exc.exit_code)
    except MasterError as exc:
        print(f"elastic-run: error: {exc}", file=sys.stderr)
        sys.exit(1)
    sys.exit(code if isinstance(code, int) else 0)
