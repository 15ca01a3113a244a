"""Node credentials: one secret per node *incarnation* (one agent process's life under a node id).

A join that starts an incarnation gets a fresh random secret (:func:`new_secret`); the master keeps only
its hash (:func:`hash_secret`, stored with the job's durable state so that it survives a failover), and
every later request for the node must carry the secret (:func:`matches`). The token lets a process into
the job; the secret binds a node id to the one agent that holds it, so that no other token holder can
report that node's failure, heartbeat for it or make it leave.

:func:`judge_join` is the whole decision about a join for a node id: pure, on facts the job computes at
``now`` (whether the current incarnation is alive), tested without a server.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from enum import Enum

#: Random bytes of a secret (``secrets.token_urlsafe``: 43 URL-safe characters).
SECRET_BYTES = 32


class JoinKind(Enum):
    """What a join for a node id is, given the node's current incarnation."""

    NEW = "new"  # no incarnation of this id (never joined, or declared dead, left, excluded): a new secret
    REJOIN = "rejoin"  # the current incarnation's own agent (it sent its secret): the secret stays
    REPLACE = "replace"  # the current incarnation closed its master connection or went silent: a new secret
    DUPLICATE = "duplicate"  # another live agent holds this id: refused (409 duplicate_node)


def new_secret() -> str:
    """A fresh secret for a new incarnation."""
    return secrets.token_urlsafe(SECRET_BYTES)


def hash_secret(secret: str) -> str:
    """What the master stores instead of the secret: its SHA-256, hex. A secret has 256 random bits, so
    a plain (unsalted, fast) hash is enough: there is nothing to guess a dictionary for."""
    return hashlib.sha256(secret.encode()).hexdigest()


def matches(secret_hash: str, secret: str | None) -> bool:
    """Whether ``secret`` is the one whose hash is ``secret_hash`` (constant-time comparison). A missing
    secret, or a node with no stored hash, never matches."""
    if not secret or not secret_hash:
        return False
    return hmac.compare_digest(hash_secret(secret), secret_hash)


def judge_join(current_hash: str | None, alive: bool, secret: str | None) -> JoinKind:
    """Decide a join for a node id.

    ``current_hash``: the stored hash of the id's current incarnation, None when there is none. ``alive``:
    whether that incarnation is alive at the join's time: heard from within the heartbeat timeout, its
    master connection not seen to close, not declared dead and not gone. ``secret``: what the join sent in
    ``X-Elastic-Node-Secret`` (None: nothing).
    """
    if current_hash is None:
        return JoinKind.NEW  # nobody holds the id
    if matches(current_hash, secret):
        return JoinKind.REJOIN  # the same agent, e.g. after its workers failed
    if alive:
        return JoinKind.DUPLICATE  # a second agent under a live agent's id: never take over a live node
    return JoinKind.REPLACE  # the previous agent is gone (or as good as): its restart takes the id over
