"""Authentication when ``GRADWATCH_AUTH=on``: project tokens for the API, a session cookie for the dashboard.

- API (``/api/...`` except ``/api/health``): ``Authorization: Bearer <token>``
  (or the dashboard's session cookie). The token's project is put in the
  ASGI scope; routes limit reads to it and ingest refuses other projects.
- Dashboard (everything else): a signed session cookie set by ``POST /login``
  (the user pastes a project token); requests without one are redirected to
  ``/login`` (Dash's own JSON endpoints get 401). ``/logout`` clears it. The
  cookie names the token it was made with and ends when that token is
  deleted (within the token cache's few seconds).
- Writes made with the cookie (any method but GET / HEAD / OPTIONS) and
  ``POST /login`` must come from the server's own origin: their ``Origin``
  (or, without one, ``Referer``) must name this host and port. A page served
  from another port of the same host is same-site for the browser, so the
  cookie's ``SameSite=Lax`` alone lets it post with the victim's session.

Tokens are looked up by SHA-256 (server/access/tokens.py) and cached briefly.
The cookie is ``<base64 project>.<token id>.<expiry>.<HMAC-SHA256>`` keyed by
``GRADWATCH_SESSION_SECRET`` when it is set or, without it, by a random key
kept in the database (table ``server_secrets``), created by the first replica
that needs it: every replica of one database signs and checks with the same
key, so nothing has to be configured for several replicas to agree.
"""
from __future__ import annotations

import base64
import hashlib
import hmac
import html
import logging
import secrets
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Optional
from urllib.parse import parse_qs, quote, urlsplit

from anyio import to_thread
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, RedirectResponse

from gradwatch.server.operations.settings import Settings
from gradwatch.server.access.tokens import lookup_token, token_project, touch_token

log = logging.getLogger("gradwatch.auth")

COOKIE = "gw_session"
SESSION_SECONDS = 7 * 24 * 3600
SCOPE_KEY = "gradwatch.project"
_OPEN_PATHS = ("/api/health", "/login", "/logout", "/metrics", "/favicon.ico")


def load_session_secret(settings: Settings, sessionmaker) -> bytes:
    """The cookie key: ``GRADWATCH_SESSION_SECRET``, else the database's shared one (made on first use)."""
    if settings.session_secret:
        return settings.session_secret.encode()
    from sqlalchemy.exc import IntegrityError

    from gradwatch.server.storage.models import ServerSecret

    with sessionmaker() as session:
        row = session.get(ServerSecret, "session")
        if row is not None:
            return row.value.encode()
        session.add(ServerSecret(name="session", value=secrets.token_hex(32), created_at=time.time()))
        try:
            session.commit()
        except IntegrityError:   # another replica made it first: use theirs
            session.rollback()
    with sessionmaker() as session:
        return session.get(ServerSecret, "session").value.encode()


class Auth:
    """Token checks with a short cache; cookie signing."""

    def __init__(self, sessionmaker, secret, *, cache_seconds: float = 5.0):
        """``secret``: the cookie key, or a callable returning it (read on first use, after the
        lifespan has checked the schema)."""
        self._sessionmaker = sessionmaker
        self._secret_source = secret
        self._secret_value: Optional[bytes] = secret if isinstance(secret, bytes) else None
        self._cache: dict[str, tuple[Optional[str], float]] = {}
        self._lock = threading.Lock()
        self._cache_seconds = cache_seconds
        self._toucher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gradwatch-token-touch")

    @property
    def _secret(self) -> bytes:
        if self._secret_value is None:
            with self._lock:
                if self._secret_value is None:
                    self._secret_value = self._secret_source()
        return self._secret_value

    # -- tokens
    def identify(self, token: str) -> Optional[tuple[str, int]]:
        """(project, token id) of a token, or None for an unknown one."""
        key = hashlib.sha256(token.encode()).hexdigest()
        hit = self._cached(key)
        if hit is not None:
            return hit[0]
        with self._sessionmaker() as session:
            use = lookup_token(session, token=token)
        if use is not None and use.needs_touch:
            # recorded off the request path: on SQLite the write may wait for an ingest transaction
            self._toucher.submit(self._touch, use.token_id)
        return self._remember(key, (use.project, use.token_id) if use else None)

    def project_for(self, token: str) -> Optional[str]:
        found = self.identify(token)
        return found[0] if found else None

    def token_alive(self, token_id: int, project: str) -> bool:
        """Whether the token a session was made with still exists for that project."""
        key = f"id:{token_id}"
        hit = self._cached(key)
        if hit is None:
            with self._sessionmaker() as session:
                hit = (self._remember(key, token_project(session, token_id=token_id)),)
        return hit[0] == project

    def _cached(self, key: str):
        with self._lock:
            hit = self._cache.get(key)
        return (hit[0],) if hit and hit[1] > time.monotonic() else None

    def _remember(self, key: str, value):
        with self._lock:
            if len(self._cache) > 10_000:
                self._cache.clear()
            self._cache[key] = (value, time.monotonic() + self._cache_seconds)
        return value

    def _touch(self, token_id: int) -> None:
        try:
            with self._sessionmaker() as session:
                touch_token(session, token_id=token_id)
                session.commit()
        except Exception:  # noqa: BLE001 - bookkeeping only; the token check already answered
            log.debug("could not record the use of token %s", token_id, exc_info=True)

    # -- cookies
    def sign(self, project: str, token_id: int, *, now: Optional[float] = None) -> str:
        expiry = int((now or time.time()) + SESSION_SECONDS)
        p64 = base64.urlsafe_b64encode(project.encode()).decode().rstrip("=")
        payload = f"{p64}.{int(token_id)}.{expiry}"
        mac = hmac.new(self._secret, payload.encode(), hashlib.sha256).hexdigest()
        return f"{payload}.{mac}"

    def verify(self, cookie: str) -> Optional[tuple[str, int]]:
        """(project, token id) of a well-signed, unexpired cookie (a cookie of the older, token-less form
        is not: its holder signs in again)."""
        try:
            p64, token_id, expiry, mac = cookie.strip('"').split(".")
            want = hmac.new(self._secret, f"{p64}.{token_id}.{expiry}".encode(), hashlib.sha256).hexdigest()
            if not hmac.compare_digest(mac, want) or int(expiry) < time.time():
                return None
            return base64.urlsafe_b64decode((p64 + "=" * (-len(p64) % 4)).encode()).decode(), int(token_id)
        except (ValueError, UnicodeDecodeError):
            return None


def _bearer(headers: dict[bytes, bytes]) -> Optional[str]:
    value = headers.get(b"authorization", b"").decode("latin-1")
    if value[:7].lower() == "bearer ":
        return value[7:].strip() or None
    token = headers.get(b"x-gradwatch-token", b"").decode("latin-1").strip()
    return token or None


def _cookie(headers: dict[bytes, bytes]) -> Optional[str]:
    raw = headers.get(b"cookie", b"").decode("latin-1")
    for part in raw.split(";"):
        k, _, v = part.strip().partition("=")
        if k == COOKIE:
            return v
    return None


class AuthMiddleware:
    """Pure ASGI middleware: runs before the routers and before the Dash mount."""

    def __init__(self, app, auth: Auth):
        self.app = app
        self.auth = auth

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        if path in _OPEN_PATHS:
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        project = None
        token = _bearer(headers)
        if token:
            project = await to_thread.run_sync(self.auth.project_for, token)
        if project is None:
            cookie = _cookie(headers)
            session = self.auth.verify(cookie) if cookie else None
            if session is not None and await to_thread.run_sync(self.auth.token_alive, session[1], session[0]):
                if scope.get("method", "GET") not in _SAFE_METHODS and not same_origin(headers):
                    resp = JSONResponse({"detail": "cross-origin request refused: writes with the dashboard's "
                                                   "session must come from its own pages"}, status_code=403)
                    return await resp(scope, receive, send)
                project = session[0]
        if project is None:
            if path.startswith("/api/") or path.startswith("/_dash-"):
                detail = "invalid token" if token else "authentication required: send Authorization: Bearer <token>"
                resp = JSONResponse({"detail": detail}, status_code=401, headers={"WWW-Authenticate": "Bearer"})
            else:
                resp = RedirectResponse("/login?next=" + quote(path or "/"), status_code=303)
            return await resp(scope, receive, send)
        scope[SCOPE_KEY] = project
        return await self.app(scope, receive, send)


_SAFE_METHODS = ("GET", "HEAD", "OPTIONS")


def same_origin(headers: dict[bytes, bytes], *, missing_ok: bool = False) -> bool:
    """Whether the request's Origin (or, without one, Referer) names the host and port it was sent to.
    The scheme is not compared: behind a TLS proxy the page is https and the request reaches us as http.
    Browsers send an Origin with every POST; ``missing_ok`` admits a request with neither header (a
    script signing in, which no other page can make a browser do)."""
    host = headers.get(b"host", b"").decode("latin-1").strip().lower()
    source = headers.get(b"origin") or headers.get(b"referer")
    if not source:
        return missing_ok
    netloc = urlsplit(source.decode("latin-1").strip()).netloc.lower()
    return bool(host) and netloc == host


def project_of(request: Request) -> Optional[str]:
    return request.scope.get(SCOPE_KEY)


_LOGIN_PAGE = """<!doctype html><html><head><meta charset="utf-8"><title>gradwatch — sign in</title>
<style>body{{font-family:system-ui,sans-serif;background:#0f1115;color:#e6e6e6;display:flex;justify-content:center;
padding-top:12vh}}form{{background:#181b22;padding:2em;border-radius:8px;min-width:22em}}input{{width:100%;
padding:.5em;margin:.5em 0 1em;box-sizing:border-box}}button{{padding:.5em 1.5em}}.err{{color:#ff6b6b}}</style>
</head><body><form method="post" action="/login"><h2>gradwatch</h2>
<label for="token">Project token</label><input id="token" name="token" type="password" autofocus
placeholder="gw_…  (gradwatch token create --project NAME)">
<input type="hidden" name="next" value="{next}"><div class="err">{error}</div>
<button id="login-submit" type="submit">Sign in</button></form></body></html>"""


def _safe_next(value: str) -> str:
    return value if value.startswith("/") and not value.startswith("//") else "/"


def add_login_routes(app, auth: Auth) -> None:
    """``GET/POST /login`` and ``/logout`` (registered before the Dash mount)."""

    @app.get("/login", include_in_schema=False)
    async def login_form(next: str = "/"):  # noqa: A002 - query parameter name
        return HTMLResponse(_LOGIN_PAGE.format(next=html.escape(_safe_next(next)), error=""))

    @app.post("/login", include_in_schema=False)
    async def login(request: Request):
        if not same_origin(dict(request.scope.get("headers") or []), missing_ok=True):
            # login CSRF: another page signing the victim's browser in to the attacker's project
            return HTMLResponse(_LOGIN_PAGE.format(next="/", error="Sign in from this page."), status_code=403)
        body = (await request.body())[:10_000].decode(errors="replace")
        form = {k: v[0] for k, v in parse_qs(body).items()}
        nxt = _safe_next(form.get("next", "/"))
        token = form.get("token", "").strip()
        found = await to_thread.run_sync(auth.identify, token) if token else None
        if found is None:
            page = _LOGIN_PAGE.format(next=html.escape(nxt), error="Unknown token.")
            return HTMLResponse(page, status_code=401)
        resp = RedirectResponse(nxt, status_code=303)
        resp.set_cookie(COOKIE, auth.sign(*found), max_age=SESSION_SECONDS, httponly=True, samesite="lax")
        return resp

    @app.get("/logout", include_in_schema=False)
    async def logout():
        resp = RedirectResponse("/login", status_code=303)
        resp.delete_cookie(COOKIE)
        return resp
