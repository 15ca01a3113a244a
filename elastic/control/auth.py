"""Job tokens: reading a token file, creating one, and the convenience token derived from a job id."""

from __future__ import annotations

import hashlib
import os
import secrets
import stat

from elastic import errors

#: The environment variable that may carry the job's token instead of a token file.
TOKEN_ENV = "ELASTIC_TOKEN"


class TokenError(errors.UsageError, ValueError):
    """A token file is missing, unreadable or empty."""


def read_token_file(path: str | os.PathLike[str]) -> str:
    """The token in ``path`` (surrounding whitespace stripped)."""
    try:
        with open(path, encoding="utf-8") as fh:
            token = fh.read().strip()
    except FileNotFoundError:
        raise TokenError(f"token file {os.fspath(path)!r} does not exist") from None
    except OSError as exc:
        raise TokenError(f"cannot read token file {os.fspath(path)!r}: {exc.strerror}") from None
    if not token:
        raise TokenError(f"token file {os.fspath(path)!r} is empty")
    return token


def loose_permissions_warning(path: str | os.PathLike[str]) -> str | None:
    """A one-line warning when the token file is readable or writable by group or others, else None."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        return (
            f"token file {os.fspath(path)!r} is accessible by group or others "
            f"(mode {stat.S_IMODE(mode):03o}): "
            f"anyone who reads it can control the job; run: chmod 600 {os.fspath(path)}"
        )
    return None


def create_token_file(path: str | os.PathLike[str]) -> str:
    """Write a new random token to ``path``, readable by the owner only, and return it."""
    token = secrets.token_urlsafe(32)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as fh:
        fh.write(token + "\n")
    return token


def derived_token(job_id: str) -> str:
    """Token used when none is configured (torchrun-style command lines).

    It only keeps agents of *other* jobs out; anyone who knows the job id can compute it. Use
    ``--token-file`` for real protection.
    """
    return hashlib.sha256(f"elastic-run/{job_id}".encode()).hexdigest()
