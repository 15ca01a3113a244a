"""The secret a join leaves its node's incarnation with (master.job.liveness.incarnation_secret): the one
the join names when it is as strong as the master's, so that a retried join is idempotent."""

from __future__ import annotations

import pytest

from master.job.liveness import NAMED_SECRET_CHARS, JoinKind, incarnation_secret, new_secret

NAMED = new_secret()  # what an agent names: as long as the master's own


@pytest.mark.parametrize("kind", [JoinKind.NEW, JoinKind.REPLACE, JoinKind.REJOIN])
def test_a_join_keeps_the_secret_it_names(kind: JoinKind) -> None:
    assert incarnation_secret(kind, NAMED) == NAMED


@pytest.mark.parametrize("sent", [None, "", "short", "x" * (NAMED_SECRET_CHARS[1] + 1)])
@pytest.mark.parametrize("kind", [JoinKind.NEW, JoinKind.REPLACE])
def test_a_new_incarnation_without_a_strong_named_secret_gets_a_fresh_one(
    kind: JoinKind, sent: str | None
) -> None:
    secret = incarnation_secret(kind, sent)
    assert secret != sent and len(secret) >= NAMED_SECRET_CHARS[0]
    assert incarnation_secret(kind, sent) != secret, "drawn at random each time"


def test_a_duplicate_starts_no_incarnation() -> None:
    with pytest.raises(ValueError):
        incarnation_secret(JoinKind.DUPLICATE, NAMED)
