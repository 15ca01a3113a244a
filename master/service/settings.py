"""Where and how the master serves a job (the job's own settings: :mod:`elastic.control.job_settings`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from elastic.control.job_settings import JobSettings

#: Default ``--header-timeout`` (docs/operations.md, "Open files and connections").
DEFAULT_HEADER_TIMEOUT_S = 8.0
#: Default ``--max-unauthenticated-per-address`` (master.http.conn_guard): high enough for the agents
#: behind one NAT that (re)connect at once, each unauthenticated until its stream's upgrade is answered.
DEFAULT_UNAUTHENTICATED_PER_ADDRESS = 256
#: Default ``--max-unauthenticated`` (master.http.conn_guard): sixteen such addresses, or two of asyncio's
#: accept batches on both listeners; beyond it a new connection replaces the oldest unauthenticated one.
#: It bounds what connections without the token cost the master (~5 KiB each) whatever their addresses.
DEFAULT_MAX_UNAUTHENTICATED = 4096


@dataclass(frozen=True)
class ServerSettings:
    """Where and how the master serves a job."""

    job: JobSettings
    token: str
    #: ``--token-file`` the token came from: re-read when it changes (elastic.control.token_source); None:
    #: a fixed token (``ELASTIC_TOKEN``, or created in memory).
    token_file: str | None = None
    host: str = "127.0.0.1"
    port: int = 0
    #: Durable state store URL (``memory://`` or ``etcd://HOST:PORT``).
    store_url: str = "memory://"
    #: PEM certificate (chain) and unencrypted key to serve https with; None: plain http.
    tls_cert: str | None = None
    tls_key: str | None = None
    #: ``--event-log``: every job event as a JSON line (master.service.event_log); None: no event log.
    event_log: str | None = None
    event_log_max_bytes: int = 64 * 1024 * 1024
    event_log_backups: int = 3
    #: ``--metrics-port``: a second listener (same host, token and TLS) serving only ``/metrics``.
    metrics_port: int | None = None
    #: ``--max-connections``: connections served at once; None: derived from the open-file limit
    #: (master.http.conn_guard.connection_cap).
    max_connections: int | None = None
    #: ``--header-timeout``: seconds a new connection has to send its first request head.
    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S
    #: ``--max-unauthenticated-per-address``: connections one address may hold before they present a
    #: valid token (authenticated ones are never counted per address).
    unauthenticated_per_address: int = DEFAULT_UNAUTHENTICATED_PER_ADDRESS
    #: ``--max-unauthenticated``: connections from all addresses together that have not presented a valid
    #: token yet; a new one beyond it closes the oldest of them.
    max_unauthenticated: int = DEFAULT_MAX_UNAUTHENTICATED
    #: ``--exit-on-job-end``: stop serving once the job ended and its agents learned it (master.service).
    exit_on_job_end: bool = False
    extra: dict[str, str] = field(default_factory=dict)
