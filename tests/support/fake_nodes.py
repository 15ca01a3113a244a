"""A real ``elastic-master`` process and fake *nodes* that talk to it over HTTP (join, heartbeat, leave),
for tests of what operators see (``status --watch``, the status page): no training processes needed."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import httpx
from e2e import elastic_master_argv

from elastic.control.protocol import API_PREFIX, JOB_HEADER

#: Seconds a master process gets to start listening.
START_S = 60.0
#: The fake nodes do not heartbeat while a test looks at them: the master must not declare them dead.
HEARTBEAT_TIMEOUT = "600"
#: Header of a node's own secret (its join reply's ``node_secret``), where the master issues one.
NODE_SECRET_HEADER = "X-Elastic-Node-Secret"


@dataclass
class RealMaster:
    """An ``elastic-master`` process of one job, with its address and token."""

    address: str
    job_id: str
    token: str
    secrets: dict[str, str] = field(default_factory=dict)

    def headers(self, node_id: str | None = None) -> dict[str, str]:
        out = {"Authorization": f"Bearer {self.token}", JOB_HEADER: self.job_id}
        if node_id is not None and self.secrets.get(node_id):
            out[NODE_SECRET_HEADER] = self.secrets[node_id]
        return out

    def url(self, path: str) -> str:
        return f"http://{self.address}{path}"

    def join(self, node_id: str, nnodes: tuple[int, int], nproc: int = 2) -> dict:
        """A fake node joins or rejoins (its secret is kept for its later requests)."""
        body = {
            "node_id": node_id,
            "host": "127.0.0.1",
            "nproc": nproc,
            "store_port": 29500,
            "min_nodes": nnodes[0],
            "max_nodes": nnodes[1],
        }
        headers = self.headers(node_id)  # a rejoin carries the node's secret
        reply = httpx.post(self.url(f"{API_PREFIX}/join"), json=body, headers=headers, timeout=10)
        reply.raise_for_status()
        data = reply.json()
        self.secrets[node_id] = data.get("node_secret", "")
        return data

    def leave(self, node_id: str, reason: str) -> None:
        body = {"node_id": node_id, "reason": reason}
        reply = httpx.post(
            self.url(f"{API_PREFIX}/leave"), json=body, headers=self.headers(node_id), timeout=10
        )
        reply.raise_for_status()

    def status(self) -> dict:
        reply = httpx.get(self.url(f"{API_PREFIX}/status"), headers=self.headers(), timeout=10)
        reply.raise_for_status()
        return reply.json()


def start_master(launch, tmp_path: Path, job_id: str, nnodes: str, *extra: str) -> RealMaster:
    """Launch ``elastic-master`` on a free port of 127.0.0.1 with a token file of the test's own."""
    token_file = tmp_path / "token"
    proc = launch(
        elastic_master_argv(
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--job-id",
            job_id,
            "--nnodes",
            nnodes,
            "--token-file",
            str(token_file),
            "--heartbeat-timeout",
            HEARTBEAT_TIMEOUT,
            "--last-call",
            "0.5",
            *extra,
        ),
        name="master",
    )
    port = proc.wait_for(r"listening on 127\.0\.0\.1:(\d+)", START_S).group(1)
    return RealMaster(f"127.0.0.1:{port}", job_id, token_file.read_text().strip())
