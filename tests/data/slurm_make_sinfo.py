"""Regenerate ``slurm_sinfo_22.05.json``: what ``sinfo -h -N -o "%N %T"`` prints, by scenario, on the
two-node test cluster of tests/support/slurm_cluster.py (Debian's slurm-wlm 22.05): idle nodes, an
allocated one, drained (idle), draining (allocated), down, failing (allocated) and a slurmd that stopped
answering (``*``).

Run (root, with ``scripts/install-test-tools.sh``'s SLURM): ``python tests/data/slurm_make_sinfo.py``
(about 40 s: SLURM declares the stopped slurmd's node DOWN after SlurmdTimeout). Not part of the suite: the
file is the fixture of tests/unit/agent/test_slurm_state.py.
"""

from __future__ import annotations

import json
import signal
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent / "support"), str(HERE.parents[1])]

from e2e import wait_until  # noqa: E402 - tests/support, put on the path above
from slurm_cluster import SLURMD_TIMEOUT_S, SlurmCluster  # noqa: E402


def main() -> None:
    cluster = SlurmCluster().start()
    out: dict[str, str] = {}

    def sinfo() -> str:
        return cluster.run("sinfo", "-h", "-N", "-o", "%N %T")

    def update(node: str, state: str) -> None:
        cluster.run("scontrol", "update", f"NodeName={node}", f"State={state}", "Reason=recorded")

    try:
        out["idle"] = sinfo()
        job = cluster.run(
            "sbatch", "--parsable", "-N1", "-w", "n1", "-o", "/dev/null", "--wrap", "sleep 600"
        ).strip()
        wait_until(lambda: cluster.node_states().get("n1") == "allocated", 30, "n1 allocated")
        out["n1_allocated"] = sinfo()
        update("n2", "DRAIN")
        out["n2_drained"] = sinfo()
        update("n1", "DRAIN")
        out["n1_draining_n2_drained"] = sinfo()
        update("n2", "RESUME")
        update("n2", "DOWN")
        out["n1_draining_n2_down"] = sinfo()
        update("n2", "RESUME")
        update("n1", "RESUME")
        update("n1", "FAIL")
        out["n1_failing"] = sinfo()
        update("n1", "RESUME")
        cluster.run("scancel", job)
        wait_until(lambda: cluster.node_states() == {"n1": "idle", "n2": "idle"}, 60, "both idle")
        slurmd = cluster._daemons[-1]  # the last slurmd started: n2's
        slurmd.send_signal(signal.SIGSTOP)  # alive, but answers nothing: SLURM marks it not responding
        try:
            wait_until(
                lambda: cluster.node_states().get("n2", "").startswith("down"),
                SLURMD_TIMEOUT_S + 120,
                "n2 declared down",
                interval=1.0,
            )
            out["n2_not_responding"] = sinfo()
        finally:
            slurmd.send_signal(signal.SIGCONT)
    finally:
        cluster.stop()
    target = HERE / "slurm_sinfo_22.05.json"
    target.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {target}")


if __name__ == "__main__":
    main()
