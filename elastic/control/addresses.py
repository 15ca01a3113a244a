"""Master addresses on command lines: ``HOST:PORT`` lists (no I/O)."""

from __future__ import annotations


def split_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def parse_addresses(text: str) -> list[str]:
    """``HOST:PORT[,HOST:PORT...]`` → list of ``HOST:PORT`` (IPv6 as ``[::1]:PORT``)."""
    out = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        if "://" in part:  # one rule for the scheme: --tls-ca means https for every address
            raise ValueError(
                f"master address must be HOST:PORT without a scheme (--tls-ca makes it https), got {part!r}"
            )
        host, sep, port = part.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"master address must be HOST:PORT, got {part!r}")
        out.append(part)
    if not out:
        raise ValueError("no master address given")
    return out
