"""The probe behind ``python -m gradwatch.server.healthcheck [--url URL]`` (server/healthcheck.py): exit 0 when the API *and* the dashboard answer.

The image's ``HEALTHCHECK`` and the compose file's health checks run this. A
load balancer can keep probing ``GET /api/health`` alone; this also catches a
server whose dashboard failed to load (the API then keeps serving and the
dashboard's paths answer 503, see ``server/app.py``).

Checks, sharing one short time budget (``--timeout``, default 5 s):

1. ``GET /api/health`` answers 200 with ``{"status": "ok"}`` (the database answered);
2. the dashboard's page: Dash's HTML (its ``react-entry-point`` and ``_dash-config``);
3. ``GET /_dash-layout``: Dash's layout JSON (the layout function ran).

With ``GRADWATCH_AUTH=on`` the dashboard needs a login. With a project token in
``GRADWATCH_HEALTHCHECK_TOKEN`` it is sent as ``Authorization: Bearer`` and all
three are checked. Without one, the page is fetched at ``/favicon.ico``, the
one path the auth middleware leaves open that reaches the Dash mount (Dash's
catch-all serves its page there), and ``/_dash-layout`` must answer the auth
layer's 401: the Dash app is mounted and renders its page, but its layout
function is not run; the line printed on success says so.

Exit 0 with one line on stdout saying what was checked; otherwise exit 1 with
one line on stderr saying what failed. Standard library only and none of
gradwatch's own modules, so it starts in milliseconds and still reports a
server whose imports are broken.
"""
from __future__ import annotations

import argparse
import http.client
import json
import os
import sys
import time
import urllib.error
import urllib.request
from typing import Optional

DEFAULT_URL = "http://127.0.0.1:8470"
TOKEN_ENV = "GRADWATCH_HEALTHCHECK_TOKEN"
# Markers of Dash's index page (dash/dash.py's _default_index): the React mount point and its config.
DASH_PAGE_MARKERS = ('id="react-entry-point"', 'id="_dash-config"')


class Unhealthy(Exception):
    """One check failed; the message is the line printed."""


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    # A redirect is an answer to judge (auth's 303 to /login), not one to follow.
    def redirect_request(self, req, fp, code, msg, headers, newurl):
        return None


# No proxies: a container's HTTP_PROXY must not route a loopback probe elsewhere.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}), _NoRedirect())


class _Budget:
    def __init__(self, seconds: float, clock=time.monotonic):
        self._clock = clock
        self._deadline = clock() + seconds

    def left(self, what: str) -> float:
        left = self._deadline - self._clock()
        if left <= 0:
            raise Unhealthy(f"{what}: out of time (--timeout)")
        return left


def _get(url: str, budget: _Budget, what: str, headers: Optional[dict] = None) -> tuple[int, dict, bytes]:
    """(status, lower-cased headers, body) of a GET; any answer counts, no answer is Unhealthy."""
    req = urllib.request.Request(url, headers={"Accept": "*/*", **(headers or {})})
    try:
        try:
            resp = _OPENER.open(req, timeout=budget.left(what))
        except urllib.error.HTTPError as e:   # 4xx / 5xx / an unfollowed redirect: still an answer
            resp = e
        with resp:
            return resp.status, {k.lower(): v for k, v in (resp.headers or {}).items()}, resp.read()
    except (OSError, ValueError, http.client.HTTPException) as e:   # refused, reset, timed out, bad URL
        reason = getattr(e, "reason", None) or e
        raise Unhealthy(f"{what}: no answer from {url} ({reason})") from None


def _json(body: bytes, url: str, what: str):
    try:
        return json.loads(body)
    except ValueError:
        raise Unhealthy(f"{what}: {url} answered something that is not JSON: {body[:80]!r}") from None


def _excerpt(body: bytes) -> str:
    return body[:120].decode("utf-8", "replace").strip().replace("\n", " ")


def _check_page(url: str, budget: _Budget, headers: dict) -> None:
    status, _, body = _get(url, budget, "dashboard page", headers)
    if status != 200:
        raise Unhealthy(f"dashboard page: HTTP {status} from {url}: {_excerpt(body)}")
    text = body.decode("utf-8", "replace")
    missing = [m for m in DASH_PAGE_MARKERS if m not in text]
    if missing:
        raise Unhealthy(f"dashboard page: {url} is not Dash's page (no {missing[0]})")


def check(base_url: str, *, token: Optional[str] = None, timeout: float = 5.0) -> str:
    """Run the checks against ``base_url``; a summary of what passed, or ``Unhealthy``."""
    base = base_url.rstrip("/")
    budget = _Budget(timeout)

    url = base + "/api/health"
    status, _, body = _get(url, budget, "api")
    if status != 200:
        raise Unhealthy(f"api: HTTP {status} from {url}: {_excerpt(body)}")
    health = _json(body, url, "api")
    if not isinstance(health, dict) or health.get("status") != "ok":
        raise Unhealthy(f"api: {url} answered {health!r}, not status ok")
    done = [f"api ok ({health.get('database', '?')})"]

    auth = {"Authorization": f"Bearer {token}"} if token else {}
    url = base + "/"
    status, headers, body = _get(url, budget, "dashboard page", auth)
    behind_login = status in (302, 303, 307) and headers.get("location", "").startswith("/login")
    if behind_login and token:
        raise Unhealthy(f"dashboard page: {url} redirects to /login: the token in {TOKEN_ENV} was refused")
    if behind_login:
        _check_page(base + "/favicon.ico", budget, {})
        done.append("dashboard page ok (auth on: at /favicon.ico)")
    else:
        _check_page(url, budget, auth)
        done.append("dashboard page ok")

    url = base + "/_dash-layout"
    status, _, body = _get(url, budget, "dashboard layout", auth)
    if behind_login:
        if status != 401:
            raise Unhealthy(f"dashboard layout: HTTP {status} from {url}, expected auth's 401 without a login")
        done.append(f"layout behind login (set {TOKEN_ENV} to check it)")
        return ", ".join(done)
    if status == 401:
        raise Unhealthy(f"dashboard layout: HTTP 401 from {url}: "
                        + ("the token was refused" if token else f"auth is on; set {TOKEN_ENV}"))
    if status != 200:
        raise Unhealthy(f"dashboard layout: HTTP {status} from {url}: {_excerpt(body)}")
    layout = _json(body, url, "dashboard layout")
    if not (isinstance(layout, dict) and "props" in layout and "type" in layout):
        raise Unhealthy(f"dashboard layout: {url} answered JSON that is not a Dash component")
    done.append("layout ok")
    return ", ".join(done)


def main(argv: Optional[list[str]] = None, *, environ=os.environ) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m gradwatch.server.healthcheck",
        description="Exit 0 when the gradwatch server's API and dashboard answer, else 1 "
                    f"(one line on stderr). With auth on, a project token in {TOKEN_ENV} "
                    "lets it check the dashboard's layout too.")
    parser.add_argument("--url", default=DEFAULT_URL, help=f"the server's base URL (default {DEFAULT_URL})")
    parser.add_argument("--timeout", type=float, default=5.0,
                        help="seconds for all the checks together (default 5)")
    args = parser.parse_args(argv)
    try:
        summary = check(args.url, token=environ.get(TOKEN_ENV) or None, timeout=args.timeout)
    except Unhealthy as e:
        print(f"gradwatch unhealthy: {e}", file=sys.stderr)
        return 1
    print(f"gradwatch healthy: {summary}")
    return 0
