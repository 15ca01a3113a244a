"""A short run of the API fuzzer (bench/fuzz_engine.py; the long one is ``python bench/fuzz_api.py``)
against a real ``elastic-master`` process over 127.0.0.1: requests generated from the master's own
OpenAPI document by a hypothesis state machine that plays a fleet of nodes, plus batches of requests the
master must refuse. No 5xx, no crash, every response as the document says, every refusal with its status
and without a change to ``GET /v1/status``, and every /v1 operation reached with success."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from bench import common as c  # noqa: E402
from bench.fuzz_engine import FuzzConfig, run_fuzz  # noqa: E402
from bench.fuzz_report import api_operations  # noqa: E402
from master.http.serving import bind_socket  # noqa: E402

REQUESTS = 1500
MIN_SUCCESSES = 3  # every /v1 operation reached; the full run (bench/fuzz_api.py) asks for 50


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_fuzzing_the_master_finds_no_5xx_no_crash_and_no_answer_the_document_lacks(tmp_path: Path):
    tally = run_fuzz(FuzzConfig(requests=REQUESTS, seed=16), tmp_path, progress=lambda _: None)
    report = "\n".join(tally.examples)
    assert tally.requests >= REQUESTS
    assert (tally.server_errors, tally.crashes) == (0, 0), report
    assert not tally.failures, report
    for operation in api_operations(tally):
        assert tally.successes(operation) >= MIN_SUCCESSES, (operation, dict(tally.statuses))
    assert 0 < tally.authorized < tally.requests  # with and without valid credentials
    assert tally.state_checks >= 1 and tally.refusals["wrong_secret"] and tally.refusals["duplicate_join"]
    assert not c.tagged_processes(), "the fuzz left a master running"


def test_master_connections_send_replies_without_waiting_for_acks():
    """asyncio sets TCP_NODELAY only on sockets that say IPPROTO_TCP; without it every reply's body waited
    for the ACK of its headers (Nagle against delayed ACKs: ~40 ms per request on loopback)."""
    listener = bind_socket("127.0.0.1", 0)
    port = listener.getsockname()[1]

    async def accepted_nodelay() -> int:
        flags: asyncio.Future[int] = asyncio.get_running_loop().create_future()

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            flags.set_result(
                writer.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
            )
            writer.close()

        server = await asyncio.start_server(handle, sock=listener)
        async with server:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            flag = await asyncio.wait_for(flags, 10)
            writer.close()
            return flag

    try:
        assert asyncio.run(accepted_nodelay()) != 0
    finally:
        listener.close()


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_the_fuzz_benchmark_prints_its_table_and_writes_json(tmp_path: Path):
    out, data = tmp_path / "report.md", tmp_path / "fuzz.json"
    proc = subprocess.run(
        [sys.executable, "bench/fuzz_api.py", "--smoke", "--markdown-out", str(out), "--json", str(data)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=220,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "| POST /v1/join" in out.read_text() and "Target" in out.read_text()
    run = json.loads(data.read_text())["runs"][0]
    assert run["requests"] >= 400 and run["server_errors"] == 0 and not run["failures"]
