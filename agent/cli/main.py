"""``elastic-run``: torchrun's command line, elastic underneath.

Every torchrun flag keeps its spelling (dashes or underscores) and its ``PET_*`` environment default,
so a torchrun command line works after replacing the command name. This module declares the options
(torchrun's process and log flags come from :mod:`agent.cli.torchrun`) and the console entry point;
:mod:`agent.cli.resolve` resolves them into settings and :func:`run_agent` runs the agent.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import socket
import sys

import click

from agent.cli.resolve import explicit_options, given_options, resolve, resolve_platform
from agent.cli.startup import run_agent
from agent.cli.torchrun import torchrun_options
from agent.errors import EXIT_CONFIG, AgentError
from agent.observe.progress import DEFAULT_PROGRESS_INTERVAL_S
from agent.settings import (
    DEFAULT_HANG_TIMEOUT_S,
    DEFAULT_MASTER_TIMEOUT_S,
    DEFAULT_PREEMPT_SIGNAL,
    DEFAULT_STOP_GRACE_S,
    preempt_signal,
)
from elastic.contract import DEFAULT_CKPT_KEEP
from elastic.control import job_settings as ms
from elastic.control.auth import TOKEN_ENV
from elastic.control.cli_options import job_policy_options
from elastic.control.error_table import MasterError, NotAMasterError
from elastic.text import LOG_FORMATS, configure_logging, reconfigure_logging

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
    "--master",
    "master",
    default="",
    help="Job master HOST:PORT (several, comma-separated, for standby masters). A master that does not "
    "answer is waited for (--master-timeout), never replaced by one this agent hosts unless --host-master.",
)
@click.option(
    "--rdzv-endpoint",
    "--rdzv_endpoint",
    "rdzv_endpoint",
    default="",
    help="torchrun's spelling of --master; with --rdzv-backend c10d (the default) and an address of this "
    "host, the first agent there hosts the master when none answers (convenience mode).",
)
@click.option(
    "--host-master",
    is_flag=True,
    help="Convenience mode for --master: when no master answers at its address (one, on this host), this "
    "agent hosts it (memory store; that node is then a single point of failure).",
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
    envvar="ELASTIC_TLS_CA",  # elastic.control.tls.TLS_CA_ENV, not imported at start (ssl costs milliseconds)
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
    default=DEFAULT_CKPT_KEEP,
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
    "--replication-peer-cap",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    help="MiB of this node's shared memory one peer's replica may take (a larger push is refused); 0: the "
    "/dev/shm size / (--replicas + 2).",
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
    "--preempt-signal",
    default=DEFAULT_PREEMPT_SIGNAL,
    show_default=True,
    callback=lambda ctx, param, value: _preempt_signal(value),
    help="The scheduler's pre-emption warning (SLURM: --signal=USR1@90): stop as for SIGTERM, persist the "
    "newest checkpoint, exit 1 (retryable: requeue the job); none: off. A signal --signals-to-handle also "
    "lists is forwarded to the workers instead.",
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
    help="A worker that made steps and made none for this many seconds, or whose process is stopped or in "
    "disk sleep this long, is hung: its stack is recorded and the world restarts. 0: off. Default: adaptive, "
    "no progress (optimizer step, forward pass) for max(3 x p99 step time, 2 s) after a warm-up (600 s "
    "before it and during checkpoint saves; docs/failures.md).",
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
@click.option(
    "--quiet",
    is_flag=True,
    help="Only warnings, errors, the job's outcome and the workers' own output: no progress lines (as "
    "--progress-interval 0) and no other control-plane lines.",
)
@click.option(
    "--log-format",
    type=click.Choice(LOG_FORMATS),
    default="text",
    show_default=True,
    help="The agent's log lines: text (TIME LEVEL NODE [LOGGER] MESSAGE, TIME in ISO 8601 UTC) or json "
    "(one object a line: time, level, node, logger, message, exc_info). Worker output stays as it is.",
)
@click.option(
    "--metrics-port",
    type=click.IntRange(0, 65535),
    default=None,
    help="Serve this agent's Prometheus metrics (GET /metrics, the job token as bearer token) on this port "
    "of --local-addr; 0: a free port (logged).",
)
# The installed distribution's version (importlib.metadata), looked up only when asked for.
@click.version_option(package_name="elastic-run", prog_name="elastic-run", message="%(prog)s %(version)s")
@click.argument("training_script")
@click.argument("training_script_args", nargs=-1, type=click.UNPROCESSED)
def cli(**opts) -> int:
    """Run TRAINING_SCRIPT on this node as part of an elastic job (torchrun-compatible)."""
    # Before resolving: its warnings carry the node id too (resolve's default is the same HOSTNAME-PID).
    node = opts["node_id"] or default_node_id()
    reconfigure_logging(node, opts["log_format"], quiet=opts["quiet"])
    ctx = click.get_current_context()
    opts, given, platform = resolve_platform(opts, explicit_options(ctx), given_options(ctx), os.environ)
    if platform is not None and opts["node_id"] != node:
        reconfigure_logging(opts["node_id"], opts["log_format"], quiet=opts["quiet"])  # the platform's id
    settings, embed = resolve(opts, given)
    # Pre-emption, and SLURM's name of this node for the drain check before each join (docs/slurm.md).
    slurm_node = os.environ.get("SLURMD_NODENAME") or None
    settings = dataclasses.replace(settings, preempt_signal=opts["preempt_signal"], slurm_node=slurm_node)
    # The job-control token stays in the agent: workers (user code, its subprocesses, crash reporters) and
    # the warm-start zygote, whose environments derive from os.environ, never see it.
    os.environ.pop(TOKEN_ENV, None)
    return run_agent(settings, embed)


def _preempt_signal(value: str) -> signal.Signals | None:
    try:
        return preempt_signal(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--preempt-signal") from None


def default_node_id() -> str:
    """This node's id without --node-id: HOSTNAME-PID."""
    return f"{socket.gethostname()}-{os.getpid()}"


def main(argv: list[str] | None = None) -> None:
    """Console entry point: one-line errors, torchrun-like exit codes."""
    configure_logging(default_node_id())  # until the options say otherwise (cli)
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
        sys.exit(EXIT_CONFIG if isinstance(exc, NotAMasterError) else 1)
    sys.exit(code if isinstance(code, int) else 0)
