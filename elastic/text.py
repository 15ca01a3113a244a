"""Text from the network or from workers made safe to print: one line, no terminal control sequences.

Also the one shape of the commands' log lines (:class:`LogFormatter`, :func:`configure_logging`): time
stamp, level and node on every line, as text or JSON lines.
"""

from __future__ import annotations

import datetime
import json
import logging
import re
import sys

# C0 and C1 control characters and DEL; a newline would let a peer forge whole log lines, an escape
# sequence would let it rewrite the operator's terminal.
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")
_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def printable(text: str) -> str:
    """``text`` with every control character escaped (``\\n``, ``\\x1b``...): always a single line."""
    return _CONTROL.sub(lambda m: _NAMED.get(m.group(), f"\\x{ord(m.group()):02x}"), text)


# -- log lines --------------------------------------------------------------------------------------------
#: ``--log-format`` values of ``elastic-run`` and ``elastic-master``.
LOG_FORMATS = ("text", "json")

#: ``extra=`` of a record that ``--quiet`` keeps although it is below WARNING: the job's outcome, and where
#: to reach a master the agent hosts.
ALWAYS_SHOWN = {"always_shown": True}


class LogFormatter(logging.Formatter):
    """One log record as one line: ``TIME LEVEL NODE [LOGGER] MESSAGE`` (``text``), or a JSON object with
    ``time``, ``level``, ``node``, ``logger``, ``message`` and, for an exception, ``exc_info`` (``json``,
    for log shippers). TIME is ISO 8601 in UTC with milliseconds (``2025-01-31T12:00:00.123Z``), so the
    lines of several nodes sort and merge by their text. ``node`` may change after start (the agent knows
    its node id once its options are resolved)."""

    def __init__(self, node: str, log_format: str = "text") -> None:
        super().__init__()
        if log_format not in LOG_FORMATS:
            raise ValueError(f"log format must be one of {', '.join(LOG_FORMATS)}, not {log_format!r}")
        self.node = node
        self.log_format = log_format

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:  # noqa: N802 - logging's name
        moment = datetime.datetime.fromtimestamp(record.created, tz=datetime.timezone.utc)
        return moment.strftime("%Y-%m-%dT%H:%M:%S.") + f"{int(record.msecs):03d}Z"

    def format(self, record: logging.LogRecord) -> str:
        message = record.getMessage()
        when = self.formatTime(record)
        exc = self.formatException(record.exc_info) if record.exc_info else record.exc_text
        if self.log_format == "json":
            line: dict[str, str] = {
                "time": when,
                "level": record.levelname,
                "node": self.node,
                "logger": record.name,
                "message": message,
            }
            if exc:
                line["exc_info"] = exc
            if record.stack_info:
                line["stack_info"] = record.stack_info
            return json.dumps(line, ensure_ascii=False)
        text = f"{when} {record.levelname:<7} {self.node} [{record.name}] {message}"
        if exc:
            text += "\n" + exc
        if record.stack_info:
            text += "\n" + self.formatStack(record.stack_info)
        return text


class _QuietFilter(logging.Filter):
    """``--quiet``: warnings and errors, and the records logged with :data:`ALWAYS_SHOWN`."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING or bool(getattr(record, "always_shown", False))


#: The handler :func:`configure_logging` installed (None: it did not run in this process).
_handler: logging.Handler | None = None


def configure_logging(node: str, log_format: str = "text", quiet: bool = False) -> LogFormatter:
    """Send every log record of this process to stderr, one line each through a :class:`LogFormatter`;
    returns the formatter. Called again (a command once its options are parsed), it replaces only the
    handler it installed before, never another one (a test's capture). ``quiet``: only warnings, errors
    and the lines logged with :data:`ALWAYS_SHOWN` (workers' output is not logging and is never filtered
    here)."""
    global _handler
    root = logging.getLogger()
    if _handler is not None:
        root.removeHandler(_handler)
    _handler = logging.StreamHandler(sys.stderr)
    formatter = LogFormatter(node, log_format)
    _handler.setFormatter(formatter)
    if quiet:
        _handler.addFilter(_QuietFilter())
    root.addHandler(_handler)
    root.setLevel(logging.INFO)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request otherwise
    return formatter


def reconfigure_logging(node: str, log_format: str = "text", quiet: bool = False) -> None:
    """:func:`configure_logging` again with the command's options, when it ran in this process (the console
    entry point); else nothing: a command invoked in process (tests) keeps the caller's logging."""
    if _handler is not None:
        configure_logging(node, log_format, quiet)
