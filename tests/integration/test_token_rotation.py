"""Token rotation against a real master in this process (``EmbeddedMaster``, real sockets) and the real
client (elastic.control.client.MasterClient): the master follows its replaced ``--token-file``, accepts the
previous token for one heartbeat timeout and records ``token_rotated``; a client refused with 401 reads its
own token file again and goes on with the new token, and its 401 is final while the file holds the refused
token; an open agent stream, authenticated at its upgrade, lives on. Deadlines come from the settings."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from e2e import wait_until
from embedded_masters import no_thread_left

from elastic.control.client import MasterClient
from elastic.control.error_table import MasterRejectedError
from elastic.control.job_settings import JobSettings
from elastic.control.token_source import POLL_S
from master.http.serving import EmbeddedMaster
from master.service.settings import ServerSettings

OLD, NEW = "old-token-" + "o" * 20, "new-token-" + "n" * 20
GRACE_S = 1.0  # the master's heartbeat timeout


def replace(path: Path, token: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(token + "\n")
    os.replace(tmp, path)


def refused(client: MasterClient) -> bool:
    try:
        client.info()
    except MasterRejectedError as exc:
        assert exc.status == 401, exc
        return True
    return False


@pytest.mark.timeout(60)
def test_a_client_follows_its_rotated_file_and_the_previous_token_ends_after_the_grace(tmp_path):
    master_file, agent_file = tmp_path / "master-token", tmp_path / "agent-token"
    for path in (master_file, agent_file):
        path.write_text(OLD + "\n")
    job = JobSettings(job_id="rot", heartbeat_interval_s=0.2, heartbeat_timeout_s=GRACE_S)
    with no_thread_left():
        master = EmbeddedMaster(ServerSettings(job=job, token=OLD, token_file=str(master_file))).start()
        clients = [
            MasterClient([master.address], "rot", OLD, token_file=str(agent_file)),  # the agent stream
            MasterClient([master.address], "rot", OLD, stream=False, token_file=str(agent_file)),  # HTTP
        ]
        streamed, plain = clients
        try:
            assert streamed.info().job_id == "rot"  # its stream is open from now on
            replace(master_file, NEW)
            # The master's file changed, the agent's not yet: the previous token works for the grace only.
            wait_until(lambda: refused(plain), GRACE_S + 10 * POLL_S, "the previous token refused")
            assert refused(plain), "final while the file holds the refused token"
            assert streamed.info().job_id == "rot"  # authenticated at its upgrade: lives on
            replace(agent_file, NEW)
            assert plain.info().job_id == "rot"  # 401, the file read again, the call retried
            # An agent stream's upgrade refused with the old token: the same re-read, then a new upgrade.
            clients.append(late := MasterClient([master.address], "rot", OLD, token_file=str(agent_file)))
            assert late.info().job_id == "rot"
            assert late._streams is not None and late._streams.open_count() == 1  # over its stream
            kinds = [e.kind for e in plain.status().events]
            assert kinds.count("token_rotated") == 1, kinds
            assert all(NEW not in e.message and OLD not in e.message for e in plain.status().events)
        finally:
            for client in clients:
                client.close()
            master.stop()
