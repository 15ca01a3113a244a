"""Find the job master, or host one in this process (standalone, or torchrun's c10d convenience mode)."""

from __future__ import annotations

import dataclasses
import logging
import time

from agent.errors import EXIT_CONFIG, AgentError
from agent.settings import AgentSettings
from elastic.control.addresses import split_address
from elastic.control.client import MasterClient
from elastic.control.error_table import MasterError, MasterTLSError, MasterUnreachableError
from elastic.control.listener_rules import MASTER_API, Auth, check_listener

log = logging.getLogger(__name__)


def connect_or_host_master(settings: AgentSettings, embed_at: str | None):
    """Return ``(embedded master or None, settings with the master addresses filled in)``."""
    if settings.standalone:
        from master.http.serving import EmbeddedMaster  # the web stack (~0.3 s of imports) only when hosting
        from master.service.settings import ServerSettings

        # On 127.0.0.1 only, so plain http: a --tls-ca (or ELASTIC_TLS_CA) meant for daemons is not used.
        master = EmbeddedMaster(ServerSettings(job=settings.job, token=settings.token)).start()
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
    deadline = time.monotonic() + settings.master_timeout_s
    try:
        while True:
            try:
                client.info()
                return None, settings
            except MasterUnreachableError:
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
                            host=host,
                            port=port,
                            tls_cert=settings.tls_cert,
                            tls_key=settings.tls_key,
                        )
                        master = EmbeddedMaster(server, sock=sock).start()
                        log.info("no master answered at %s; this agent hosts it (convenience mode)", embed_at)
                        # Off loopback the token is a secret (agent.cli.main refused a derived one there).
                        tls = settings.tls_cert is not None
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
            except MasterTLSError as exc:
                raise AgentError(str(exc), EXIT_CONFIG) from None
            except MasterError as exc:
                code = EXIT_CONFIG if getattr(exc, "status", 0) in (401, 409) else 1
                raise AgentError(
                    f"master at {', '.join(settings.masters)} refused this agent: {exc}", code
                ) from None
    finally:
        client.close()
