"""Client of the job master API, used by the agent and by ``elastic-master status``.

The agent's calls (info, join, round, heartbeat, watch, leave) go over one agent stream per master
address (elastic.control.stream_client, docs/protocol.md "The agent stream"), shared by every thread of the
client: heartbeats, the watch long-poll and the main loop run concurrently on one connection. A master
without the stream (an older release: 404 to the upgrade), ``ELASTIC_MASTER_STREAM=0``, and the
operator's calls (status, readmit) use plain HTTP, with one ``httpx.Client`` per thread. Several master
addresses may be given; the client sticks to the one that answered last and moves on to the next when
it is unreachable or answers that it is not the leader (503). It keeps an idle stream open to every
other master too, so that a takeover costs its agents one frame, not a reconnection each.

With a CA file (``tls_ca``) every address is spoken to over https and the master's certificate is verified
against that CA, host name included (``elastic.control.tls``). A TLS failure that retrying cannot fix (the
certificate does not verify; the master speaks the other protocol) raises :class:`MasterTLSError` as soon
as no other address answered, instead of counting as an unreachable master.

With a token file (``token_file``), a 401 is not final at once: the file is read again and, if it holds
another token (a rotated Kubernetes Secret), the call is retried with it; if that is refused too, with the
previous token (the master has not seen the rotation yet). Only when the file still holds the refused token
(or none) is the 401 the call's answer (elastic.control.token_source, docs/security.md "Rotating the
token"). ``ELASTIC_TOKEN`` cannot change: rotation needs a file.
"""

from __future__ import annotations

import json
import logging
import os
import random
import secrets
import threading
from collections.abc import Callable
from typing import Any, TypeVar
from urllib.parse import quote

import httpx
from pydantic import BaseModel, ValidationError

from elastic.control.addresses import parse_addresses, split_address
from elastic.control.error_table import (
    ErrorCode,
    MasterError,
    MasterRejectedError,
    MasterTLSError,
    MasterUnreachableError,
    NotAMasterError,
)
from elastic.control.protocol import (
    API_PREFIX,
    JOB_HEADER,
    NODE_SECRET_HEADER,
    PROTOCOL_HEADER,
    PROTOCOL_VERSION,
    CommandReply,
    HeartbeatRequest,
    JobInfo,
    JobStatus,
    JoinReply,
    JoinRequest,
    LeaveRequest,
    ReadmitReply,
    RoundReply,
)
from elastic.control.stream_client import (
    MasterStreams,
    NoStream,
    StreamError,
    StreamFrameTooLarge,
    StreamLost,
    stream_wanted,
)
from elastic.control.tls import client_context, describe_tls_failure, speaks_tls
from elastic.control.token_source import WatchedToken

__all__ = [
    "Backoff",
    "MasterClient",
    "MasterError",
    "MasterRejectedError",
    "MasterTLSError",
    "MasterUnreachableError",
    "NotAMasterError",
    "parse_addresses",
]

M = TypeVar("M", bound=BaseModel)

log = logging.getLogger(__name__)

#: Random bytes of the node secret a client names in its joins (as many as the master's own:
#: master.job.liveness.SECRET_BYTES).
NAMED_SECRET_BYTES = 32


class Backoff:
    """Delays between retries of a master call that got no answer: exponential from ``first`` up to
    ``cap``, each drawn at random from the upper half of the current step ("equal jitter"), so that the
    agents of many nodes that lost the same master do not retry in lockstep, and a master that just took
    over is not hit by every node at the same instant. ``Backoff(x, x)`` is a jittered period of at most x.
    """

    def __init__(self, first: float = 0.1, cap: float = 2.0) -> None:
        self.first, self.cap = first, max(first, cap)
        self._step = first

    def next(self) -> float:
        delay = self._step
        self._step = min(self.cap, self._step * 2)
        return delay * random.uniform(0.5, 1.0)

    def reset(self) -> None:
        self._step = self.first


class NoLeaderError(MasterUnreachableError):
    """No master at any address answered as the leader; :attr:`answers`: what each address answered
    (``503 not_leader``, ``no answer (ConnectTimeout)``...)."""

    def __init__(self, answers: dict[str, str]) -> None:
        self.answers = dict(answers)
        super().__init__(f"no job master leads: {describe_answers(answers)}")

    @property
    def only_standbys(self) -> bool:
        """Every address answered 503 not_leader: masters that are up and stand by while none leads (an
        election or a takeover under way), not absent ones."""
        standby = f"503 {ErrorCode.NOT_LEADER.value}"
        return bool(self.answers) and all(a == standby for a in self.answers.values())


class MasterClient:
    """Typed calls of the master's ``/v1`` API."""

    def __init__(
        self,
        addresses: list[str],
        job_id: str,
        token: str,
        *,
        request_timeout: float = 10.0,
        tls_ca: str | None = None,
        stream: bool | None = None,
        token_file: str | None = None,
    ) -> None:
        """``tls_ca``: CA file to verify the masters' certificates with; given, every address is https.
        Raises :class:`elastic.control.tls.TLSConfigError` when it cannot be used. ``stream``: whether the
        agent's
        calls use the agent stream (default: yes, unless ``ELASTIC_MASTER_STREAM=0``). ``token_file``: the
        file ``token`` was read from, read again after a 401 (a rotated token; see the module's doc)."""
        self.addresses = list(addresses)
        # One context for every thread's client: loading the CA file once, and SSLContext is thread-safe.
        self._tls = client_context(tls_ca) if tls_ca else None
        self._scheme = "https" if self._tls else "http"
        self.job_id = job_id
        # The protocol revision: a newer master then includes what this client knows
        # (master.http.wire_compat).
        self._headers = {
            "Authorization": f"Bearer {token}",
            JOB_HEADER: job_id,
            PROTOCOL_HEADER: str(PROTOCOL_VERSION),
        }
        # Node id -> the secret of the incarnation this client joined as: in memory only, never stored or
        # passed on (master.job.liveness); sent on every request for that node.
        self._secrets: dict[str, str] = {}
        # Node id -> the secret this client names in its joins until a join answered one: a join whose reply
        # is lost and that is then retried names the same secret, so the master takes the retry for the
        # rejoin of the incarnation the lost attempt started, not for a duplicate (master.job.liveness).
        self._named: dict[str, str] = {}
        #: Node id -> (round, term) of its newest assignment (see next_round).
        self._round_terms: dict[str, tuple[int, int]] = {}
        self._timeout = request_timeout
        # Grace 0: a client accepts no token, it only asks the file which one to send (token_source).
        self._token_source = WatchedToken(token, token_file, 0.0) if token_file else None
        self._token_lock = threading.Lock()  # guards _token_said
        self._token_said: str | None = None  # the token whose switch was logged last
        self._local = threading.local()
        self._preferred = 0
        if stream is None:
            stream = stream_wanted(os.environ)
        self._streams = MasterStreams(self.addresses, self._headers, self._tls) if stream else None

    def _http(self) -> httpx.Client:
        client = getattr(self._local, "client", None)
        if client is None:
            client = httpx.Client(headers=self._headers, trust_env=False, verify=self._tls or True)
            self._local.client = client
        return client

    def close(self) -> None:
        """Close the streams (their pending calls fail) and this thread's HTTP client; a later call
        opens what it needs again."""
        if self._streams is not None:
            self._streams.close()
        client = getattr(self._local, "client", None)
        if client is not None:
            client.close()
            self._local.client = None

    def _call(
        self,
        method: str,
        path: str,
        reply: type[M],
        *,
        op: str | None = None,
        body: BaseModel | None = None,
        params: dict | None = None,
        wait: float = 0.0,
        timeout: float | None = None,
        node_id: str | None = None,
        secret: str | None = None,
    ) -> M:
        # ``timeout`` (default: the client's) bounds each address's attempt, so that a master that
        # accepts connections but never answers (hung, partitioned, SIGSTOPped) costs only that long
        # before the next address is tried. ``op``: the call's name on the agent stream (None: HTTP only).
        timeout = self._timeout if timeout is None else timeout
        if secret is None and node_id is not None:  # ``secret``: the one a join names (the node's by default)
            secret = self._secrets.get(node_id)
        # Unset optional fields stay out: a master of an older release refuses fields it does not know (a
        # heartbeat's ``term``), and their absence means the default.
        content = body.model_dump_json(exclude_unset=True) if body is not None else None
        tls_failure: str | None = None
        answers: dict[str, str] = {}  # address -> what it answered, while none leads
        count = len(self.addresses)
        for i in range(count):
            index = (self._preferred + i) % count
            try:
                sent = self._headers["Authorization"]

                def exchange(index: int = index) -> tuple[int, Any]:
                    return self._exchange(
                        index, method, path, op, content, params, secret, timeout=timeout, wait=wait
                    )

                status, payload = exchange()
                if self._token_source is not None and _token_refused(status, payload):
                    status, payload = self._after_unauthorized(sent, status, payload, exchange)
            except (httpx.TransportError, StreamError) as exc:
                answers[self.addresses[index]] = f"no answer ({type(exc).__name__})"
                tls_failure = tls_failure or self._tls_failure(exc, self.addresses[index], timeout)
                continue
            if status == 503:  # a standby master (or one stepping down, or at its cap): try the next address
                answers[self.addresses[index]] = f"503 {_rejection(503, payload).code}"
                continue  # a stream to a standby stays open: it is the way in when that one leads
            self._preferred = index
            if self._streams is not None:
                self._streams.warm_others(index, timeout)  # it leads: keep a stream open to each standby
            if status >= 400:
                raise _rejection(status, payload)
            try:
                return _validated(reply, payload)
            except ValidationError as exc:
                raise MasterError(f"unexpected reply from master at {self.addresses[index]}: {exc}") from None
        if tls_failure is not None:
            raise MasterTLSError(tls_failure)
        raise NoLeaderError(answers)

    def _after_unauthorized(
        self, sent: str, status: int, payload: Any, again: Callable[[], tuple[int, Any]]
    ) -> tuple[int, Any]:
        """A 401 (or 429 ``unauthorized``) to the ``Authorization`` header ``sent``: try each token the token
        file suggests (:meth:`WatchedToken.alternatives`: the file's new token, then the previous one), once
        each, and keep the first one answered otherwise. Returns the answer to keep: the refusal when none
        helped."""
        # No lock held over a call: a long-poll retried here must not hold up another thread's heartbeat.
        # Threads that meet the 401 together may each try the alternatives; they try the same ones.
        source = self._token_source
        assert source is not None
        if self._headers["Authorization"] != sent:  # another thread switched meanwhile: try its choice
            sent = self._headers["Authorization"]
            status, payload = again()
            if not _token_refused(status, payload):
                return status, payload
        for token in source.alternatives(sent.removeprefix("Bearer ")):
            self._headers["Authorization"] = f"Bearer {token}"  # the streams open with these headers too
            status, payload = again()
            if not _token_refused(status, payload):
                with self._token_lock:
                    if self._token_said != token:  # one line per switch, not one per thread
                        self._token_said = token
                        which = "new" if token == source.current else "previous"
                        log.info(
                            "the master refused the job token; it accepts the %s token of %s: using it",
                            which,
                            source.path,
                        )
                return status, payload
        self._headers["Authorization"] = f"Bearer {source.current}"
        return status, payload

    def _exchange(
        self,
        index: int,
        method: str,
        path: str,
        op: str | None,
        content: str | None,
        params: dict | None,
        secret: str | None,
        *,
        timeout: float,
        wait: float,
    ) -> tuple[int, Any]:
        """One attempt at ``addresses[index]``: ``(status, body)``, the body decoded (a stream's reply) or
        bytes (HTTP). Raises a transport error (httpx's or the stream's)."""
        streams = self._streams
        if op is not None and streams is not None and streams.offered(index):
            try:
                return streams.call(
                    index, op, timeout=timeout, wait=wait, secret=secret, query=params, body_json=content
                )
            except (NoStream, StreamFrameTooLarge):
                pass  # a master without the stream, or a call over a frame's limit: plain HTTP
        headers = {"Content-Type": "application/json"} if content is not None else {}
        # The token of now (a rotation switches it), over the one the thread's client was made with.
        headers["Authorization"] = self._headers["Authorization"]
        if secret:
            headers[NODE_SECRET_HEADER] = secret
        try:
            response = self._http().request(
                method,
                f"{self._scheme}://{self.addresses[index]}{API_PREFIX}{path}",
                params=params,
                content=content,
                headers=headers,
                timeout=httpx.Timeout(timeout + wait, connect=min(timeout, 3.0)),
            )
        except httpx.TransportError:
            if streams is not None:
                streams.stream_lacking_again(index)  # the master there may be a newer one next time
            raise
        kind = response.headers.get("content-type", "")
        if "json" not in kind and response.status_code < 500:
            # Every answer of a master's /v1 API is JSON (its 5xx may not be: retried, as a proxy's would
            # be). A web page, or anything else, is another service at this address: most often a
            # mistyped --master, which retrying until --master-timeout would only hide.
            raise NotAMasterError(self.addresses[index], response.status_code, kind)
        return response.status_code, response.content

    def _tls_failure(self, exc: Exception, address: str, timeout: float) -> str | None:
        """A one-line error when ``exc`` is a TLS mismatch that retrying cannot fix, else None."""
        if self._tls is not None:
            return describe_tls_failure(exc, address)
        # Plain http to a TLS master: the master drops the connection without an answer. Only then, probe
        # for a TLS handshake, so that the agent says what is wrong instead of retrying until
        # --master-timeout as if the master were down. A dropped connection means a live host, so the
        # probe is quick; its bound keeps a heartbeat's turn to the next address short all the same.
        dropped = isinstance(exc, StreamLost) and exc.dropped
        if dropped or isinstance(exc, (httpx.RemoteProtocolError, httpx.ReadError)):
            host, port = split_address(address)
            if speaks_tls(host, port, min(timeout, 1.0)):
                return (
                    f"the master at {address} speaks TLS (https): pass --tls-ca CA_FILE (or set "
                    "ELASTIC_TLS_CA), the CA that signed the master's certificate"
                )
        return None

    def info(self) -> JobInfo:
        return self._call("GET", "/info", JobInfo, op="info")

    def join(self, req: JoinRequest) -> JoinReply:
        """Join as ``req.node_id``, with the secret held for it (a rejoin of the same incarnation), else the
        one this client names for it (a new incarnation takes it: retrying a join whose reply was lost is
        then that incarnation's rejoin). The reply's secret is held from now on (none once the job is
        over)."""
        secret = self._secrets.get(req.node_id) or self._named.setdefault(
            req.node_id, secrets.token_urlsafe(NAMED_SECRET_BYTES)
        )
        reply = self._call(
            "POST", "/join", JoinReply, op="join", body=req, node_id=req.node_id, secret=secret
        )
        if reply.node_secret:
            self._secrets[req.node_id] = reply.node_secret
        else:
            self._secrets.pop(req.node_id, None)
        return reply

    def has_joined(self, node_id: str) -> bool:
        """Whether this client holds a secret for ``node_id`` (a join gave one)."""
        return node_id in self._secrets

    def next_round(self, node_id: str, after: int, timeout: float) -> RoundReply:
        """The node's next assignment; its term is remembered, so that later heartbeats and watches for
        that round name the round as ``(term, number)`` (a master with terms answers "rejoin" to a round
        number of another leader's world)."""
        params = {"node_id": node_id, "after": after, "timeout": timeout}
        reply = self._call(
            "GET", "/round", RoundReply, op="round", params=params, wait=timeout, node_id=node_id
        )
        if reply.assignment is not None and reply.assignment.term:  # 0: a master without terms
            self._round_terms[node_id] = (reply.assignment.round, reply.assignment.term)
        return reply

    def _term_of(self, node_id: str, round_number: int) -> int | None:
        """The term of ``round_number`` as this node's assignment gave it; None when unknown."""
        held = self._round_terms.get(node_id)
        return held[1] if held is not None and held[0] == round_number else None

    def heartbeat(self, req: HeartbeatRequest, timeout: float | None = None) -> CommandReply:
        term = self._term_of(req.node_id, req.round)
        if term is not None and req.term is None:
            req = req.model_copy(update={"term": term})
        return self._call(
            "POST", "/heartbeat", CommandReply, op="heartbeat", body=req, timeout=timeout, node_id=req.node_id
        )

    def watch(self, node_id: str, round_number: int, timeout: float) -> CommandReply:
        params: dict = {"node_id": node_id, "round": round_number, "timeout": timeout}
        term = self._term_of(node_id, round_number)
        if term is not None:
            params["term"] = term
        return self._call(
            "GET", "/watch", CommandReply, op="watch", params=params, wait=timeout, node_id=node_id
        )

    def leave(self, req: LeaveRequest) -> CommandReply:
        return self._call("POST", "/leave", CommandReply, op="leave", body=req, node_id=req.node_id)

    def status(self) -> JobStatus:
        return self._call("GET", "/status", JobStatus)

    def readmit(self, node_id: str) -> ReadmitReply:
        """Lift ``node_id``'s exclusion for flapping (the operator's command)."""
        return self._call("POST", f"/nodes/{quote(node_id, safe='')}/readmit", ReadmitReply)


def describe_answers(answers: dict[str, str]) -> str:
    """``A: 503 not_leader; B: no answer (ConnectTimeout)``: what each master address answered."""
    return "; ".join(f"{address}: {answer}" for address, answer in answers.items())


def _text(payload: Any) -> str:
    """An answer's body as text, for messages (bytes of HTTP, or a stream reply's decoded body)."""
    if isinstance(payload, (bytes, bytearray)):
        return bytes(payload).decode("utf-8", errors="replace")
    return json.dumps(payload)


def _token_refused(status: int, payload: Any) -> bool:
    """Whether an answer refuses the bearer token: 401, or 429 ``unauthorized`` (too many wrong tokens
    from this address lately; a valid token is never refused so)."""
    return status == 401 or (status == 429 and _rejection(status, payload).code == ErrorCode.UNAUTHORIZED)


def _validated(reply: type[M], payload: Any) -> M:
    """The reply model of an answer's body: JSON bytes (HTTP) or the decoded body of a stream reply."""
    if isinstance(payload, (bytes, bytearray)):
        return reply.model_validate_json(payload)
    return reply.model_validate(payload)


def _rejection(status: int, payload: Any) -> MasterRejectedError:
    """The error of an answer with status ``status`` and an ErrorBody (or whatever came instead)."""
    data = payload
    if isinstance(payload, (bytes, bytearray)):
        try:
            data = json.loads(payload)
        except ValueError:
            return MasterRejectedError(status, "error", _text(payload)[:500])
    if not isinstance(data, dict):
        return MasterRejectedError(status, "error", _text(payload)[:500])
    code, message = str(data.get("error", "error")), str(data.get("message", _text(payload)))
    return MasterRejectedError(status, code, message)
