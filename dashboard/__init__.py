"""gradwatch dashboard: a Dash multi-page app served by the API process.

``create_dash(sessionmaker, settings)`` builds the app; ``server/app.py``
mounts its WSGI server at ``/`` (via a2wsgi), so the API and the dashboard
share one port. Pages (one module each under ``dashboard/pages``):

- ``/``            runs: every run with status, health and last values; live
- ``/runs/<id>``   one run: every signal, per-layer heatmaps, alerts; live
- ``/compare``     several runs overlaid on the same panels
- ``/incidents/<alert_id>``  one incident: precursor timeline, charts around it, its alerts, rollback point
- ``/alerts``      alerts across runs, filtered by severity / rule / status
- ``/settings``    webhook endpoints and per-project rule thresholds

Data comes only through :mod:`dashboard.gateway` (``server.queries`` and the
rules / webhooks modules); figures are built by :mod:`dashboard.figures`.
"""
from __future__ import annotations

# One module, one name: this folder is installed as gradwatch.dashboard (pyproject.toml maps it at build
# time). Imported as a top-level `dashboard` -- a checkout's root on sys.path -- every module
# would load a second time beside gradwatch.dashboard's, with its own state; refuse instead.
if __name__ != "gradwatch.dashboard":
    raise ImportError(f"{__path__[0]} is gradwatch's dashboard package: import it as `gradwatch.dashboard`, "
                      f"not as {__name__!r} (that name is left to your own code)")

import re
from typing import Any

# Vendored plotly.js bundles in assets/ (see assets/gradwatch.js): loaded by dcc.Graph on demand,
# never as a page script tag; their names carry their version, so a browser may keep them for a year.
PLOTLY_BUNDLE = re.compile(r"^plotly-.*\.min\.js$")

# Dash moves callbacks declared with ``dash.callback`` into the first app that
# starts serving and forgets them. The page modules declare theirs at import
# time, once per process; keeping a copy lets every app built by create_dash
# (one per create_app call, e.g. several in one test process) get all of them.
_page_callbacks: dict[str, Any] = {}
_page_callback_list: list[dict] = []


def _import_pages() -> None:
    from dash import _callback

    from gradwatch.agent import plugins

    if _page_callbacks:
        return
    # The one plug-in loader (agent/plugins.py, as for collectors and rules): every module of the pages
    # package, each registering itself (dash.register_page, with its order) when imported.
    plugins.modules(f"{__name__}.pages")
    _page_callbacks.update(_callback.GLOBAL_CALLBACK_MAP)
    _page_callback_list.extend(_callback.GLOBAL_CALLBACK_LIST)
    _callback.GLOBAL_CALLBACK_MAP.clear()
    _callback.GLOBAL_CALLBACK_LIST.clear()


def create_dash(sessionmaker, settings, *, deliveries_queued=None, live_news=None, write_sessionmaker=None,
                write_gate=None):
    """The dashboard app, reading through ``sessionmaker``; mount ``app.server`` at "/".

    ``write_sessionmaker`` / ``write_gate``: the server's ingest write sessions and gate, which a run's
    delete takes for each of its bounded transactions (server/lifecycle/delete.py).

    ``deliveries_queued``: called (from any thread) after the dashboard queues a webhook delivery.
    ``live_news``: the server's :class:`~gradwatch.server.ingest.live_news.LiveNews` (None: run pages poll).
    """
    import dash
    from dash import dcc, html
    from flask import Flask, request

    from gradwatch.dashboard import gateway

    gateway.configure(sessionmaker, settings, deliveries_queued=deliveries_queued, live_news=live_news,
                      write_sessionmaker=write_sessionmaker, write_gate=write_gate)
    # Our own Flask app, told its instance folder (never used): left to find it, Flask walks the
    # top-level package's search path, and `gradwatch` is a namespace package whose editable-install
    # path holds no folder it can match (StopIteration: the dashboard would not load).
    import os

    flask_app = Flask(__name__, instance_path=os.path.join(os.path.dirname(os.path.abspath(__file__)), "instance"))
    app = dash.Dash(
        __name__,
        server=flask_app,
        use_pages=True,
        pages_folder="",
        requests_pathname_prefix="/",
        routes_pathname_prefix="/",
        title="gradwatch",
        update_title=None,
        suppress_callback_exceptions=True,
        assets_ignore=PLOTLY_BUNDLE.pattern,
    )

    @app.server.after_request
    def _cache_plotly_bundle(response):
        if response.status_code == 200 and PLOTLY_BUNDLE.match(request.path.rsplit("/", 1)[-1]):
            response.cache_control.public = True
            response.cache_control.max_age = 31536000
            response.cache_control.immutable = True
            response.cache_control.no_cache = None
        return response

    _import_pages()
    app.callback_map.update(_page_callbacks)
    app._callback_list.extend(_page_callback_list)  # noqa: SLF001 - see _page_callbacks

    # The header links: every page with a fixed path, in its declared order (a path_template page, such
    # as a run's, is reached from another page), so a new page adds its own link.
    nav = [dcc.Link(page["name"], href=page["path"], className="gw-nav-link",
                    id=f"nav-{page['module'].rsplit('.', 1)[-1]}")
           for page in dash.page_registry.values() if page.get("path_template") is None]

    def shell():
        """The frame around every page; a function so that it can name the signed-in project."""
        right = []
        if getattr(settings, "auth", False):
            # /login and /logout are server routes (server/access/auth.py) in front of the Dash mount.
            project = gateway.signed_in_project()
            right = [html.Span(f"project {project}" if project else "", className="gw-muted", id="nav-project"),
                     html.A("log out", href="/logout", className="gw-nav-link", id="nav-logout")]
        return html.Div([
            html.Header([
                dcc.Link([html.Span("●", className="gw-logo-dot"), "gradwatch"], href="/", className="gw-brand"),
                html.Nav(nav, className="gw-nav"),
                html.Div(right, className="gw-nav-right"),
            ], className="gw-header"),
            html.Main(dash.page_container, className="gw-main"),
        ], className="gw-app")

    app.layout = shell
    return app
