"""Hot spares end to end: a real master (``--nnodes 2:2``), three real agents (two members and a spare)
and real gloo workers of scripts/train_inprocess.py (``elastic.run``). When a member's node is SIGKILLed
(its agent's whole process group), the next round closes as soon as the survivor is back, with the spare in
the lost node's node rank: the world keeps its size, the survivor keeps its rank and its worker process,
and training goes on with every sample trained once."""

from __future__ import annotations

import os
import signal

import e2e
import pytest
from e2e import wait_until
from inprocess_jobs import check_samples_once, script, worlds
from multinode_cluster import START_S, assert_no_survivors, assert_succeeded, remember_workers, start_cluster

launch = e2e.launch

pytestmark = pytest.mark.slow


@pytest.mark.timeout(240)
def test_a_spare_takes_the_lost_nodes_rank_and_the_survivor_keeps_its_process(launch, tmp_path):
    cluster = start_cluster(launch, tmp_path, "2:2")
    steps = 20
    argv = script(tmp_path, steps, 0.03, "--ckpt-every", "5")
    env = {"ELASTIC_PG_TIMEOUT_S": "600"}
    agents = {node: cluster.agent(node, argv, env=env) for node in "abc"}
    # Whichever two join first are the members; the third is the spare.
    status = wait_until(
        lambda: (s := cluster.status())["spares"] and s["phase"] == "training" and s, START_S, "a spare"
    )
    ranks = {n["node_id"]: n["rank"] for n in status["nodes"]}
    (spare_id,) = status["spares"]
    lost_id = next(node for node, rank in ranks.items() if rank == 0)  # rank 0 also hosts the store
    survivor_id = next(node for node, rank in ranks.items() if rank == 1)
    lost, survivor, spare = agents[lost_id], agents[survivor_id], agents[spare_id]
    lost.wait_for(r"^\[rank0\]:step=3 ", START_S)
    (before,) = worlds(survivor.output())
    assert (before["rank"], before["world"]) == (1, 2)
    remember_workers(survivor, spare)

    os.killpg(lost.pid, signal.SIGKILL)  # the whole node: its agent, zygote and worker
    spare.wait_for(r"round 2: node rank 0 of 2, ranks 0-0 of world 2", START_S)
    spare.wait_for(r"^\[rank0\]:world rank=0 world=2 round=2", START_S)
    survivor.wait_for(r"^\[rank1\]:world rank=1 world=2 round=2", START_S)
    assert {w["pid"] for w in worlds(survivor.output())} == {before["pid"]}, "the survivor kept its process"
    formed = [w for w in worlds(spare.output()) + worlds(survivor.output()) if w["round"] == 2]
    assert len(formed) == 2 and formed[0]["state"] == formed[1]["state"], "the spare got the survivor's state"
    assert formed[0]["step"] > 0, "resumed from memory, not from step 0"
    spare.wait_for(r"^\[rank0\]:step=\d+ loss=\S+ world=2$", START_S)  # training goes on
    assert cluster.status()["spares"] == []
    assert f"spare {spare_id} takes node rank 0 of {lost_id}" in cluster.status()["waiting_reason"]
    assert_succeeded(survivor, spare)
    check_samples_once(tmp_path / "samples", steps, 2)
    assert_no_survivors(survivor, spare)
