"""System tools that some tests need (installed by ``scripts/install-test-tools.sh``).

A test calls :func:`require_tool` before using one; a missing tool skips the test with a one-line reason,
and under CI (``CI=true``) tests/conftest.py turns that skip into a failure, so CI never passes by
silently skipping.
"""

from __future__ import annotations

import shutil

import pytest

#: Prefix of the skip reason of a missing tool; conftest.py recognises skips by it.
MISSING_TOOL = "missing test tool"


def require_tool(name: str) -> str:
    """The path of the command ``name``; skips the calling test when it is not installed."""
    path = shutil.which(name)
    if path is None:
        pytest.skip(f"{MISSING_TOOL} {name!r}: run `bash scripts/install-test-tools.sh` as root")
    return path
