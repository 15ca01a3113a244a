"""master.service.gc_pacing: CPython starts no full collection of its own while the pacer runs, the pacer's
periodic one frees cyclic garbage, and stopping gives CPython its thresholds back. In a child interpreter:
the thresholds are process-wide."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(
    """
    import gc, weakref
    from master.service.gc_pacing import NEVER, GcPacer

    class Node:
        pass

    before = gc.get_threshold()
    full = []
    gc.callbacks.append(lambda phase, info: phase == "stop" and info["generation"] == 2 and full.append(1))
    pacer = GcPacer(full_every_s=60.0)
    pacer.start(now=0.0)
    assert gc.get_threshold()[:2] == before[:2] and gc.get_threshold()[2] == NEVER
    a, b = Node(), Node()
    a.peer, b.peer = b, a  # a cycle: only the collector frees it
    gone = weakref.ref(a)
    gc.collect(1)  # alive: promoted to the oldest generation, as the job's state is
    del a, b
    for _ in range(300_000):  # many young collections, objects surviving them: no full one starts
        keep = [Node() for _ in range(3)]
    assert not full, "CPython started a full collection"
    gc.collect(1)
    assert gone() is not None, "young collections leave the oldest generation alone"
    pacer.tick(now=59.0)
    assert gone() is not None and pacer.full_collections == 0, "not yet"
    pacer.tick(now=60.0)
    assert gone() is None and pacer.full_collections == 1 and pacer.last_full_freed >= 2
    pacer.stop()
    assert gc.get_threshold() == before
    print("ok")
    """
)


@pytest.mark.timeout(60)
def test_only_the_pacer_runs_full_collections_and_they_free_cycles() -> None:
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=50)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr
