"""etcd behind TLS: a real etcd that serves TLS only and requires client certificates, with its
authentication on; ``etcd grpc-proxy`` on 127.0.0.1 in front of it, speaking TLS to etcd with a client
certificate; real ``elastic-master`` daemons logging in through the proxy as an etcd user whose role may read
and write the job's keys only; real agents as fake nodes and real gloo workers.

The setup is the one docs/operations.md ("etcd behind TLS") gives: the master's etcd client (aetcd) speaks
plain gRPC only. etcd's grpc-proxy refuses a client certificate with a common name (etcd would map that name
to a user for every request it forwards), so the proxy's certificate has an empty subject and the master
logs in with the user's password, which the proxy passes on.

Certificates are made in the test (tests/support/certs.py); etcd and the proxies are stopped by PID and their
folder removed at the end of the module.
"""

from __future__ import annotations

import base64
import json
import re
import shutil
import subprocess
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import e2e
import pytest
from certs import LOCAL_NAMES, CertAuthority
from e2e import base_env, elastic_master_argv, free_port, train_args, wait_until
from etcd_server import EtcdGrpcProxy, EtcdServer, EtcdTLS
from failover_cluster import (
    FAILOVER_LIMIT_S,
    START_S,
    Job,
    assert_no_false_verdicts,
    assert_uninterrupted_training,
    kill,
    rank0_agent,
    steps_of,
)

from master.store import etcd_layout

pytestmark = pytest.mark.etcd
launch = e2e.launch  # the fixture: every process tree a test launches is killed at its teardown

USER = "elastic-master"
PASSWORD = "etcd-test-password"
#: The job whose keys (/elastic/JOB/...) the etcd user may read and write; nothing else.
JOB = f"etcd-tls-{uuid.uuid4().hex[:8]}"
ONE_LINE_ERROR = re.compile(r"^elastic-master: error: \S.*$")
#: A master that cannot use its store exits within this (etcd answers at once on 127.0.0.1).
FAIL_FAST_S = 45.0


@dataclass
class SecureEtcd:
    """The module's etcd (TLS only, client certificates required, authentication on) and what its clients
    need: the CA, the proxy's client certificate (empty subject), a certificate from another CA, and the
    etcd user's password file."""

    server: EtcdServer
    folder: Path
    proxy_cert: Path
    proxy_key: Path
    stranger_cert: Path
    stranger_key: Path
    password_file: Path
    proxies: list[EtcdGrpcProxy] = field(default_factory=list)

    def proxy(self) -> EtcdGrpcProxy:
        """A new grpc-proxy on 127.0.0.1 in front of the etcd (stopped at the end of the module)."""
        base = self.folder / f"proxy-{len(self.proxies)}"
        proxy = EtcdGrpcProxy(base, self.server, self.proxy_cert, self.proxy_key)
        self.proxies.append(proxy)
        return proxy.start()


@pytest.fixture(scope="module")
def secure_etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SecureEtcd]:
    folder = tmp_path_factory.mktemp("etcd-tls")
    authority = CertAuthority.create("etcd test CA")
    ca = authority.write(folder / "ca.pem")
    server_cert, server_key = authority.issue_files(folder, "etcd", "etcd", LOCAL_NAMES)
    # The fixture's own certificate: etcd maps its common name to the root user once authentication is on.
    root_cert, root_key = authority.issue_files(folder, "root", "root", server=False, client=True)
    proxy_cert, proxy_key = authority.issue_files(folder, "proxy", "", server=False, client=True)
    stranger = CertAuthority.create("some other CA")
    stranger_cert, stranger_key = stranger.issue_files(folder, "stranger", "root", server=False, client=True)
    password_file = folder / "etcd-password"
    password_file.write_text(PASSWORD + "\n")
    password_file.chmod(0o600)
    tls = EtcdTLS(ca=ca, cert=server_cert, key=server_key, client_cert=root_cert, client_key=root_key)
    server = EtcdServer(folder / "etcd", tls=tls)
    etcd = SecureEtcd(server, folder, proxy_cert, proxy_key, stranger_cert, stranger_key, password_file)
    try:
        server.start()
        server.enable_auth(USER, PASSWORD, f"/elastic/{JOB}/")
        yield etcd
    finally:
        for proxy in etcd.proxies:
            proxy.stop()
        server.stop()
        shutil.rmtree(folder, ignore_errors=True)


def run_master(store: str, job_id: str, *extra: str) -> subprocess.CompletedProcess[str]:
    """``elastic-master`` serving ``job_id`` from ``store``: here only to see it refuse to start."""
    argv = elastic_master_argv(
        "--host", "127.0.0.1", "--port", "0", "--job-id", job_id, "--store", store, *extra
    )
    env = base_env(ELASTIC_TOKEN="etcd-tls-test-token")
    return subprocess.run(argv, capture_output=True, text=True, env=env, cwd=e2e.REPO, timeout=FAIL_FAST_S)


def assert_one_line_error(result: subprocess.CompletedProcess[str], *needles: str) -> str:
    """Exit 1 with one error line naming every needle, no traceback."""
    assert result.returncode == 1, (result.returncode, result.stderr)
    assert "Traceback" not in result.stderr, result.stderr
    line = result.stderr.strip().splitlines()[-1]
    assert ONE_LINE_ERROR.match(line), result.stderr
    for needle in needles:
        assert needle in line, f"{needle!r} not in {line!r}"
    return line


def stored_state(server: EtcdServer, job: str) -> dict:
    """The job's state as the master stored it (records under its prefix, master/store/etcd_layout.py)."""
    prefix = f"/elastic/{job}/"
    reply = json.loads(server.must("get", "--prefix", prefix, "-w", "json"))
    records = {
        base64.b64decode(kv["key"]).decode()[len(prefix) :]: base64.b64decode(kv["value"])
        for kv in reply.get("kvs", [])
    }
    records.pop("leader", None)
    return etcd_layout.decode(records)


# -- etcd's side: TLS with client certificates ----------------------------------------------------------


@pytest.mark.timeout(60)
def test_etcd_refuses_a_client_without_a_certificate_of_its_ca(secure_etcd: SecureEtcd) -> None:
    server = secure_etcd.server
    assert server.etcdctl("get", f"/elastic/{JOB}/state").returncode == 0  # the fixture's certificate works
    for client in (False, (secure_etcd.stranger_cert, secure_etcd.stranger_key)):
        result = server.etcdctl("get", f"/elastic/{JOB}/state", client=client)
        assert result.returncode != 0 and "bad certificate" in result.stderr, (client, result.stderr)


# -- the master's side ------------------------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_a_master_pointed_straight_at_the_tls_port_says_so_in_one_line(secure_etcd: SecureEtcd) -> None:
    server = secure_etcd.server
    password = ("--store-password-file", str(secure_etcd.password_file))
    for store, extra in ((f"etcd://{server.endpoint}", ()), (f"etcd://{USER}@{server.endpoint}", password)):
        started = time.monotonic()
        result = run_master(store, JOB, *extra)
        assert time.monotonic() - started < FAIL_FAST_S
        assert_one_line_error(result, f"etcd at {server.endpoint} speaks TLS", "etcd grpc-proxy", "127.0.0.1")
    result = run_master(f"etcd://https://{server.endpoint}", JOB)
    assert_one_line_error(result, "https endpoint", "etcd grpc-proxy")


@pytest.mark.timeout(120)
def test_through_the_proxy_a_master_needs_its_etcd_user_and_reaches_only_its_job(
    secure_etcd: SecureEtcd,
) -> None:
    proxy = secure_etcd.proxy()
    password = ("--store-password-file", str(secure_etcd.password_file))
    wrong = secure_etcd.folder / "wrong-password"
    wrong.write_text("not-the-password\n")
    wrong.chmod(0o600)

    result = run_master(f"etcd://{proxy.endpoint}", JOB)
    assert_one_line_error(result, "refused a client without an etcd user", "permission denied")
    result = run_master(f"etcd://{USER}@{proxy.endpoint}", JOB, "--store-password-file", str(wrong))
    assert_one_line_error(result, f"refused the etcd user '{USER}'", "authentication failed")
    other_job = f"{JOB}-other"
    result = run_master(f"etcd://{USER}@{proxy.endpoint}", other_job, *password)
    assert_one_line_error(result, "permission denied", f"/elastic/{other_job}/")
    result = run_master(f"etcd://{USER}@{proxy.endpoint}", JOB)
    assert_one_line_error(result, f"etcd user '{USER}'", "--store-password-file")


@pytest.mark.timeout(10)
def test_the_store_url_names_the_etcd_user_and_the_password_comes_from_its_file() -> None:
    from master.cli.options import open_store
    from master.store.base import StoreError
    from master.store.etcd_store import EtcdStore

    store = open_store("etcd://elastic-master@127.0.0.1:23790,127.0.0.1:23791", "j", password="pw")
    assert isinstance(store, EtcdStore)
    assert store.endpoints == [("127.0.0.1", 23790), ("127.0.0.1", 23791)]
    assert (store._username, store._password) == ("elastic-master", "pw")
    for url, password, needle in [
        ("etcd://elastic-master@127.0.0.1:2379", None, "give its password with --store-password-file"),
        ("etcd://127.0.0.1:2379", "pw", "needs the etcd user in --store"),
        ("etcd://@127.0.0.1:2379", None, "user name before '@' is empty"),
        ("memory://", "pw", "is for an etcd user"),
        ("etcd://https://127.0.0.1:2379", None, "https endpoint"),
    ]:
        with pytest.raises(StoreError, match=re.escape(needle)):
            open_store(url, "j", password=password)


# -- failover through the proxies ---------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_the_standby_takes_over_through_its_proxy_and_training_goes_on(
    launch, tmp_path: Path, secure_etcd: SecureEtcd
) -> None:
    # One proxy per master, as on two master hosts; both masters log in as the job's etcd user.
    proxies = [secure_etcd.proxy(), secure_etcd.proxy()]
    stores = [f"etcd://{USER}@{proxy.endpoint}" for proxy in proxies]
    job = Job(launch, tmp_path, "2:2", stores[0], job_id=JOB)
    ports = [free_port(), free_port()]
    addresses = [f"127.0.0.1:{port}" for port in ports]
    password = ("--store-password-file", str(secure_etcd.password_file))
    masters = [job.master(port, f"master-{i}", *password, store=stores[i]) for i, port in enumerate(ports)]
    wait_until(lambda: sorted(job.info(a) for a in addresses) == [200, 503], START_S, "a leader")
    lead = next(i for i, a in enumerate(addresses) if job.info(a) == 200)

    steps = 60
    agents = [job.agent(f"node-{i}", addresses, train_args(steps=steps, step_time=0.15)) for i in range(2)]
    rank0 = rank0_agent(agents)
    rank0.wait_for(r"^\[rank0\]:step=10 loss", START_S)
    before = job.status(addresses[lead])

    killed_at_output = len(rank0.output())
    kill(masters[lead])
    standby = addresses[1 - lead]
    failover_s = job.wait_leader(standby, FAILOVER_LIMIT_S)
    print(f"\nstandby led {failover_s:.2f}s after SIGKILL of the leader, through its grpc-proxy")
    after = job.status(standby)
    assert after["master_id"] != before["master_id"]
    assert (after["round"], after["restart_count"]) == (before["round"], before["restart_count"])
    rank0.wait_for(r"^\[rank0\]:step=\d+ loss", 60, after=killed_at_output)
    assert steps_of(rank0, killed_at_output), "the workers stood still while no master led"

    job.finish(*agents)
    assert_uninterrupted_training(agents, steps)
    assert_no_false_verdicts(masters[1 - lead])
    # The job's state went through the proxies into the TLS etcd, under the job's prefix.
    state = stored_state(secure_etcd.server, JOB)
    assert state["job_id"] == JOB and {n["node_id"] for n in state["nodes"]} == {"node-0", "node-1"}, state
    job.shut_down()
