"""Opening the state store a ``--store`` URL names; the etcd client is imported only when used."""

from __future__ import annotations

import logging
import os
import stat

from master.store.base import MemoryStore, StateStore, StoreError

log = logging.getLogger(__name__)


def read_password_file(path: str) -> str:
    """The etcd user's password in ``path`` (surrounding whitespace stripped); warns when group or others
    may read the file. Raises :class:`StoreError` (one line) when it is missing, unreadable or empty."""
    try:
        with open(path, encoding="utf-8") as fh:
            password = fh.read().strip()
        mode = os.stat(path).st_mode
    except OSError as exc:
        raise StoreError(f"cannot read the etcd password file {path}: {exc.strerror}") from None
    if not password:
        raise StoreError(f"the etcd password file {path} is empty")
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        log.warning("etcd password file %s is accessible by group or others; run: chmod 600 %s", path, path)
    return password


def open_store(url: str, job_id: str, *, password: str | None = None) -> StateStore:
    """``memory://`` or ``etcd://[USER@]HOST:PORT[,HOST:PORT...]`` → a store for ``job_id``; ``password``
    is the etcd user's (etcd's authentication on), needed exactly when the URL names a user."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        raise StoreError(f"--store must look like memory:// or etcd://HOST:PORT, got {url!r}")
    if scheme == "memory":
        if password is not None:
            raise StoreError("--store-password-file is for an etcd user (--store etcd://USER@HOST:PORT)")
        return MemoryStore()
    if scheme == "etcd":
        from master.store.etcd_store import EtcdStore  # the etcd client is imported only when used

        user, at, endpoints = rest.rpartition("@")
        if at and not user:
            raise StoreError(f"--store {url!r}: the etcd user name before '@' is empty")
        if user and password is None:
            raise StoreError(
                f"--store names the etcd user {user!r}: give its password with --store-password-file"
            )
        if password is not None and not user:
            raise StoreError("--store-password-file needs the etcd user in --store: etcd://USER@HOST:PORT")
        return EtcdStore(endpoints, job_id, username=user or None, password=password)
    raise StoreError(f"unknown store scheme {scheme!r} in --store {url!r}; use memory:// or etcd://HOST:PORT")


def check_store(url: str, job_id: str, *, password: str | None = None) -> None:
    """Fail fast, with one line, when the store at ``url`` is unreachable or refuses us (before serving)."""
    import asyncio

    async def probe() -> None:
        store = open_store(url, job_id, password=password)
        try:
            await store.start()
        finally:
            await store.close()

    asyncio.run(probe())
