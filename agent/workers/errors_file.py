"""Worker error files (``TORCHELASTIC_ERROR_FILE``) and root-cause messages for failed workers.

A worker whose entry point is wrapped in ``torch.distributed.elastic.multiprocessing.errors.record`` writes
its uncaught exception to the file named by ``TORCHELASTIC_ERROR_FILE`` as
``{"message": {"message": "RuntimeError: boom", "extraInfo": {"py_callstack": ..., "timestamp": ...}}}``.
When there is no such file, the message comes from the tail of the worker's stderr instead.
"""

import json
import logging
import re
from collections.abc import Iterable
from pathlib import Path

logger = logging.getLogger(__name__)

MAX_MESSAGE_CHARS = 2000

# The last line of a Python traceback: "RuntimeError: boom", "torch.distributed.DistBackendError: ...",
# "KeyboardInterrupt", "AssertionError".
_EXCEPTION_LINE = re.compile(
    r"^(?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*(?:Error|Exception|Interrupt|Exit|Failure)(?::.*)?$"
)


def error_file_path(error_dir: Path, attempt: str, global_rank: int) -> Path:
    """Where the worker with ``global_rank`` writes its error file during ``attempt``."""
    return error_dir / attempt / f"rank{global_rank}" / "error.json"


def prepare_error_file(path: Path) -> None:
    """Create the parent folders and remove a stale file from an earlier run with the same attempt name."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)


def read_error_file(path: Path) -> str | None:
    """The message in a worker's error file, or None when there is no usable file.

    Accepts torch's format (``{"message": {"message": str, ...}}``) and the plain ``{"message": str}``.
    """
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except FileNotFoundError:
        return None
    except OSError as e:
        logger.warning("cannot read worker error file %s: %s", path, e)
        return None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        logger.warning("worker error file %s is not JSON (%s); ignoring it", path, e)
        return None
    message = data.get("message") if isinstance(data, dict) else None
    if isinstance(message, dict):
        message = message.get("message")
    if not isinstance(message, str) or not message.strip():
        logger.warning("worker error file %s has no message; ignoring it", path)
        return None
    return truncate(message.strip())


def message_from_stderr(lines: Iterable[str]) -> str | None:
    """The most telling line of a worker's stderr tail: the last exception line, else the last line."""
    non_empty = [line.strip() for line in lines if line.strip()]
    for line in reversed(non_empty):
        if _EXCEPTION_LINE.match(line):
            return truncate(line)
    return truncate(non_empty[-1]) if non_empty else None


def truncate(message: str, limit: int = MAX_MESSAGE_CHARS) -> str:
    """Cut ``message`` to ``limit`` characters, marking the cut."""
    return message if len(message) <= limit else message[: limit - 3] + "..."
