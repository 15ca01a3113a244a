"""The agent's log of findings (``agent.checkpoints.keeper.FindingLog``): the ranks of one node report the
same integrity verdict each, and the node sends it once (named when any of its ranks was); a recurring
detection or a rollback at the same step is another finding; each goes until a heartbeat delivered it."""

from __future__ import annotations

from agent.checkpoints.keeper import FindingLog
from elastic.contract import IntegrityNote


def test_one_verdict_reported_by_several_local_ranks_is_one_finding_named_if_any_rank_was() -> None:
    log = FindingLog()
    rank0 = IntegrityNote("mismatch", (1,), 3, odd=True)
    log.add_integrity(12, rank0)
    log.add_integrity(12, IntegrityNote("mismatch", (1,), 3, named_here=True, odd=True))
    log.add_integrity(12, rank0)  # a third rank's copy changes nothing
    (found,) = log.pending()
    assert found.found_by == "integrity" and found.integrity is not None and found.integrity["named_here"]
    log.add_integrity(12, IntegrityNote("mismatch", (1,), 3, odd=True, rolled_back_to=11))
    log.add_integrity(12, IntegrityNote("mismatch", (1,), 3, odd=True, recurring=True))
    assert len(log.pending()) == 3, "a rollback and a recurring detection are findings of their own"
    log.delivered(f.id for f in log.pending())
    assert not log.pending()
    log.add(4, "/dev/shm/x", "restore", "digest mismatch")
    assert "integrity" not in log.pending()[0].fields(), "a corruption's wire form is an older master's"
