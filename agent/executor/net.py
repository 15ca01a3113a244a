"""Small network helpers of the agent: free ports and which address this node is reached on."""

from __future__ import annotations

import ipaddress
import socket

import psutil


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago (the workers' rank 0 binds it for its TCPStore)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.bind((host if host not in ("", "0.0.0.0") else "", 0))
        return sock.getsockname()[1]


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
