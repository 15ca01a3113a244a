"""Where and how the master serves a job (the job's own settings: :mod:`elastic.job_settings`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from elastic.job_settings import JobSettings


@dataclass(frozen=True)
class ServerSettings:
    """Where and how the master serves a job."""

    job: JobSettings
    token: str
    host: str = "127.0.0.1"
    port: int = 0
    #: Durable state store URL (``memory://`` or ``etcd://HOST:PORT``).
    store_url: str = "memory://"
    #: PEM certificate (chain) and unencrypted key to serve https with; None: plain http.
    tls_cert: str | None = None
    tls_key: str | None = None
    extra: dict[str, str] = field(default_factory=dict)
