"""The master's test hook (the only one): ``ELASTIC_MASTER_TICK_FAULT_S=D`` makes the tick raise
:class:`InjectedFault` once this master has led for ``D`` seconds, to check from outside that a crash
in a background task resigns the leadership and exits non-zero (tests/e2e/test_master_stepdown_e2e.py).
Read once by the CLI; documented in docs/operations.md."""

from __future__ import annotations

import os

TICK_FAULT_ENV = "ELASTIC_MASTER_TICK_FAULT_S"


class InjectedFault(RuntimeError):
    """Raised by the tick when :data:`TICK_FAULT_ENV` asks for it."""


def tick_fault_from_env(environ: dict[str, str] | None = None) -> float | None:
    """Seconds of leadership after which the tick fails, or None; ValueError (one line) when malformed."""
    text = (os.environ if environ is None else environ).get(TICK_FAULT_ENV, "").strip()
    if not text:
        return None
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0:  # also NaN
        raise ValueError(f"{TICK_FAULT_ENV}={text!r}: expected a number of seconds >= 0")
    return value
