"""Fixtures the worker library's unit tests share."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from elastic.checkpoint import flash


@pytest.fixture
def flash_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A worker's environment under an agent, without the agent (reports go nowhere); yields the
    shared-memory folder its flash saves write to, and closes their reused segments at the end."""
    shm = tmp_path / "shm"
    shm.mkdir()
    for name in ("RANK", "WORLD_SIZE", "GROUP_RANK", "ELASTIC_CKPT_DIR", "ELASTIC_COMMITTED_STEP"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("ELASTIC_SHM_DIR", str(shm))
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("ELASTIC_AGENT_SOCKET", str(tmp_path / "nobody.sock"))
    yield shm
    flash.close_all()
