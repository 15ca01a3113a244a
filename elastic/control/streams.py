"""The agent streams of one :class:`elastic.control.client.MasterClient`: at most one per master address,
opened on first use and shared by every thread of the client (heartbeats, long-polls, the main loop), so that
an agent holds one connection to its master (docs/protocol.md, "The agent stream").

A master that answers the upgrade with 404 is of a release without the stream (426: a proxy on the way
dropped the upgrade): that is remembered and the client speaks plain HTTP to it, until a request to that
address fails (the master there may have been restarted as a newer release). ``ELASTIC_MASTER_STREAM=0``
turns streams off (plain HTTP throughout, one connection per thread as before): for comparing and
debugging.
"""

from __future__ import annotations

import logging
import ssl
import threading
import time
from collections.abc import Mapping
from typing import Any

from elastic.control.stream_client import StreamConnection, StreamRefused, StreamTimeout
from elastic.errors import MasterError

log = logging.getLogger(__name__)

#: ``0`` (or ``false``, ``no``, ``off``): agents speak plain HTTP to their masters, no stream.
STREAM_ENV = "ELASTIC_MASTER_STREAM"
_OFF = frozenset({"0", "false", "no", "off"})
#: Answers to the upgrade that mean "no stream here", remembered: 404, a master of an older release; 426,
#: the upgrade headers were lost on the way (a proxy that does not pass upgrades on).
_NO_STREAM = frozenset({404, 426})
#: Shortest time between two attempts of :meth:`MasterStreams.warm_others` at one address.
WARM_RETRY_S = 10.0
#: The master's own refusals of the upgrade (docs/protocol.md): the call's answer, as over HTTP. Any other
#: status (a proxy's 400 or 502, say) sends that call over plain HTTP, without remembering it.
_REFUSALS = frozenset({401, 409, 429, 503})


def stream_wanted(environ: Mapping[str, str]) -> bool:
    """Whether clients use the agent stream: yes unless :data:`STREAM_ENV` says no."""
    return environ.get(STREAM_ENV, "").strip().lower() not in _OFF


class NoStream(MasterError):
    """The master at this address has no stream (it answered the upgrade 404): use plain HTTP."""


class MasterStreams:
    """One stream per master address of ``addresses`` (indexes into that list)."""

    def __init__(self, addresses: list[str], headers: dict[str, str], tls: ssl.SSLContext | None) -> None:
        self.addresses = addresses
        self._headers = headers
        self._tls = tls
        self._lock = threading.Lock()  # the table of streams and of masters without one
        self._streams: dict[int, StreamConnection] = {}
        self._without: set[int] = set()  # addresses whose master answered the upgrade 404
        # One opener per address: the threads that need a stream at once wait for it, none opens a second.
        self._openers = [threading.Lock() for _ in addresses]
        self._warmed: dict[int, float] = {}  # address -> when warm_others last tried to open its stream
        self._closes = 0  # calls of close(), so that a stream warmed meanwhile is not left open

    def offered(self, index: int) -> bool:
        """False when the master at ``index`` is known to have no stream."""
        return index not in self._without

    def call(
        self,
        index: int,
        op: str,
        *,
        timeout: float,
        wait: float = 0.0,
        secret: str | None = None,
        query: dict[str, Any] | None = None,
        body_json: str | None = None,
    ) -> tuple[int, Any]:
        """``op`` on the stream to ``addresses[index]``, opened first if need be: ``(status, body)``.

        ``timeout`` bounds opening (connect: at most 3 s) and the reply, which may take ``wait`` more (a
        long-poll). An upgrade the master refuses (401, 409, 429, 503) comes back as that status and its body
        (bytes); raises :class:`NoStream` (use HTTP) for other answers, or a
        :class:`elastic.control.stream_client.StreamError` (transport)."""
        try:
            stream = self._stream(index, timeout)
        except StreamRefused as exc:  # 401, 409 wrong_job, 429, 503 not_leader or busy: the call's answer
            return exc.status, exc.body
        return stream.call(op, timeout=timeout + wait, secret=secret, query=query, body_json=body_json)

    def _stream(self, index: int, timeout: float) -> StreamConnection:
        with self._lock:
            stream = self._streams.get(index)
        if stream is not None and not stream.closed:
            return stream
        opener = self._openers[index]
        if not opener.acquire(timeout=timeout):  # another thread is still opening it: this call's time is up
            raise StreamTimeout(f"the stream to the master at {self.addresses[index]} is still opening")
        try:
            with self._lock:
                stream = self._streams.pop(index, None)
            if stream is not None:
                if not stream.closed:
                    with self._lock:
                        self._streams[index] = stream
                    return stream
                stream.close()  # over: its reader has ended; joined here
            address = self.addresses[index]
            try:
                stream = StreamConnection.open(address, self._headers, tls=self._tls, timeout=timeout)
            except StreamRefused as exc:
                if exc.status in _NO_STREAM:
                    why = f"HTTP {exc.status}"
                    log.info("the master at %s offers no agent stream (%s): plain HTTP", address, why)
                    with self._lock:
                        self._without.add(index)
                    raise NoStream(address) from None
                if exc.status not in _REFUSALS:  # not the master's answer: a proxy's, say; HTTP this time
                    raise NoStream(address) from None
                raise
            with self._lock:
                self._streams[index] = stream
            return stream
        finally:
            opener.release()

    def stream_lacking_again(self, index: int) -> None:
        """A plain request to ``index`` failed (a restart breaks one): ask for the stream again next time."""
        with self._lock:
            self._without.discard(index)

    def drop(self, index: int) -> None:
        """Close the stream to ``addresses[index]``."""
        with self._lock:
            stream = self._streams.pop(index, None)
        if stream is not None:
            stream.close()

    def warm_others(self, index: int, timeout: float) -> None:
        """The master at ``index`` answered (it leads): make sure a stream is open to every other address,
        in the background, so that when this one fails its successor is one frame away, not a connection
        and an upgrade behind 10,000 others. An address is tried at most every :data:`WARM_RETRY_S`."""
        now = time.monotonic()
        with self._lock:
            todo = [
                i
                for i in range(len(self.addresses))
                if i != index
                and i not in self._without
                and (i not in self._streams or self._streams[i].closed)
                and now - self._warmed.get(i, float("-inf")) >= WARM_RETRY_S
            ]
            for i in todo:
                self._warmed[i] = now
        for i in todo:
            threading.Thread(target=self._warm, args=(i, timeout), name="stream-warm", daemon=True).start()

    def _warm(self, index: int, timeout: float) -> None:
        closes = self._closes
        try:
            self._stream(index, timeout)
        except (MasterError, OSError) as exc:  # a refusal (at its cap, an older standby), no answer: later
            log.debug("no standby stream to %s yet: %s", self.addresses[index], exc)
            return
        if self._closes != closes:  # the client closed its streams meanwhile: this one goes too
            self.drop(index)

    def open_count(self) -> int:
        """How many streams are open now."""
        with self._lock:
            return sum(not stream.closed for stream in self._streams.values())

    def close(self) -> None:
        """Close every stream (their pending calls fail); a later call opens a new one."""
        with self._lock:
            self._closes += 1
            streams, self._streams = list(self._streams.values()), {}
        for stream in streams:
            stream.close()
