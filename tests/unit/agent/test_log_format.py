"""The one shape of the commands' log lines (elastic.text.LogFormatter): ISO 8601 UTC time with
milliseconds, level, node, logger; text or JSON lines."""

from __future__ import annotations

import json
import logging
import sys

import pytest

from elastic.text import LogFormatter

# 2025-01-31T12:00:00.123Z
CREATED = 1738324800.123


def record(
    message: str = "joined: waiting for round %d", *args: object, exc: bool = False
) -> logging.LogRecord:
    exc_info = None
    if exc:
        try:
            raise RuntimeError("boom")
        except RuntimeError:
            exc_info = sys.exc_info()
    rec = logging.LogRecord("agent.executor.loop", logging.INFO, __file__, 1, message, args or (1,), exc_info)
    rec.created, rec.msecs = CREATED, 123.0
    return rec


def test_a_text_line_starts_with_the_utc_time_the_level_and_the_node():
    line = LogFormatter("node-a").format(record())

    assert line == "2025-01-31T12:00:00.123Z INFO    node-a [agent.executor.loop] joined: waiting for round 1"


def test_a_json_line_carries_time_level_node_logger_message_and_the_exception():
    data = json.loads(LogFormatter("master", "json").format(record(exc=True)))

    assert {k: data[k] for k in ("time", "level", "node", "logger", "message")} == {
        "time": "2025-01-31T12:00:00.123Z",
        "level": "INFO",
        "node": "master",
        "logger": "agent.executor.loop",
        "message": "joined: waiting for round 1",
    }
    assert "RuntimeError: boom" in data["exc_info"]


def test_an_unknown_format_is_refused():
    with pytest.raises(ValueError, match="text, json"):
        LogFormatter("n", "xml")
