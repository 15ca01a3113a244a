"""Start an agent's parts in order and stop them in reverse: the process reaper, the warm-start zygote,
the master (found, or hosted in this process: standalone, or torchrun's c10d convenience mode, the only
place the agent imports :mod:`master`), the worker group, the checkpoint keeper and its peer replication,
the progress channel, the agent loop and its metrics listener.

:func:`run_agent` is what ``elastic-run`` runs once its settings are resolved (:mod:`agent.cli.main`). The
imports are inside the functions: the zygote starts before the slower ones, and torch is never imported.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shlex
import sys
import tempfile
import time
from typing import TYPE_CHECKING

from agent.errors import EXIT_CONFIG, EXIT_FAILED, AgentError
from agent.settings import AgentSettings
from elastic.control.addresses import split_address
from elastic.control.error_table import MasterError, MasterTLSError, MasterUnreachableError, NotAMasterError
from elastic.control.listener_rules import MASTER_API, UNAUTHENTICATED, Auth, check_listener
from elastic.exit_codes import ExitCode
from elastic.text import ALWAYS_SHOWN, printable

if TYPE_CHECKING:
    from agent.checkpoints.keeper import CheckpointKeeper
    from agent.workers.reaper import Reaper
    from master.http.serving import EmbeddedMaster  # the web stack is imported only when hosting

log = logging.getLogger(__name__)


def run_agent(settings: AgentSettings, embed_at: str | None) -> int:
    """Start (or find) the master, then run the agent loop; returns the exit code."""
    from agent.checkpoints import replication
    from agent.checkpoints.keeper import keeper_for  # light imports (stdlib, psutil), as the next three
    from agent.checkpoints.shm_folder import FolderHeldError, KeeperError, RootError
    from agent.warm.starter import WarmLauncher
    from agent.workers.group import Reaper, WorkerGroup
    from agent.workers.launchers import become_child_subreaper

    # A worker's descendant that starts its own session and loses its parent comes to the agent rather
    # than to init, so the worker group's stop() ends and reaps it (agent.workers.tree).
    become_child_subreaper()
    reaper = Reaper()
    # The zygote starts first: importing torch is the longest step of a new node's first worker start,
    # and it runs while this agent imports the rest, finds the master and waits for its round.
    launcher = WarmLauncher(reaper, argv_hint=settings.argv) if settings.warm_start else None
    master = client = group = channel = keeper = agent = metrics = None
    try:
        # The HTTP client and pydantic (~0.15 s of imports) only now, while the zygote imports torch.
        from agent.executor.loop import ElasticAgent
        from agent.observe.channel import ProgressChannel
        from elastic.control.client import MasterClient

        standalone = settings.standalone  # not once the master is found: settings then name its address
        master, settings = _connect_or_host_master(settings, embed_at)
        if standalone and master is not None:
            _announce_standalone(master.address, settings, reaper)
        client = MasterClient(
            list(settings.masters),
            settings.job.job_id,
            settings.token,
            tls_ca=settings.tls_ca,
            token_file=settings.token_file,  # re-read after a 401: a rotated token restarts nothing
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
        code = agent.run()
    except KeeperError as exc:
        # Another live agent on this host holds this job's and node id's folder (a duplicate --node-id), or
        # ELASTIC_SHM_ROOT names no folder: a usage error (exit 2) like the master's refusal of a duplicate
        # join. shm_folder.take raises KeeperError from the FolderHeldError it caught (its context).
        usage = isinstance(exc.__context__, FolderHeldError) or isinstance(exc, RootError)
        raise AgentError(
            f"cannot set up the checkpoint shared memory: {exc}", EXIT_CONFIG if usage else EXIT_FAILED
        ) from None
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
    return unpersisted_exit(code, keeper)


def unpersisted_exit(code: int, keeper: CheckpointKeeper | None) -> int:
    """The exit code once the keeper stopped: 1 (retryable) instead of 0 when the newest checkpoint asked
    for is not on disk; then one line per such checkpoint says where its copy was kept and how to persist
    it (docs/checkpointing.md, "When a persist fails")."""
    if keeper is None or not keeper.unpersisted or keeper.kept is None:
        return code
    kept = keeper.kept
    why = keeper.persist_status()[1] or "not persisted"
    for request in keeper.unpersisted:
        if request.kind == "file":
            copy = kept / request.source.name
            how = (
                f"cp {shlex.quote(str(copy))} {shlex.quote(str(request.target))}/ && "
                f"echo {request.source.name} > {shlex.quote(str(request.target / 'latest'))} && "
                f"rm -r {shlex.quote(str(kept))}"
            )
        else:  # this node's part of a sharded step: the step is complete once every node's part is in
            copy = kept / request.source.relative_to(keeper.folder)
            root, link = request.target, f"step_{request.step:010d}"
            how = (
                f"cp -r {shlex.quote(str(copy))} {shlex.quote(str(root))}/ && "
                f"ln -sfn {copy.name} {shlex.quote(str(root / link))} && "
                f"echo {link} > {shlex.quote(str(root / 'latest'))} && rm -r {shlex.quote(str(kept))}"
            )
        print(
            f"elastic-run: the checkpoint of step {request.step} is not on disk ({printable(why)}); its copy "
            f"is kept in {copy}: persist it with: {how}",
            file=sys.stderr,
            flush=True,
        )
    return int(ExitCode.FAILED) if code == ExitCode.SUCCESS else code


def _announce_standalone(address: str, settings: AgentSettings, reaper: Reaper) -> None:
    """Write the standalone master's token to a file in a private temporary folder (0700; the file 0600;
    removed when the agent is gone, even killed: the reaper's sentinel removes it), never in the working
    directory or --ckpt-dir, and say how to reach that master: ``elastic-master status``, /ui, /metrics."""
    folder = tempfile.mkdtemp(prefix="elastic-run-")  # mode 0700
    reaper.remove_on_exit(folder)
    token_file = os.path.join(folder, "token")
    fd = os.open(token_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(settings.token + "\n")
    job = settings.job.job_id
    log.info(
        "standalone master at %s (job %s), token file %s (removed at exit): elastic-master status "
        "--master %s --job-id %s --token-file %s; status page http://%s/ui, metrics http://%s/metrics",
        address,
        job,
        token_file,
        address,
        job,
        shlex.quote(token_file),
        address,
        address,
        extra=ALWAYS_SHOWN,
    )


def _connect_or_host_master(
    settings: AgentSettings, embed_at: str | None
) -> tuple[EmbeddedMaster | None, AgentSettings]:
    """Find the job master, or host one in this process; returns ``(embedded master or None, settings with
    the master addresses filled in)``."""
    from agent.executor.master_link import WAIT_LINE_INTERVAL_S, master_wait_line
    from elastic.control.client import MasterClient  # httpx and pydantic: after the zygote started

    if settings.standalone:
        from master.http.serving import EmbeddedMaster  # the web stack (~0.3 s of imports) only when hosting
        from master.service.settings import ServerSettings

        # On 127.0.0.1 only, so plain http: a --tls-ca (or ELASTIC_TLS_CA) meant for daemons is not used.
        server = ServerSettings(job=settings.job, token=settings.token, token_file=settings.token_file)
        master = EmbeddedMaster(server).start()
        return master, dataclasses.replace(settings, masters=(master.address,), tls_ca=None)
    client = MasterClient(
        list(settings.masters),
        settings.job.job_id,
        settings.token,
        request_timeout=3.0,
        tls_ca=settings.tls_ca,
    )
    # Agents that verify the master's certificate host one only when they have a certificate to serve.
    may_host = embed_at is not None and (settings.tls_ca is None or settings.tls_cert is not None)
    started = time.monotonic()
    deadline, next_line = started + settings.master_timeout_s, started
    try:
        while True:
            try:
                client.info()
                return None, settings
            except MasterUnreachableError as exc:
                now = time.monotonic()
                if now >= next_line and not may_host:  # one hosting the master never waits for one
                    log.warning("%s", master_wait_line(exc, now - started, settings.master_timeout_s))
                    next_line = now + WAIT_LINE_INTERVAL_S
                if may_host and embed_at is not None:
                    from master.http.serving import EmbeddedMaster, bind_socket
                    from master.service.settings import ServerSettings

                    host, port = split_address(embed_at)
                    try:
                        sock = bind_socket(host, port)
                    except OSError:
                        sock = None  # another agent on this machine is starting it; wait for it to answer
                    if sock is not None:
                        server = ServerSettings(
                            job=settings.job,
                            token=settings.token,
                            token_file=settings.token_file,  # followed when rotated, as elastic-master's
                            host=host,
                            port=port,
                            tls_cert=settings.tls_cert,
                            tls_key=settings.tls_key,
                        )
                        master = EmbeddedMaster(server, sock=sock).start()
                        log.info(
                            "no master answered at %s; this agent hosts it (convenience mode%s)",
                            embed_at,
                            f"; {UNAUTHENTICATED}" if settings.unauthenticated else "",
                        )
                        # Off loopback the token is a secret (agent.cli.resolve refused a derived one there),
                        # or the job opted in to none: resolve's one warning line said all there is to say.
                        tls = settings.tls_cert is not None
                        if not settings.unauthenticated:
                            for warning in check_listener(MASTER_API, host, auth=Auth.SECRET, tls=tls):
                                log.warning("%s", warning)
                        return master, dataclasses.replace(settings, host_master_at=embed_at)
                if time.monotonic() > deadline:
                    hint = (
                        " (with --tls-ca, an agent hosts the master only when given --tls-cert/--tls-key)"
                        if embed_at is not None and not may_host
                        else ""
                    )
                    raise AgentError(
                        f"no job master answered at {', '.join(settings.masters)} within "
                        f"{settings.master_timeout_s:g}s; start elastic-master there or check --master{hint}"
                    ) from None
                time.sleep(0.2)  # the master may still be starting
            except (MasterTLSError, NotAMasterError) as exc:
                raise AgentError(str(exc), EXIT_CONFIG) from None
            except MasterError as exc:
                code = EXIT_CONFIG if getattr(exc, "status", 0) in (401, 409) else 1
                raise AgentError(
                    f"master at {', '.join(settings.masters)} refused this agent: {exc}", code
                ) from None
    finally:
        client.close()


def _serve_metrics(agent, settings: AgentSettings):  # noqa: ANN001, ANN202 - agent.executor.loop / agent.observe.metrics
    """Start the ``--metrics-port`` listener (agent.observe.metrics), or None without the option."""
    if settings.metrics_port is None:
        return None
    from agent.observe.metrics import serve  # prometheus_client only when asked for
    from elastic.control.tls import TLSConfigError, server_context

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
