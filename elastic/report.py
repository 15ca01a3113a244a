"""Progress reports from a worker to its node's agent: a local datagram, never a network call.

The agent listens on a Unix datagram socket named by ``ELASTIC_AGENT_SOCKET``. A report is one small
JSON datagram, sent without blocking; if the agent is not listening (e.g. the script runs under plain
torchrun) reports are silently dropped, so calling :func:`report` is always safe and cheap.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time

SOCKET_ENV = "ELASTIC_AGENT_SOCKET"

_sock: socket.socket | None = None
_path: str | None = None


def _send(message: dict) -> None:
    global _sock, _path
    path = os.environ.get(SOCKET_ENV)
    if not path:
        return
    if _sock is None or _path != path:
        _sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        _sock.setblocking(False)
        _path = path
    message["r"] = int(os.environ.get("LOCAL_RANK", "0"))
    message["t"] = time.time()
    # The agent may be busy or gone (OSError): progress is advisory, a training step never waits for it.
    with contextlib.suppress(OSError):
        _sock.sendto(json.dumps(message, separators=(",", ":")).encode(), path)


def report(step: int) -> None:
    """Tell the agent this worker completed training step ``step`` (feeds hang and straggler checks)."""
    _send({"k": "step", "step": int(step)})


def report_checkpoint(step: int, location: str = "") -> None:
    """Tell the agent this worker holds a complete checkpoint of ``step`` (feeds the committed step)."""
    _send({"k": "ckpt", "step": int(step), "loc": location})
