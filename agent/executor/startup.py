"""Start an agent's parts in order and stop them in reverse: the process reaper, the warm-start zygote,
the master (found, or hosted), the worker group, the checkpoint keeper and its peer replication, the
progress channel, the agent loop and its metrics listener.

:func:`run_agent` is what ``elastic-run`` runs once its settings are resolved (:mod:`agent.cli.main`). The
imports are inside the functions: the zygote starts before the slower ones, and torch is never imported.
"""

from __future__ import annotations

import os
import sys

from agent.errors import EXIT_CONFIG, AgentError
from agent.settings import AgentSettings
from elastic.text import printable


def run_agent(settings: AgentSettings, embed_at: str | None) -> int:
    """Start (or find) the master, then run the agent loop; returns the exit code."""
    from agent.checkpoints import replication
    from agent.checkpoints.keeper import keeper_for  # light imports (stdlib, psutil), as the next three
    from agent.checkpoints.shm_folder import KeeperError
    from agent.warm.starter import WarmLauncher
    from agent.workers.group import Reaper, WorkerGroup

    reaper = Reaper()
    # The zygote starts first: importing torch is the longest step of a new node's first worker start,
    # and it runs while this agent imports the rest, finds the master and waits for its round.
    launcher = WarmLauncher(reaper, argv_hint=settings.argv) if settings.warm_start else None
    master = client = group = channel = keeper = agent = metrics = None
    try:
        # The HTTP client and pydantic (~0.15 s of imports) only now, while the zygote imports torch.
        from agent.cli.bootstrap import connect_or_host_master
        from agent.executor.loop import ElasticAgent
        from agent.observe.channel import ProgressChannel
        from elastic.control.client import MasterClient

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
