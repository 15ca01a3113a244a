"""A real SLURM cluster of two nodes on this machine, for tests/e2e/test_slurm_e2e.py.

Debian's ``slurm-wlm`` 22.05 (``slurmctld``, ``slurmd``, ``slurm-client``, ``munge``; installed by
``scripts/install-test-tools.sh``): one ``munged`` on a throwaway key and socket, one ``slurmctld`` and two
``slurmd`` (``-N n1``, ``-N n2``, each with its own ``Port=`` and ``NodeAddr=127.0.0.1``), all run as root
from a temporary folder with free ports, no cgroups and no systemd (``ProctrackType=proctrack/linuxproc``,
``TaskPlugin=task/none``). The commands reach this cluster, and no other, through ``SLURM_CONF`` in
:meth:`SlurmCluster.env`. :meth:`SlurmCluster.stop` cancels the jobs, stops the daemons by PID, kills by
PID whatever process still carries the cluster's marker variable (a ``slurmstepd`` outlives its
``slurmd``) and removes the folder. /work/shared/SLURM-NOTES.md has the facts this is built on.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path

import psutil
import pytest
from e2e import free_port, wait_until
from tools import require_tool

#: Every daemon and every job of a cluster carries ``MARKER=<its folder>`` in its environment: the
#: teardown's safety net finds what the cluster started by it, and nothing else.
MARKER = "ELASTIC_TEST_SLURM_CLUSTER"
NODES = ("n1", "n2")
#: A killed slurmd's node is declared DOWN after this long (SLURM's default, 300 s, is too long for a test).
SLURMD_TIMEOUT_S = 10
#: The main scheduler's period (SLURM's default, 60 s, would leave a released job waiting for the next
#: pass whenever the release's own pass came too early, as while the nodes still completed the last run).
SCHED_INTERVAL_S = 5
#: Bounds for a loaded 2-core machine: the daemons are up in about 3 s.
UP_S = 60.0
STOP_S = 30.0
#: The tools a test needs; each missing one skips it with a one-line reason (a failure under CI=true).
TOOLS = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "sinfo", "scancel", "squeue")

SLURM_CONF = """\
ClusterName=elastic
SlurmctldHost=localhost
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
AuthType=auth/munge
AuthInfo=socket={base}/munge/munge.socket
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation={base}/spool/ctld
SlurmdSpoolDir={base}/spool/d-%n
SlurmctldPidFile={base}/ctld.pid
SlurmdPidFile={base}/d-%n.pid
SlurmctldLogFile={base}/log/ctld.log
SlurmdLogFile={base}/log/d-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
MpiDefault=none
SwitchType=switch/none
SlurmdTimeout={slurmd_timeout}
FirstJobId={first_job_id}
SchedulerParameters=sched_interval={sched_interval}
{nodes}
PartitionName=p Nodes={node_list} Default=YES MaxTime=INFINITE State=UP
"""
NODE_LINE = (
    "NodeName={name} NodeHostname=localhost NodeAddr=127.0.0.1 Port={port} CPUs=1 RealMemory=1000 "
    "State=UNKNOWN"
)


def require_slurm() -> None:
    """Skip the calling test, naming the first missing tool, unless SLURM and munge are installed (and this
    process is root: the daemons run as root, ``SlurmUser=root``)."""
    for tool in TOOLS:
        require_tool(tool)
    if os.geteuid() != 0:
        pytest.skip("the SLURM test cluster runs its daemons as root (SlurmUser=root); run as root")


class SlurmCluster:
    """``munged``, ``slurmctld`` and one ``slurmd`` per node of :data:`NODES`, in a folder of their own."""

    def __init__(self) -> None:
        # Short and in /tmp: munge's unix socket path is limited to 108 bytes.
        self.base = Path(tempfile.mkdtemp(prefix="slurm-"))
        self.conf = self.base / "slurm.conf"
        #: Job ids count from here: a job's shared-memory folders (``/dev/shm/elastic-<job id>-<node>``, the
        #: recipe's job id is SLURM's) are then the test's own, and its teardown removes only those.
        self.first_job_id = random.randrange(100_000, 900_000)
        self._daemons: list[subprocess.Popen[bytes]] = []

    # -- life ----------------------------------------------------------------------------------------
    def start(self) -> SlurmCluster:
        """Write the key and slurm.conf, start the daemons and wait until every node is idle."""
        for sub in ("munge", "spool/ctld", "log", *(f"spool/d-{n}" for n in NODES)):
            (self.base / sub).mkdir(parents=True, exist_ok=True)
        key = self.base / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        nodes = "\n".join(NODE_LINE.format(name=n, port=free_port()) for n in NODES)
        self.conf.write_text(
            SLURM_CONF.format(
                base=self.base,
                ctld_port=free_port(),
                slurmd_port=free_port(),
                slurmd_timeout=SLURMD_TIMEOUT_S,
                first_job_id=self.first_job_id,
                sched_interval=SCHED_INTERVAL_S,
                nodes=nodes,
                node_list=",".join(NODES),
            )
        )
        munge = self.base / "munge"
        # -f: munged refuses to run as root, or with a key and socket in a folder it did not vet, without it.
        self._daemon(
            "munged",
            "-F",
            "-f",
            f"--key-file={key}",
            f"--socket={munge / 'munge.socket'}",
            f"--pid-file={munge / 'munged.pid'}",
            f"--log-file={munge / 'munged.log'}",
            f"--seed-file={munge / 'munged.seed'}",
        )
        wait_until(lambda: (munge / "munge.socket").exists(), UP_S, "munged's socket")
        self._daemon("slurmctld", "-D", "-f", str(self.conf))
        for node in NODES:
            self._daemon("slurmd", "-D", "-f", str(self.conf), "-N", node)
        wait_until(lambda: self.node_states() == dict.fromkeys(NODES, "idle"), UP_S, "both nodes idle")
        return self

    def _daemon(self, *argv: str) -> None:
        log = open(self.base / "log" / f"{argv[0]}-{len(self._daemons)}.out", "wb")  # noqa: SIM115
        with log:
            self._daemons.append(
                subprocess.Popen(argv, env=self.env(), stdout=log, stderr=subprocess.STDOUT, cwd=self.base)
            )

    def stop(self) -> None:
        """Cancel every job, stop the daemons by PID, kill what they left, remove the folder."""
        if self._daemons and self._daemons[0].poll() is None and len(self._daemons) > 1:
            with contextlib.suppress(subprocess.SubprocessError, OSError):
                self.run("scancel", "--full", "--user", "root", check=False)
        for popen in reversed(self._daemons):  # slurmd, slurmctld, then munged
            with contextlib.suppress(ProcessLookupError):
                popen.send_signal(signal.SIGTERM)
            try:
                popen.wait(STOP_S)
            except subprocess.TimeoutExpired:
                popen.kill()
                popen.wait(STOP_S)
        self._daemons.clear()
        for proc in self.leftovers():  # a slurmstepd outlives its slurmd, and its tasks with it
            with contextlib.suppress(psutil.Error):
                proc.kill()
        wait_until(lambda: not self.leftovers(), STOP_S, "the cluster's processes to end")
        shutil.rmtree(self.base, ignore_errors=True)

    def leftovers(self) -> list[psutil.Process]:
        """Live processes that carry this cluster's marker: what its daemons or jobs started."""
        found = []
        for proc in psutil.process_iter():
            try:
                env = proc.environ()
                if env.get(MARKER) == str(self.base) and proc.status() != psutil.STATUS_ZOMBIE:
                    found.append(proc)
            except psutil.Error:
                continue
        return found

    # -- commands ------------------------------------------------------------------------------------
    def env(self, **extra: str) -> dict[str, str]:
        """The environment of a command that talks to this cluster (and carries its marker)."""
        env = dict(os.environ)
        env.update(SLURM_CONF=str(self.conf), **{MARKER: str(self.base)})
        env.update(extra)
        return env

    def run(self, *argv: str, check: bool = True, env: dict[str, str] | None = None) -> str:
        """Run a SLURM command against this cluster; its stdout."""
        done = subprocess.run(
            argv, env=env or self.env(), capture_output=True, text=True, timeout=STOP_S, check=False
        )
        if check and done.returncode != 0:
            raise AssertionError(f"{' '.join(argv)} exited {done.returncode}: {done.stderr.strip()}")
        return done.stdout

    def node_states(self) -> dict[str, str]:
        """``sinfo -h -N -o "%N %T"`` as {node: state}; empty while slurmctld does not answer."""
        try:
            out = self.run("sinfo", "-h", "-N", "-o", "%N %T", check=False)
        except subprocess.TimeoutExpired:
            return {}
        return dict(line.split(None, 1) for line in out.splitlines() if " " in line)

    def job(self, job_id: int) -> dict[str, str]:
        """``scontrol show job -o`` as {field: value} (values without spaces, as the fields tests read)."""
        out = self.run("scontrol", "show", "job", "-o", str(job_id))
        fields: dict[str, str] = {}
        for item in out.split():
            key, sep, value = item.partition("=")
            if sep:
                fields.setdefault(key, value)
        return fields

    def log(self, name: str) -> str:
        """A daemon's log (``ctld``, ``d-n1``, ``d-n2``), for a failing test's message."""
        path = self.base / "log" / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""
