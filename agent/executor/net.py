"""Small network helpers of the agent: free ports and which address this node is reached on."""

from __future__ import annotations

import ipaddress
import random
import socket
from collections.abc import Mapping

import psutil

#: ``LOW-HIGH`` (inclusive): the ports the agent draws the workers' store port from, e.g. those a firewall
#: opens between nodes.
STORE_PORTS_ENV = "ELASTIC_STORE_PORTS"
#: Without it: from here up to the start of the kernel's ephemeral range (docs/cli.md).
STORE_PORTS_FLOOR = 20000
_EPHEMERAL_RANGE = "/proc/sys/net/ipv4/ip_local_port_range"
_TRIES = 64


def store_ports(environ: Mapping[str, str]) -> range | None:
    """The ports the workers' store port is drawn from; None: any free port the kernel gives.

    Without ``ELASTIC_STORE_PORTS`` the range lies below the kernel's ephemeral range, because every
    outgoing connection on the node draws its local port from that range: a port picked there at the join
    can be taken by some connection before rank 0 binds it, seconds later (EADDRINUSE at the workers'
    start); below it only a listener can take it.

    Raises:
        ValueError: ``ELASTIC_STORE_PORTS`` is not ``LOW-HIGH`` with 1 <= LOW <= HIGH <= 65535.
    """
    value = environ.get(STORE_PORTS_ENV, "").strip()
    if value:
        low, sep, high = value.partition("-")
        try:
            first, last = int(low), int(high if sep else low)
        except ValueError:
            first = last = 0
        if not 1 <= first <= last <= 65535:
            raise ValueError(f"{STORE_PORTS_ENV}={value} is not a port range LOW-HIGH within 1-65535")
        return range(first, last + 1)
    try:
        with open(_EPHEMERAL_RANGE) as f:
            ephemeral_start = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return range(STORE_PORTS_FLOOR, ephemeral_start) if ephemeral_start > STORE_PORTS_FLOOR else None


def free_port(host: str = "127.0.0.1", ports: range | None = None) -> int:
    """A port of ``ports`` that was free a moment ago (the workers' rank 0 binds it for its TCPStore).

    Tries random ports of the range (agents on one host rarely meet); falls back to any free port."""
    if ports:
        for port in random.sample(ports, min(len(ports), _TRIES)):
            if _bindable(host, port):
                return port
    return _bind(host, 0)


def _bindable(host: str, port: int) -> bool:
    try:
        _bind(host, port)
    except OSError:
        return False
    return True


def _bind(host: str, port: int) -> int:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.bind((host if host not in ("", "0.0.0.0") else "", port))
        return int(sock.getsockname()[1])


def _resolve(host: str) -> set[str]:
    try:
        return {str(info[4][0]) for info in socket.getaddrinfo(host, None)}  # str(): typeshed allows ints
    except OSError:
        return set()


def is_local_host(host: str) -> bool:
    """True when ``host`` names an address of this machine (so an agent here may host the master)."""
    addresses = _resolve(host)
    if any(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addresses):
        return True
    mine = {a.address.split("%")[0] for addrs in psutil.net_if_addrs().values() for a in addrs}
    return bool(addresses & mine)


def local_address_for(master_host: str) -> str:
    """The address of this node that the master (and so the other nodes) can reach."""
    addresses = _resolve(master_host)
    if not addresses or any(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addresses):
        return "127.0.0.1"
    target = sorted(addresses)[0]
    family = socket.AF_INET6 if ":" in target else socket.AF_INET
    # A UDP "connect" sends nothing; it only asks the kernel which source address routes there.
    with socket.socket(family, socket.SOCK_DGRAM) as sock:
        try:
            sock.connect((target, 9))
            return sock.getsockname()[0]
        except OSError:
            return socket.getfqdn()
