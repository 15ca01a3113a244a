"""TLS between agents (and ``elastic-master status``) and the master: real masters serving https with
certificates this module makes (a CA, a second CA nobody trusts, server certificates), real agents and
real ``elastic-master status`` processes over real sockets on 127.0.0.1.

Certificates are made with the ``cryptography`` package (the ``test`` extra) in pytest's temporary
folder. Subprocesses get an environment without ``ELASTIC_TLS_*`` and ``ELASTIC_TOKEN``, so that only the
flags a test gives count.
"""

from __future__ import annotations

import os
import re
import signal
import ssl
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import e2e
import pytest
from certs import LOCAL_NAMES, CertAuthority, write_cert, write_key
from cryptography import x509
from e2e import TRAIN_SCRIPT, Proc, base_env, elastic_master_argv, elastic_run_argv, free_port, wait_until

from elastic.control.client import MasterClient, MasterTLSError
from elastic.control.job_settings import JobSettings
from elastic.control.tls import server_context
from master.http.serving import EmbeddedMaster
from master.service.settings import ServerSettings

launch = e2e.launch  # the fixture: every process tree a test launches is killed at its teardown

TOKEN = "tls-e2e-test-token"
START_S = 90.0  # generous on a loaded 2-core machine
EXIT_S = 120.0
#: Far above what a refused agent may take: a TLS failure must not wait for --master-timeout.
MASTER_TIMEOUT_S = 300
FAIL_FAST_S = 45.0
ONE_LINE_ERROR = re.compile(r"^elastic-(run|master): error: \S.*$")


# -- certificates -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Pki:
    """PEM files: ``ca`` signed ``server`` (for 127.0.0.1 and localhost) and ``elsewhere`` (for another
    host name only); ``other_ca`` signed ``rogue`` (for 127.0.0.1 and localhost, as ``server``)."""

    ca: Path
    other_ca: Path
    server_cert: Path
    server_key: Path
    elsewhere_cert: Path
    elsewhere_key: Path
    encrypted_key: Path
    rogue_cert: Path
    rogue_key: Path
    folder: Path


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    folder = tmp_path_factory.mktemp("pki")
    authority = CertAuthority.create("elastic test CA")
    other = CertAuthority.create("some other CA")
    server_key, server = authority.issue("elastic-master", LOCAL_NAMES)
    elsewhere_key, elsewhere = authority.issue("elastic-master", [x509.DNSName("master.elsewhere.example")])
    rogue_cert, rogue_key = other.issue_files(folder, "rogue", "elastic-master", LOCAL_NAMES)
    return Pki(
        ca=authority.write(folder / "ca.pem"),
        other_ca=other.write(folder / "other-ca.pem"),
        server_cert=write_cert(folder / "server.pem", server),
        server_key=write_key(folder / "server.key", server_key),
        elsewhere_cert=write_cert(folder / "elsewhere.pem", elsewhere),
        elsewhere_key=write_key(folder / "elsewhere.key", elsewhere_key),
        encrypted_key=write_key(folder / "encrypted.key", server_key, b"secret"),
        rogue_cert=rogue_cert,
        rogue_key=rogue_key,
        folder=folder,
    )


# -- helpers ------------------------------------------------------------------------------------------


def clean_env(**extra: str) -> dict[str, str]:
    env = base_env(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **extra)
    for name in ("ELASTIC_TOKEN", "ELASTIC_TLS_CA", "ELASTIC_TLS_CERT", "ELASTIC_TLS_KEY"):
        if name not in extra:
            env.pop(name, None)
    return env


def run(argv: list[str], timeout: float = 60, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        argv, capture_output=True, text=True, env=clean_env(**env), cwd=e2e.REPO, timeout=timeout
    )


def assert_one_line_error(stderr: str, *needles: str) -> str:
    """The last stderr line is a one-line error naming every needle, and there is no traceback."""
    assert "Traceback" not in stderr, stderr
    line = stderr.strip().splitlines()[-1]
    assert ONE_LINE_ERROR.match(line), stderr
    for needle in needles:
        assert needle in line, f"{needle!r} not in {line!r}"
    return line


def unique_job_id() -> str:
    # Agents' shared-memory checkpoint folders are named by job and node id: unique per test.
    return f"tls-{uuid.uuid4().hex[:8]}"


def start_tls_master(
    launch,
    pki: Pki,
    token_file: Path,
    job_id: str,
    nnodes: str,
    *extra: str,
    port: int = 0,
    cert: tuple[Path, Path] | None = None,
    lead: bool = True,
) -> tuple[Proc, str]:
    """An https master (``cert``: ``(certificate, key)``, default the CA's server certificate); waits until
    it listens, and (``lead``) until it leads its job."""
    cert_file, key_file = cert or (pki.server_cert, pki.server_key)
    master = launch(
        elastic_master_argv(
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--job-id",
            job_id,
            "--nnodes",
            nnodes,
            "--token-file",
            str(token_file),
            "--heartbeat-interval",
            "0.5",
            "--last-call",
            "1",
            "--tls-cert",
            str(cert_file),
            "--tls-key",
            str(key_file),
            *extra,
        ),
        name="master",
        env=clean_env(),
    )
    port = master.wait_for(r"listening on 127\.0\.0\.1:(\d+) \(https\)", START_S).group(1)
    if lead:
        master.wait_for(r"leads job", START_S)
    return master, f"127.0.0.1:{port}"


def agent_argv(address: str, job_id: str, token_file: Path, node_id: str, *extra: str) -> list[str]:
    return elastic_run_argv(
        "--nnodes",
        "2",
        "--nproc-per-node",
        "1",
        "--master",
        address,
        "--job-id",
        job_id,
        "--token-file",
        str(token_file),
        "--node-id",
        node_id,
        "--master-timeout",
        str(MASTER_TIMEOUT_S),
        "--stop-grace",
        "2",
        *extra,
        str(TRAIN_SCRIPT),
        "--steps",
        "5",
        "--batch-size",
        "32",
    )


def status_argv(address: str, job_id: str, token_file: Path, *extra: str) -> list[str]:
    return elastic_master_argv(
        "status", "--master", address, "--job-id", job_id, "--token-file", str(token_file), *extra
    )


@pytest.fixture
def token_file(tmp_path: Path) -> Path:
    path = tmp_path / "tok"
    path.write_text(TOKEN + "\n")
    path.chmod(0o600)
    return path


@pytest.fixture
def embedded(pki: Pki) -> Iterator[Callable[..., EmbeddedMaster]]:
    """``embedded(tls=True|False|"elsewhere") -> EmbeddedMaster`` in this process; stopped at teardown."""
    masters: list[EmbeddedMaster] = []

    def _start(tls: bool | str = True) -> EmbeddedMaster:
        cert, key = {
            True: (pki.server_cert, pki.server_key),
            "elsewhere": (pki.elsewhere_cert, pki.elsewhere_key),
        }.get(tls, (None, None))
        settings = ServerSettings(
            job=JobSettings(job_id="probe", min_nodes=2, max_nodes=2),
            token=TOKEN,
            tls_cert=str(cert) if cert else None,
            tls_key=str(key) if key else None,
        )
        master = EmbeddedMaster(settings).start()
        masters.append(master)
        return master

    yield _start
    for master in masters:
        master.stop()


# -- a job over TLS -----------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(360)
def test_two_agents_with_the_ca_train_to_the_end_and_status_works(launch, pki, token_file):
    job_id = unique_job_id()
    master, address = start_tls_master(launch, pki, token_file, job_id, "2")
    agents = [
        launch(agent_argv(address, job_id, token_file, node, "--tls-ca", str(pki.ca)), node, clean_env())
        for node in ("n0", "n1")
    ]
    for agent in agents:
        code = agent.wait(START_S + EXIT_S)
        assert code == 0, f"{agent.log.name} exited {code}:\n{agent.output()[-4000:]}"
        assert "job succeeded" in agent.output()
    assert any(re.search(r"^\[rank0\]:done step=5$", a.output(), re.M) for a in agents)
    assert all(re.search(r"^\[rank\d\]:start rank=\d world=2 ", a.output(), re.M) for a in agents)
    # The finished job is still served: status over https, the CA from the flag or from ELASTIC_TLS_CA.
    for extra, env in ((("--tls-ca", str(pki.ca)), {}), ((), {"ELASTIC_TLS_CA": str(pki.ca)})):
        result = run(status_argv(address, job_id, token_file, *extra), **env)
        assert result.returncode == 0, result.stderr
        assert f"job {job_id}" in result.stdout, result.stdout
        assert "n0" in result.stdout and "n1" in result.stdout, result.stdout
    wait_until(lambda: not any(a.survivors() for a in agents), 15, "the agents' workers to exit")
    assert master.popen.poll() is None  # the daemon keeps serving after the job


# -- agents that cannot verify the master fail at once, with one line ---------------------------------


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    "ca, needles",
    [
        (None, ("speaks TLS", "--tls-ca")),
        ("other_ca", ("does not verify", "unable to get local issuer certificate", "--tls-ca")),
    ],
    ids=["no-ca", "another-ca"],
)
def test_an_agent_that_cannot_verify_the_master_exits_at_once(launch, pki, token_file, ca, needles):
    job_id = unique_job_id()
    _, address = start_tls_master(launch, pki, token_file, job_id, "2")
    extra = ("--tls-ca", str(getattr(pki, ca))) if ca else ()
    started = time.monotonic()
    agent = launch(agent_argv(address, job_id, token_file, "n0", *extra), "agent", clean_env())
    code = agent.wait(FAIL_FAST_S + 30)
    elapsed = time.monotonic() - started
    assert code == 2, agent.output()
    assert elapsed < FAIL_FAST_S, f"took {elapsed:.0f}s: retried as if the master were down"
    assert_one_line_error(agent.output(), f"master at {address}", *needles)
    assert "[rank0]" not in agent.output()  # no worker ever started


@pytest.mark.timeout(90)
def test_status_names_the_certificate_problem(pki, token_file, embedded):
    master = embedded(True)
    cases = [
        ((), ("speaks TLS", "--tls-ca")),
        (("--tls-ca", str(pki.other_ca)), ("does not verify", "unable to get local issuer certificate")),
    ]
    for extra, needles in cases:
        result = run(status_argv(master.address, "probe", token_file, *extra))
        assert result.returncode == 1, result
        assert_one_line_error(result.stderr, f"master at {master.address}", *needles)
    result = run(status_argv(master.address, "probe", token_file, "--tls-ca", str(pki.ca)))
    assert result.returncode == 0, result.stderr
    assert "job probe" in result.stdout


@pytest.mark.timeout(60)
def test_the_host_name_is_verified(pki, token_file, embedded):
    # Signed by the trusted CA, but for another host: hostname verification must refuse it.
    master = embedded("elsewhere")
    result = run(status_argv(master.address, "probe", token_file, "--tls-ca", str(pki.ca)))
    assert result.returncode == 1, result
    assert_one_line_error(result.stderr, "does not verify", "IP address mismatch", "127.0.0.1", "--master")


@pytest.mark.timeout(60)
def test_a_client_with_a_ca_is_told_a_plain_master_does_not_speak_tls(pki, token_file, embedded):
    master = embedded(False)
    result = run(status_argv(master.address, "probe", token_file, "--tls-ca", str(pki.ca)))
    assert result.returncode == 1, result
    assert_one_line_error(result.stderr, "does not speak TLS")


@pytest.mark.timeout(60)
def test_tls_failures_are_final_and_another_address_still_answers(pki, embedded):
    good, bad = embedded(True), embedded("elsewhere")
    clients = []
    try:
        # Final: raised at the first attempt, not after retries (the caller treats it as fatal).
        for ca in (None, pki.other_ca):
            client = MasterClient([good.address], "probe", TOKEN, tls_ca=str(ca) if ca else None)
            clients.append(client)
            started = time.monotonic()
            with pytest.raises(MasterTLSError):
                client.info()
            assert time.monotonic() - started < 10
        # A standby that verifies answers even when the address tried first does not.
        client = MasterClient([bad.address, good.address], "probe", TOKEN, tls_ca=str(pki.ca))
        clients.append(client)
        assert client.info().job_id == "probe"
    finally:
        for client in clients:
            client.close()


@pytest.mark.timeout(10)
def test_the_master_accepts_nothing_older_than_tls_1_2(pki):
    context = server_context(str(pki.server_cert), str(pki.server_key))
    assert context.minimum_version >= ssl.TLSVersion.TLSv1_2


# -- a master certificate that stops verifying while the job runs -------------------------------------

TLS_TROUBLE = "TLS with the master failed: the certificate of the master at {address} does not verify"


def long_job_agent(
    launch, address: str, job_id: str, token_file: Path, pki: Pki, master_timeout: float
) -> Proc:
    """One node (the whole job) training far longer than the test, verifying the master with the CA."""
    argv = elastic_run_argv(
        "--nnodes",
        "1",
        "--master",
        address,
        "--job-id",
        job_id,
        "--token-file",
        str(token_file),
        "--node-id",
        "n0",
        "--tls-ca",
        str(pki.ca),
        "--master-timeout",
        f"{master_timeout:g}",
        "--stop-grace",
        "2",
        str(TRAIN_SCRIPT),
        "--steps",
        "3000",
        "--step-time",
        "0.05",
        "--batch-size",
        "32",
    )
    return launch(argv, "agent", clean_env())


def kill_group(proc: Proc) -> None:
    """SIGKILL a launched master (its process group), and reap it."""
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(10)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_master_certificate_that_stops_verifying_is_reported_at_once_and_ends_the_agent_at_its_timeout(
    launch, pki, token_file
):
    # The master is restarted on the same port with a certificate from a CA the agent does not trust.
    job_id, port, master_timeout = unique_job_id(), free_port(), 45.0
    master, address = start_tls_master(launch, pki, token_file, job_id, "1", port=port)
    agent = long_job_agent(launch, address, job_id, token_file, pki, master_timeout)
    agent.wait_for(r"^\[rank0\]:step=3 ", START_S)
    agent.descendants()  # remembered, to check that the workers are gone at the end
    kill_group(master)
    start_tls_master(launch, pki, token_file, job_id, "1", port=port, cert=(pki.rogue_cert, pki.rogue_key))

    # Reported at once (heartbeats every 0.5 s), one line, in the agent's log...
    warning = agent.wait_for(re.escape(TLS_TROUBLE.format(address=address)), 15)
    # ...while the workers keep training...
    agent.wait_for(r"^\[rank0\]:step=\d+ ", 30, after=warning.end())
    # ...until --master-timeout: then a non-zero exit whose last line names the TLS reason.
    code = agent.wait(master_timeout + EXIT_S)
    out = agent.output()
    assert code == 1, out[-4000:]
    line = assert_one_line_error(
        out, "does not verify", "unable to get local issuer certificate", "--master-timeout"
    )
    assert "no job master answered at" not in line, line
    assert out.count("TLS with the master failed") == 1, out[-4000:]
    wait_until(lambda: not agent.survivors(), 15, "the agent's workers to exit")


@pytest.mark.slow
@pytest.mark.etcd
@pytest.mark.timeout(360)
def test_a_standby_with_a_bad_certificate_is_reported_and_the_job_goes_on_once_a_good_master_leads(
    launch, pki, token_file, etcd_endpoint
):
    # A standby master serving a certificate from another CA takes over (etcd: the job's state survives),
    # then a master with a good certificate replaces it: the workers never stop.
    job_id, port = unique_job_id(), free_port()
    # No dead verdict while the agent cannot get through (the rogue master would declare the node dead).
    store = ("--store", f"etcd://{etcd_endpoint}", "--heartbeat-timeout", "60")
    good, address = start_tls_master(launch, pki, token_file, job_id, "1", *store, port=port)
    agent = long_job_agent(launch, address, job_id, token_file, pki, MASTER_TIMEOUT_S)
    agent.wait_for(r"^\[rank0\]:step=3 ", START_S)
    agent.descendants()
    kill_group(good)
    rogue, _ = start_tls_master(
        launch, pki, token_file, job_id, "1", *store, port=port, cert=(pki.rogue_cert, pki.rogue_key)
    )
    warning = agent.wait_for(re.escape(TLS_TROUBLE.format(address=address)), START_S)
    agent.wait_for(r"^\[rank0\]:step=\d+ ", 30, after=warning.end())

    os.kill(rogue.pid, signal.SIGTERM)  # a clean stop hands the leadership over at once
    rogue.wait(30)
    start_tls_master(launch, pki, token_file, job_id, "1", *store, port=port)
    recovered = agent.wait_for(r"a master answers over verified TLS again", START_S)
    agent.wait_for(r"^\[rank0\]:step=\d+ ", 30, after=recovered.end())
    out = agent.output()
    assert out.count("TLS with the master failed") == 1, out[-4000:]
    # One worker start: no restart, no rejoin; the job is still in round 1.
    assert len(re.findall(r"^\[rank0\]:start ", out, re.M)) == 1, out[-4000:]
    assert "restarting workers" not in out and "no longer knows this node" not in out, out[-4000:]
    os.kill(agent.pid, signal.SIGTERM)
    assert agent.wait(60) == 128 + signal.SIGTERM
    wait_until(lambda: not agent.survivors(), 15, "the agent's workers to exit")


@pytest.mark.timeout(10)
def test_tls_trouble_is_logged_once_until_a_master_answers(caplog: pytest.LogCaptureFixture) -> None:
    from agent.executor.tls_trouble import TLSTrouble
    from agent.observe.events import EventLog
    from elastic.control.error_table import MasterTLSError, MasterUnreachableError

    trouble = TLSTrouble(EventLog())
    bad = MasterTLSError("the certificate of the master at h:1 does not verify: self-signed certificate")
    with caplog.at_level("INFO", logger="agent"):
        for exc in (bad, bad, MasterUnreachableError("no job master answered at h:1"), bad):
            trouble.failed(exc)
        # The master being away does not make the TLS reason less of an explanation.
        assert trouble.reason == str(bad)
        assert trouble.lost(61.4, 60, ["h:1"]) == (
            f"{bad}; no job master answered over verified TLS for 61s (--master-timeout 60s)"
        )
        trouble.answered()
        trouble.answered()
    messages = [r.getMessage() for r in caplog.records]
    assert [m for m in messages if m.startswith("TLS with the master failed")] == [
        f"TLS with the master failed: {bad}; the workers keep training, retrying until --master-timeout"
    ]
    assert messages.count("a master answers over verified TLS again; the job goes on") == 1
    assert trouble.reason is None
    assert trouble.lost(61, 60, ["h:1", "h:2"]) == (
        "no job master answered for 61s (--master-timeout 60s) at h:1, h:2"
    )


# -- convenience mode: the first agent hosts an https master -------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_an_agent_hosting_the_master_serves_it_over_tls(launch, pki, token_file):
    port = free_port()
    argv = elastic_run_argv(
        "--nnodes",
        "1",
        "--master",
        f"127.0.0.1:{port}",
        "--host-master",
        "--job-id",
        unique_job_id(),
        "--token-file",
        str(token_file),
        "--tls-ca",
        str(pki.ca),
        "--tls-cert",
        str(pki.server_cert),
        "--tls-key",
        str(pki.server_key),
        str(TRAIN_SCRIPT),
        "--steps",
        "3",
        "--batch-size",
        "32",
    )
    agent = launch(argv, "agent", clean_env())
    agent.wait_for("this agent hosts it", START_S)
    code = agent.wait(START_S + EXIT_S)
    assert code == 0, agent.output()[-4000:]
    assert "job succeeded" in agent.output()


# -- bad flags: one line, exit 2 ------------------------------------------------------------------------


def _bad_flag_cases(pki: Pki) -> list[tuple[list[str], tuple[str, ...]]]:
    cert, key, ca = str(pki.server_cert), str(pki.server_key), str(pki.ca)
    missing, encrypted = str(pki.folder / "missing.pem"), str(pki.encrypted_key)
    serve = ["--host", "127.0.0.1", "--port", "0", "--job-id", "j", "--token-file", str(pki.folder / "tok")]
    run_args = ["--master", "127.0.0.1:1", "--job-id", "j"]
    script = [str(TRAIN_SCRIPT)]
    return [
        (elastic_master_argv(*serve, "--tls-cert", cert), ("--tls-cert and --tls-key",)),
        (elastic_master_argv(*serve, "--tls-key", key), ("--tls-cert and --tls-key",)),
        (elastic_master_argv(*serve, "--tls-cert", missing, "--tls-key", key), ("cannot read", missing)),
        (elastic_master_argv(*serve, "--tls-cert", key, "--tls-key", key), ("cannot use TLS certificate",)),
        (elastic_master_argv(*serve, "--tls-cert", ca, "--tls-key", key), ("cannot use TLS certificate",)),
        (elastic_master_argv(*serve, "--tls-cert", cert, "--tls-key", encrypted), ("encrypted",)),
        (elastic_master_argv("status", *run_args, "--tls-ca", missing), ("cannot read TLS CA file",)),
        (elastic_master_argv("status", *run_args, "--tls-ca", key), ("cannot use TLS CA file",)),
        (elastic_master_argv("status", "--master", "https://127.0.0.1:1", "--job-id", "j"), ("scheme",)),
        (elastic_run_argv(*run_args, "--tls-cert", cert, *script), ("--tls-cert and --tls-key",)),
        (elastic_run_argv(*run_args, "--tls-cert", cert, "--tls-key", key, *script), ("need --tls-ca",)),
        (elastic_run_argv("--standalone", "--tls-cert", cert, "--tls-key", key, *script), ("--standalone",)),
        (elastic_run_argv(*run_args, "--tls-ca", missing, *script), ("--tls-ca", "cannot read TLS CA file")),
        (
            elastic_run_argv(*run_args, "--tls-ca", ca, "--tls-cert", key, "--tls-key", key, *script),
            ("--tls-cert", "cannot use TLS certificate"),
        ),
        (elastic_run_argv("--master", "https://127.0.0.1:1", "--job-id", "j", *script), ("scheme",)),
    ]


@pytest.mark.timeout(240)
def test_bad_tls_flags_are_one_line_usage_errors(pki):
    for argv, needles in _bad_flag_cases(pki):
        started = time.monotonic()
        result = run(argv)
        what = " ".join(argv[argv.index("-m") + 1 :]).replace(str(pki.folder), "PKI")
        assert result.returncode == 2, (what, result.stderr)
        assert len(result.stderr.strip().splitlines()) == 1, (what, result.stderr)
        assert_one_line_error(result.stderr, *needles)
        assert time.monotonic() - started < 30, what
    assert not (pki.folder / "tok").exists()  # refused before the token file was created
