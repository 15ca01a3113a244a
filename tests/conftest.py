"""Shared pytest fixtures."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from etcd_server import EtcdNotFoundError, EtcdServer


def _start_etcd(base_dir) -> EtcdServer:
    try:
        return EtcdServer(base_dir).start()
    except EtcdNotFoundError as exc:  # CI must never skip etcd tests: a missing binary is a failure
        pytest.fail(str(exc), pytrace=False)


@pytest.fixture(scope="session")
def etcd_endpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """``127.0.0.1:PORT`` of an etcd shared by the session; tests use distinct job ids and never stop it."""
    server = _start_etcd(tmp_path_factory.mktemp("etcd-shared"))
    try:
        yield server.endpoint
    finally:
        server.stop()


@pytest.fixture
def etcd_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdServer]:
    """A private etcd that the test may ``stop()``, ``kill()``, ``start()`` or ``restart()`` (same endpoint
    and data); stopped by PID at teardown."""
    server = _start_etcd(tmp_path_factory.mktemp("etcd"))
    try:
        yield server
    finally:
        server.stop()
