"""The job's status page (``GET /ui``): nodes, the round and why it waits, goodput, recent events; it
refreshes itself by fetching ``/ui/status`` (the ``/v1/status`` JSON) every second.

Access is behind the job's token, without putting the token in a URL or giving it to the page's script:

* ``GET /ui/login`` serves a form with a CSRF token, also set as an HttpOnly, SameSite=Strict cookie;
  ``POST /ui/login`` accepts the job token when both CSRF values match (a cross-site form carries no
  SameSite=Strict cookie), and sets the session cookie. Wrong tokens count against the address as on
  ``/v1`` (master.http.gatekeeper.check_token): after as many, the form answers 429 until the window passed.
* The session cookie (``elastic_ui_session``: HttpOnly, SameSite=Strict, ``Path=/ui``, Secure under TLS)
  is an expiry time signed with a key derived from the job token (HMAC-SHA256): every master of the job
  (standbys too) accepts it, and a new token invalidates every session (a rotated ``--token-file`` too, as
  soon as the master sees the change: the key follows the current token).
* The cookie authorizes the ``/ui`` routes only. The node and script API under ``/v1`` keeps requiring
  the bearer token (:class:`master.http.gatekeeper.Gatekeeper` is unchanged): a browser session cannot join,
  heartbeat or leave.
* Pages carry no job data: the script fills them in with ``textContent`` (never ``innerHTML``), under a
  strict Content-Security-Policy (scripts and styles from this origin only, no inline code), with
  ``X-Content-Type-Options: nosniff``, ``X-Frame-Options: DENY`` and no caching.
"""

from __future__ import annotations

import hashlib
import hmac
import html
import secrets
import time
from collections.abc import Callable
from importlib import resources
from urllib.parse import parse_qs

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, RedirectResponse, Response

from elastic.control.auth import derived_token
from elastic.control.error_table import ErrorCode
from elastic.control.listener_rules import UNAUTHENTICATED
from elastic.control.protocol import ErrorBody, JobStatus
from master.http.conn_guard import mark_authenticated
from master.http.gatekeeper import check_token
from master.http.rate_limits import PeerFailureLimiter

UI_PREFIX = "/ui"
SESSION_COOKIE = "elastic_ui_session"
CSRF_COOKIE = "elastic_ui_csrf"
#: How long a login lasts.
SESSION_TTL_S = 8 * 3600.0
#: The login form is a token and a CSRF value: a larger body is refused before it is parsed.
LOGIN_BODY_MAX = 4096
#: A session's expiry (Unix seconds) has 10 digits until 2286; a cookie with more is no session.
_EXPIRY_DIGITS = 20

SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
    "img-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'",
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}


def _asset(name: str) -> str:
    return (resources.files("master.http") / "ui_assets" / name).read_text(encoding="utf-8")


class Sessions:
    """Signed, expiring session values for one job (stateless: any master with the token checks them)."""

    def __init__(self, token: str | Callable[[], str], job_id: str, clock=time.time) -> None:
        """``token``: the job token, or what returns the current one (a rotated token re-keys sessions)."""
        self._token = token if callable(token) else (lambda: token)
        self._keyed: tuple[str, bytes] | None = None  # (token, the key derived from it)
        self._job_id = job_id
        self._clock = clock

    def issue(self) -> str:
        expires = int(self._clock() + SESSION_TTL_S)
        return f"{expires}.{self._mac(expires)}"

    def valid(self, value: str | None) -> bool:
        # A cookie is any bytes a client sends (decoded as latin-1): only ASCII digits of a sane length are
        # an expiry (str.isdigit() accepts '²', which int() refuses; int() refuses over 4,300 digits), and
        # the MACs are compared as bytes (hmac.compare_digest refuses non-ASCII str). Anything else is no
        # session, never an error (bench/fuzz_wire.py found the 500s).
        expires_text, _, mac = (value or "").partition(".")
        if not (expires_text.isascii() and expires_text.isdigit() and len(expires_text) <= _EXPIRY_DIGITS):
            return False
        expires = int(expires_text)
        if not hmac.compare_digest(mac.encode("utf-8", "replace"), self._mac(expires).encode()):
            return False
        return expires > self._clock()

    def _key(self) -> bytes:
        token = self._token()
        if self._keyed is None or self._keyed[0] != token:
            key = hmac.new(token.encode(), b"elastic-run status page session", hashlib.sha256).digest()
            self._keyed = (token, key)
        return self._keyed[1]

    def _mac(self, expires: int) -> str:
        return hmac.new(self._key(), f"{self._job_id}|{expires}".encode(), hashlib.sha256).hexdigest()


def _unauthorized() -> Response:
    body = ErrorBody(error=ErrorCode.UNAUTHORIZED, message="log in at /ui/login").model_dump()
    return JSONResponse(status_code=401, content=body)


def _is_ui(path: str) -> bool:
    return path == UI_PREFIX or path.startswith(UI_PREFIX + "/")


class SecurityHeaders:
    """ASGI middleware: every /ui response (errors included) carries :data:`SECURITY_HEADERS`. A plain
    ASGI wrapper, not Starlette's BaseHTTPMiddleware, and other paths pass straight through: the node
    API's long-polls see their client's disconnect, and heartbeats pay nothing."""

    def __init__(self, app) -> None:
        self.app = app
        self._headers = [(k.lower().encode(), v.encode()) for k, v in SECURITY_HEADERS.items()]

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not _is_ui(scope["path"]):
            return await self.app(scope, receive, send)

        async def send_secured(message):
            if message["type"] == "http.response.start":
                names = {k for k, _ in self._headers}
                kept = [(k, v) for k, v in message.get("headers", []) if k.lower() not in names]
                message = {**message, "headers": kept + self._headers}
            await send(message)

        return await self.app(scope, receive, send_secured)


def install_ui(app: FastAPI, service, failures: PeerFailureLimiter) -> None:
    """Add the status page's routes to ``app`` (the master of ``service``, a :class:`MasterService`);
    ``failures``: the gate's count of wrong tokens per address, which the login form shares."""
    app.add_middleware(SecurityHeaders)
    settings = service.settings
    sessions = Sessions(lambda: service.tokens.current, settings.job.job_id)
    secure = bool(settings.tls_cert)  # a Secure cookie is never sent over plain http
    page, login_page = _asset("page.html"), _asset("login.html")
    # A job without a token (torchrun's c10d spelling, docs/security.md) says so on its page, as on its
    # start line and in `elastic-master status`: anyone who reaches the master controls the job.
    unauthenticated = settings.token == derived_token(settings.job.job_id)
    notice = (
        f'<p id="auth" class="error" role="note">auth: {html.escape(UNAUTHENTICATED)}: anyone who reaches '
        "the master controls the job (docs/security.md)</p>"
    )
    page = page.replace("{auth_notice}", notice if unauthenticated else "")
    static = {
        "app.js": (_asset("app.js"), "text/javascript; charset=utf-8"),
        "app.css": (_asset("app.css"), "text/css; charset=utf-8"),
    }

    def signed_in(request: Request) -> bool:
        if sessions.valid(request.cookies.get(SESSION_COOKIE)):
            mark_authenticated(request.scope)  # a signed-in page's connection is not evicted first
            return True
        return False

    def login_form(message: str = "", status: int = 200) -> Response:
        csrf = secrets.token_urlsafe(32)
        text = login_page.replace("{message}", html.escape(message)).replace("{csrf}", html.escape(csrf))
        response = Response(text, status_code=status, media_type="text/html")
        response.set_cookie(
            CSRF_COOKIE, csrf, httponly=True, samesite="strict", secure=secure, path=f"{UI_PREFIX}/login"
        )
        return response

    @app.get(UI_PREFIX, tags=["status page"], response_class=Response)
    async def ui_page(request: Request) -> Response:
        """The status page (HTML without job data), or a redirect to the login form."""
        if not signed_in(request):
            return RedirectResponse(f"{UI_PREFIX}/login", status_code=303)
        return Response(page, media_type="text/html")

    @app.get(f"{UI_PREFIX}/login", tags=["status page"], response_class=Response)
    async def ui_login_form() -> Response:
        """The login form (asks for the job token)."""
        return login_form()

    @app.post(f"{UI_PREFIX}/login", tags=["status page"], response_class=Response)
    async def ui_login(request: Request) -> Response:
        """Form POST of ``token`` and ``csrf``: sets the session cookie and redirects to the page."""
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > LOGIN_BODY_MAX:
                return Response("form too large", status_code=413, media_type="text/plain")
        try:
            form = parse_qs(body.decode("utf-8", errors="replace"), max_num_fields=4)
        except ValueError:  # more fields than the form has (parse_qs raises): refused like a too large form
            return Response("form too large", status_code=413, media_type="text/plain")
        sent_csrf = (form.get("csrf") or [""])[0]
        cookie_csrf = request.cookies.get(CSRF_COOKIE, "")
        if not cookie_csrf or not hmac.compare_digest(sent_csrf.encode(), cookie_csrf.encode()):
            return login_form("The form expired or came from another site; log in again.", 403)
        token = (form.get("token") or [""])[0].strip()
        peer = request.client.host if request.client is not None else ""
        refusal = check_token(token.encode(), peer, service.tokens, failures)
        if refusal is not None:
            if refusal.status != 401:  # 429: too many wrong tokens from this address lately
                why = "Too many wrong tokens from this address; wait and retry."
                limited = login_form(why, refusal.status)
                for name, value in refusal.headers:
                    limited.headers[name.decode()] = value.decode()
                return limited
            return login_form("Wrong token.", 401)
        mark_authenticated(request.scope)
        response = RedirectResponse(UI_PREFIX, status_code=303)
        response.set_cookie(
            SESSION_COOKIE,
            sessions.issue(),
            max_age=int(SESSION_TTL_S),
            httponly=True,
            samesite="strict",
            secure=secure,
            path=UI_PREFIX,
        )
        response.delete_cookie(CSRF_COOKIE, path=f"{UI_PREFIX}/login")
        return response

    @app.get(f"{UI_PREFIX}/status", tags=["status page"], response_model=JobStatus)
    async def ui_status(request: Request) -> Response:
        """``/v1/status`` for a signed-in page (401 without a valid session cookie)."""
        if not signed_in(request):
            return _unauthorized()
        status = service.leading_job().status(service.clock())
        return Response(status.model_dump_json(), media_type="application/json")

    @app.get(UI_PREFIX + "/{name}", tags=["status page"], response_class=Response)
    async def ui_static(name: str) -> Response:
        """The page's script and style sheet (no job data: served without a session)."""
        if name not in static:
            return Response("not found", status_code=404, media_type="text/plain")
        text, media_type = static[name]
        return Response(text, media_type=media_type)
