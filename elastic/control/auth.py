"""Job tokens: reading a token file, creating one, and the convenience token derived from a job id."""

from __future__ import annotations

import hashlib
import logging
import os
import secrets
import stat

from elastic import errors

#: The environment variable that may carry the job's token instead of a token file.
TOKEN_ENV = "ELASTIC_TOKEN"
#: The shortest token either command line accepts (bytes): a short token is guessed, even at the rate
#: limit of wrong tokens (docs/security.md). Created tokens have 43 characters, derived ones 64.
MIN_TOKEN_BYTES = 16

log = logging.getLogger(__name__)


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


def job_token(token_file: str | None, *, create: bool = False, warn_loose: bool = True) -> str | None:
    """The job's token as both command lines take it: the one in ``token_file`` when given, else
    ``ELASTIC_TOKEN``, else None (the caller decides: a random or derived token, or a usage error).

    ``create``: a missing ``token_file`` is created with a random token (``elastic-master``; its
    ``OSError`` propagates). ``warn_loose``: a token file that group or others can access is logged as a
    warning (the agent and the master daemon; an operator's one-shot command keeps its stderr to its one
    line). Raises :class:`TokenError` for a missing (unless created), unreadable or empty token file, and
    for a token shorter than :data:`MIN_TOKEN_BYTES` (file or environment).
    """
    if token_file:
        if create and not os.path.exists(token_file):
            token = create_token_file(token_file)
            log.info("created token file %s (share it with every agent of the job)", token_file)
            return token
        token = read_token_file(token_file)
        check_token_length(token, f"token file {token_file!r}")
        if warn_loose and (warning := loose_permissions_warning(token_file)):
            log.warning("%s", warning)
        return token
    from_env = os.environ.get(TOKEN_ENV) or None
    if from_env is not None:
        check_token_length(from_env, TOKEN_ENV)
    return from_env


def check_token_length(token: str, where: str) -> None:
    """Raise :class:`TokenError` when ``token`` (from ``where``) is shorter than :data:`MIN_TOKEN_BYTES`."""
    if len(token.encode()) < MIN_TOKEN_BYTES:
        raise TokenError(
            f"the token in {where} has {len(token.encode())} bytes, fewer than {MIN_TOKEN_BYTES}: use a "
            "longer one (elastic-master --token-file NEW_PATH creates one)"
        )


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
