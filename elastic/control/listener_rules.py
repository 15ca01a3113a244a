"""The rules every network listener of elastic-run follows: where it may bind, with which authentication,
and what it says about TLS. One function, :func:`check_listener`, applies them; every listener's command
line validation calls it before the port is bound (the master API in ``elastic-master``, the master an
agent hosts in convenience mode, and any further listener: metrics, status page, agent-to-agent
replication). docs/security.md lists the listeners and these rules as a table.

The rules:

1. **Loopback** (every address the host resolves to is a loopback address): allowed with any
   authentication. Only this machine's processes can connect.
2. **Off loopback, the listener needs a secret**: a token from a token file or ``ELASTIC_TOKEN`` (or a
   random one that only this process knows). A token anyone can compute (derived from the job id) or no
   authentication is refused with a one-line :class:`ListenerRuleError`, unless the operator opts in with
   ``insecure=True`` (then a warning says who can reach what).
3. **Off loopback without TLS**: allowed, with a warning that the token and the data cross the network in
   clear text, naming the flags that turn TLS on when the listener has them.

Stdlib only: the agent and the master call it before they import their heavier dependencies.
"""

from __future__ import annotations

import enum
import ipaddress
import socket
from dataclasses import dataclass

from elastic import errors

__all__ = [
    "AGENT_METRICS",
    "LISTENERS",
    "MASTER_API",
    "MASTER_METRICS",
    "REPLICATION",
    "TCPSTORE",
    "UNAUTHENTICATED",
    "Auth",
    "Listener",
    "ListenerRuleError",
    "check_listener",
    "is_loopback_host",
]


#: How the start lines, ``elastic-master status`` and docs/security.md name a job whose master runs with no
#: token: torchrun's rendezvous spelling (``--rdzv-endpoint`` with c10d, ``--master-addr``, a platform's
#: variables) off loopback and no token file: that spelling is the operator's opt-in (docs/security.md).
UNAUTHENTICATED = "unauthenticated (c10d, no token)"


class ListenerRuleError(errors.UsageError, ValueError):
    """A listener's bind address and authentication break the rules; the message is one line."""


class Auth(enum.Enum):
    """How a listener authenticates its clients."""

    #: A token from a token file or ELASTIC_TOKEN, or a random one only this process knows.
    SECRET = "secret"
    #: A token anyone who knows the job id can compute (torchrun-style command lines on one machine).
    DERIVED = "derived"
    #: No authentication at all.
    NONE = "none"


@dataclass(frozen=True)
class Listener:
    """One kind of listener, as the rules and their messages name it (a row of docs/security.md's table).

    ``name``: what it is, as a message's subject ("the job master API"). ``exposes``: what a client that
    connects can do or read. ``token_hint``: how an operator gives it a secret token. ``tls_hint``: the
    flags that make it serve TLS, empty when it cannot. ``bind_default``: its default bind address, for
    the docs. ``enforced``: whether elastic-run enforces the rules on it (False for listeners elastic-run
    does not own, listed for the record)."""

    name: str
    exposes: str
    token_hint: str
    tls_hint: str = ""
    bind_default: str = "127.0.0.1"
    enforced: bool = True


MASTER_API = Listener(
    name="the job master API",
    exposes="control of the job (joins, heartbeats, failure reports that restart or stop every node) "
    "and its status",
    token_hint="pass --token-file FILE (or set ELASTIC_TOKEN)",
    tls_hint="--tls-cert/--tls-key",
    bind_default="0.0.0.0 (elastic-master --host); 127.0.0.1 (elastic-run --standalone)",
)

#: The workers' c10d TCPStore: torch's own, unauthenticated, trusted within the job (not enforced).
TCPSTORE = Listener(
    name="the workers' TCPStore",
    exposes="the process group's rendezvous keys (torch.distributed), read and written",
    token_hint="none (PyTorch offers no authentication)",
    bind_default="node rank 0's address, MASTER_PORT (fresh every round)",
    enforced=False,
)

#: The master's separate metrics listener (``elastic-master --metrics-port``; master.http.metrics).
MASTER_METRICS = Listener(
    name="the job master's metrics listener",
    exposes="the job's metrics (node ids, hosts' progress, restarts)",
    token_hint="pass --token-file FILE (or set ELASTIC_TOKEN); Prometheus sends it with "
    "authorization: credentials_file",
    tls_hint="--tls-cert/--tls-key",
    bind_default="--host of elastic-master",
)

#: An agent's metrics listener (``elastic-run --metrics-port``; agent.observe.metrics).
AGENT_METRICS = Listener(
    name="the agent's metrics listener",
    exposes="this node's metrics (node id, workers, restarts, checkpoint persists)",
    token_hint="pass --token-file FILE (or set ELASTIC_TOKEN) to elastic-run; Prometheus sends it with "
    "authorization: credentials_file",
    tls_hint="elastic-run --tls-cert/--tls-key",
    bind_default="the agent's --local-addr (127.0.0.1 with --standalone)",
)

#: The agents' peer replication of sharded memory checkpoints (``elastic-run --replicas``;
#: agent.checkpoints.replication).
REPLICATION = Listener(
    name="the agent's replication listener",
    exposes="writing checkpoint replicas into this node's shared memory (up to its free space)",
    token_hint="pass --token-file FILE (or set ELASTIC_TOKEN) to elastic-run",
    tls_hint="elastic-run --tls-cert/--tls-key",
    bind_default="the agent's --local-addr (127.0.0.1 by default), a free port",
)

#: Every listener kind of elastic-run (docs/security.md's table names each). A listener is defined here,
#: never elsewhere: tests/unit/elastic/test_listener_rules.py fails for a ``Listener`` defined outside this
#: table.
LISTENERS: tuple[Listener, ...] = (MASTER_API, MASTER_METRICS, AGENT_METRICS, REPLICATION, TCPSTORE)


def _resolve(host: str) -> set[str]:
    try:
        return {str(info[4][0]) for info in socket.getaddrinfo(host, None)}  # typed str | int: always str
    except (OSError, UnicodeError):
        return set()


def is_loopback_host(host: str) -> bool:
    """True when every address ``host`` resolves to is a loopback address (unresolvable, ``0.0.0.0``,
    ``::`` or empty: False, since those may reach or bind every interface)."""
    if host in ("", "0.0.0.0", "::"):
        return False
    addresses = _resolve(host.strip("[]"))
    return bool(addresses) and all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addresses)


def check_listener(
    listener: Listener,
    host: str,
    *,
    auth: Auth,
    tls: bool,
    insecure: bool = False,
    insecure_flag: str = "",
) -> list[str]:
    """Apply the rules to ``listener`` bound (or reached) at ``host``: raise :class:`ListenerRuleError`
    (one line) when it is refused, else return the warnings to log, one line each.

    ``auth``: how it authenticates clients. ``tls``: whether it serves TLS. ``insecure``: the operator
    accepts a listener off loopback without a secret (``insecure_flag`` names the option that said so,
    for the refusal's hint; empty when the listener has no such option)."""
    if is_loopback_host(host):
        return []
    where = f"{listener.name} on {host}"
    warnings = []
    if auth is not Auth.SECRET:
        what = (
            "a token derived from the job id, which anyone can compute"
            if auth is Auth.DERIVED
            else "no token"
        )
        if not insecure:
            opt_in = f", or pass {insecure_flag} to accept that" if insecure_flag else ""
            raise ListenerRuleError(
                f"{where} is not on this machine's loopback and would have {what}: anyone who can reach it "
                f"gets {listener.exposes}; {listener.token_hint}{opt_in}"
            )
        warnings.append(
            f"{where} has {what} ({insecure_flag or 'insecure'}): anyone who can reach it gets "
            f"{listener.exposes}"
        )
    if not tls:
        fix = f"; serve TLS with {listener.tls_hint}" if listener.tls_hint else ""
        secret = "its token and its data cross" if auth is not Auth.NONE else "its data crosses"
        warnings.append(f"{where} serves without TLS: {secret} the network in clear text{fix}")
    return warnings
