"""Worker error files (``TORCHELASTIC_ERROR_FILE``) and root-cause messages for failed workers.

A worker whose entry point is wrapped in ``torch.distributed.elastic.multiprocessing.errors.record`` writes
its uncaught exception to the file named by ``TORCHELASTIC_ERROR_FILE`` as
``{"message": {"message": "RuntimeError: boom", "extraInfo": {"py_callstack": ..., "timestamp": ...}}}``.
When there is no such file, the message comes from the tail of the worker's stderr instead. Either way the
message is one line that says what failed (:func:`message_from_stderr`), never a line that says where.
"""

import json
import logging
import re
from collections.abc import Iterable
from pathlib import Path

logger = logging.getLogger(__name__)

MAX_MESSAGE_CHARS = 2000

# An exception line: "RuntimeError: boom", "torch.distributed.DistBackendError: ...", "KeyboardInterrupt",
# "AssertionError".
_EXCEPTION_LINE = re.compile(
    r"^(?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*(?:Error|Exception|Interrupt|Exit|Failure)(?::.*)?$"
)
# The prefix torch's excepthook puts before each line of a distributed worker's traceback ("[rank0]: ").
_TORCH_RANK_PREFIX = re.compile(r"^\[rank\d+\]: ?")
# Lines that locate code rather than say what failed: Python's frames and the carets under them, torch's
# C++ frame list ("frame #N: ...", "Exception raised from ...") and the Python frames it appends
# (".../default_hooks.py(31): <lambda>").
_FRAME_LINE = re.compile(
    r'^(?:File "|frame #\d+:|Exception raised from |\S*\.py\(\d+\): |[\^~]+$|\(most recent call first\))'
)
_TRACEBACK = "Traceback (most recent call last):"


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
    # torch's errors carry a C++ frame list after their first line: the summary is the exception line.
    return message_from_stderr(message.splitlines()) if "\n" in message.strip() else truncate(message.strip())


def message_from_stderr(lines: Iterable[str]) -> str | None:
    """The root cause in a worker's stderr tail, as one line: the exception line of the last traceback
    (its first line, where the message of torch's errors goes on with a C++ frame list), else the last
    exception line, else the last line that is not a frame; None for no text. torch's ``[rankN]:``
    prefixes are removed first."""
    text = [_TORCH_RANK_PREFIX.sub("", line.rstrip()) for line in lines]
    text = [line for line in text if line.strip()]
    starts = [i for i, line in enumerate(text) if line.strip() == _TRACEBACK]
    if starts:
        for line in text[starts[-1] + 1 :]:
            # A frame's code line is indented; the exception line starts at the margin.
            if not line.startswith(" ") and _EXCEPTION_LINE.match(line):
                return truncate(line)
    stripped = [line.strip() for line in text]
    for line in reversed(stripped):
        if _EXCEPTION_LINE.match(line):
            return truncate(line)
    for line in reversed(stripped):
        if not _FRAME_LINE.match(line):
            return truncate(line)
    return truncate(stripped[-1]) if stripped else None


# -- what kind of failure a message says: the master's crash-loop policy compares them -------------------
# The type of an exception line, without its module path: "torch.distributed.DistBackendError: x" ->
# "DistBackendError".
_EXCEPTION_TYPE = re.compile(
    r"^(?:[A-Za-z_]\w*\.)*([A-Za-z_]\w*(?:Error|Exception|Interrupt|Exit|Failure))\b"
)
#: Known deterministic start-up errors: kind -> the exception types (or message patterns) that show it.
#: Restarting never fixes them; the master stops the job at the first one (docs/failures.md, "Crash loops").
_KNOWN_TYPES = {
    "import": ("ModuleNotFoundError", "ImportError"),
    "syntax": ("SyntaxError", "IndentationError", "TabError"),
    "missing_file": ("FileNotFoundError",),
}
_KNOWN_PATTERNS = (
    # python itself, for a script that is not there: "python: can't open file '/x/t.py': [Errno 2] ..."
    ("missing_file", re.compile(r"can't open file .*\[Errno 2\] No such file or directory")),
    # elastic.save (elastic/checkpoint/replicated.py, shard_save.py): the checkpoint does not fit /dev/shm
    ("shm_too_small", re.compile(r"not enough shared memory for the (?:sharded )?checkpoint")),
)


def exception_type(message: str) -> str:
    """The exception type a root-cause message (:func:`message_from_stderr`) starts with, without its
    module path (``ModuleNotFoundError``); empty when it names none."""
    match = _EXCEPTION_TYPE.match(message.strip())
    return match.group(1) if match else ""


def known_error(message: str) -> str:
    """The kind of known deterministic start-up error ``message`` shows (``import``, ``syntax``,
    ``missing_file``, ``shm_too_small``), or empty. Whether it stops the job at once is the master's
    decision (it also weighs where in the round the failure came: master.job.crash_loop)."""
    for kind, pattern in _KNOWN_PATTERNS:
        if pattern.search(message):
            return kind
    found = exception_type(message)
    return next((kind for kind, types in _KNOWN_TYPES.items() if found in types), "")


def truncate(message: str, limit: int = MAX_MESSAGE_CHARS) -> str:
    """Cut ``message`` to ``limit`` characters, marking the cut."""
    return message if len(message) <= limit else message[: limit - 3] + "..."
