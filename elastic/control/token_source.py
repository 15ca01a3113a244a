"""The job token as a file that may change: a Kubernetes Secret volume (its ``..data`` symlink swapped), a
file an operator replaces. Rotating the token restarts nothing (docs/security.md, "Rotating the token").

:class:`TokenWindow` is the pure rule of a listener (the master's API, its metrics and status page, an
agent's metrics): after a change it accepts the new token and, for ``grace_s`` (one heartbeat timeout), the
previous one too; then only the new one. :class:`WatchedToken` feeds it from the file: polled at most once a
:data:`POLL_S` on use, and at once (when the file looks changed) before a token is refused, so that a client
that read the new token first is not refused for the listener's polling period. A client (the agent's
master client) asks it for :meth:`WatchedToken.alternatives` after a 401: the file's new token, else the
previous one (its master has not seen the change yet). ``ELASTIC_TOKEN`` cannot change: rotation needs a file.
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from elastic.control.auth import TokenError, check_token_length, read_token_file

log = logging.getLogger(__name__)

#: Seconds between two reads of a watched token file on use (a stat before a refusal is not counted).
POLL_S = 1.0
#: Changes kept for :meth:`WatchedToken.take_news` until taken.
_NEWS_CAP = 16


@dataclass
class TokenWindow:
    """Which tokens a listener accepts at a time: :attr:`current` always, :attr:`previous` until
    :attr:`previous_until` (``grace_s`` after the change). No I/O; times are the caller's clock."""

    current: str
    grace_s: float
    previous: str | None = None
    previous_until: float = float("-inf")

    def rotate(self, new: str, now: float) -> bool:
        """``new`` is the token from ``now`` on; the one it replaces stays accepted for ``grace_s``.
        False (nothing changes) when ``new`` is the current token."""
        if new == self.current:
            return False
        self.previous, self.previous_until, self.current = self.current, now + self.grace_s, new
        return True

    def accepts(self, given: bytes, now: float) -> bool:
        """Whether ``given`` is the current token, or the previous one within its grace. Both comparisons
        run in constant time, always, so the answer's timing tells nothing about either token."""
        current = secrets.compare_digest(given, self.current.encode())
        previous = secrets.compare_digest(given, (self.previous or "").encode()) and self.previous is not None
        return current or (previous and now < self.previous_until)


#: ``(kind, message)`` of a change a :class:`WatchedToken` saw: ``"rotated"`` (a new token) or ``"unusable"``
#: (the file cannot be read, is empty or too short: the current token stays). Messages never carry a token.
TokenNews = tuple[str, str]


class WatchedToken:
    """The job token of a process, re-read from ``path`` when it changes (``path`` None: a fixed token,
    from ``ELASTIC_TOKEN`` or created in memory). Thread-safe. Each change is queued for :meth:`take_news`
    (the master records it as a job event, whose line is the log line) and, with ``log_news``, logged."""

    def __init__(
        self,
        token: str,
        path: str | None,
        grace_s: float,
        *,
        poll_s: float = POLL_S,
        clock: Callable[[], float] = time.monotonic,
        log_news: bool = True,
    ) -> None:
        self.path = path
        self._log_news = log_news
        self.window = TokenWindow(token, grace_s)
        self._poll_s, self._clock = poll_s, clock
        self._lock = threading.Lock()
        self._polled_at = clock()
        self._signature = _signature(path) if path else None
        self._problem: str | None = None  # the newest unusable-file line said (said once per problem)
        self._news: list[TokenNews] = []

    @property
    def current(self) -> str:
        """The token this process sends and accepts now."""
        return self.window.current

    def accepts(self, given: bytes) -> bool:
        """Whether a listener accepts ``given`` now (:class:`TokenWindow`). The file is polled first (at
        most once a :data:`POLL_S`); a refused token gets one more look at the file when it looks changed
        (a stat), so a client that read the new token before this process did is not refused."""
        self.poll()
        if self.window.accepts(given, self._clock()):
            return True
        return self.poll(force=True) and self.window.accepts(given, self._clock())

    def poll(self, force: bool = False) -> bool:
        """Re-read the file if :data:`POLL_S` passed since the last read (``force``: now, but only when its
        stat changed: the listener's path before a refusal). True when the token changed."""
        if self.path is None:
            return False
        with self._lock:
            now = self._clock()
            if not force and now - self._polled_at < self._poll_s:
                return False
            signature = _signature(self.path)
            if force and signature == self._signature:
                return False  # a wrong token, not a new file: no read per refused request
            self._polled_at, self._signature = now, signature
            return self._read(now)

    def alternatives(self, refused: str) -> list[str]:
        """Tokens a client may try after ``refused`` was answered 401: the file's token if the file now
        holds another one (read now), then the previous token (its listener may not have seen the change
        yet); neither is ``refused``. Empty: the 401 is final (the file still holds ``refused``, or none)."""
        if self.path is not None:
            with self._lock:
                now = self._clock()
                self._polled_at, self._signature = now, _signature(self.path)
                self._read(now)
        found = [self.window.current, self.window.previous]
        return [t for i, t in enumerate(found) if t is not None and t != refused and t not in found[:i]]

    def take_news(self) -> list[TokenNews]:
        """The changes seen since the last call, oldest first."""
        with self._lock:
            news, self._news = self._news, []
        return news

    def _read(self, now: float) -> bool:
        assert self.path is not None
        try:
            token = read_token_file(self.path)
            check_token_length(token, f"token file {self.path!r}")
        except TokenError as exc:
            problem = f"{exc}; the current token stays in use until the file holds a usable one"
            if problem != self._problem:  # once per problem, not once a poll
                self._problem = problem
                self._say("unusable", problem)
            return False
        self._problem = None
        if not self.window.rotate(token, now):
            return False
        message = (
            f"the job token in {self.path} changed: the new token is accepted, and the previous one for "
            f"{self.window.grace_s:g}s more (one heartbeat timeout)"
        )
        self._say("rotated", message)
        return True

    def _say(self, kind: str, message: str) -> None:
        if self._log_news:
            log.log(logging.INFO if kind == "rotated" else logging.WARNING, "%s", message)
        if len(self._news) < _NEWS_CAP:  # nobody may drain them (an agent's listener): bounded
            self._news.append((kind, message))


def _signature(path: str) -> tuple[int, int, int, int, int] | None:
    """What tells a changed file from the same one without reading it: the stat of the resolved path (a
    Kubernetes Secret volume swaps the ``..data`` symlink, so the inode changes); None when it is gone."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
