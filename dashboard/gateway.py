"""The dashboard's one door to the data: ``server.queries`` for reads, the rules
and webhooks modules for the few writes a user makes (acknowledge an alert,
add / test / delete a webhook endpoint, override a rule threshold).

Nothing in ``dashboard/`` opens a session or touches SQL anywhere else. Each
function opens one short session, calls one server function and returns plain
dicts and lists, so page callbacks never hold ORM objects past a session.
"""
from __future__ import annotations

import math
import time
from contextlib import contextmanager
from typing import Any, Iterator, Optional, Sequence

_sessionmaker = None
_settings = None
_deliveries_queued = None   # the server's "send due webhook deliveries now" (None: it polls every second)


def configure(sessionmaker, settings, *, deliveries_queued=None) -> None:
    """Called once by ``create_dash``: every later call reads through this sessionmaker."""
    global _sessionmaker, _settings, _deliveries_queued
    _sessionmaker = sessionmaker
    _settings = settings
    _deliveries_queued = deliveries_queued


def settings():
    return _settings


# --------------------------------------------------------------------------- who is looking

SCOPE_KEY = "gradwatch.project"  # server/auth.py puts the signed-in project in the ASGI scope


def signed_in_project() -> Optional[str]:
    """With auth on, the project of the session cookie (the dashboard shows only it); else None."""
    if not getattr(_settings, "auth", False):
        return None
    try:
        from flask import has_request_context, request
    except ImportError:  # pragma: no cover - Dash runs on Flask here
        return None
    if not has_request_context():
        return None
    scope = request.environ.get("asgi.scope") or {}
    return scope.get(SCOPE_KEY)


def _scoped(project: Optional[str]) -> Optional[str]:
    """The project filter to apply: the signed-in one when auth is on (a request for another sees nothing)."""
    mine = signed_in_project()
    if mine is None:
        return project or None
    return mine if not project or project == mine else "\x00no-such-project"


def _run_visible(session, run_id: int) -> bool:
    mine = signed_in_project()
    if mine is None:
        return True
    from server import queries
    return queries.run_project(session, run_id=run_id) == mine


@contextmanager
def _session(write: bool = False) -> Iterator[Any]:
    if _sessionmaker is None:
        raise RuntimeError("dashboard.gateway.configure(sessionmaker, settings) was not called")
    with _sessionmaker() as session:
        if write:
            # SQLite: take the write lock up front (BEGIN IMMEDIATE, see server/db.py) so a write
            # that reads first cannot fail half way while ingest is writing.
            session.connection(execution_options={"sqlite_immediate": True})
        try:
            yield session
            if write:
                session.commit()
        except Exception:
            session.rollback()
            raise


def _plain(obj: Any) -> Any:
    """ORM objects / pydantic models / dataclasses -> dicts (queries should already return dicts)."""
    if obj is None or isinstance(obj, (str, int, float, bool)):
        return obj
    if isinstance(obj, dict):
        return {k: _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    if hasattr(obj, "model_dump"):
        return obj.model_dump()
    if hasattr(obj, "__table__"):
        return {c.key: getattr(obj, c.key) for c in obj.__table__.columns}
    if hasattr(obj, "__dataclass_fields__"):
        return {k: _plain(getattr(obj, k)) for k in obj.__dataclass_fields__}
    return obj


def _unwrap(result: Any, key: str) -> list:
    result = _plain(result)
    if isinstance(result, dict):
        return list(result.get(key) or [])
    return list(result or [])


# --------------------------------------------------------------------------- reads

def _stall_seconds() -> float:
    return float(getattr(_settings, "stall_seconds", 300.0) or 300.0)


def _series(result: Any) -> dict:
    """A ``queries.Series`` as ``{"bucket_size", "steps": [bucket dicts]}`` (the read API's shape)."""
    points = getattr(result, "points", None)
    if points is not None:
        # Thousands of points per page: spelled out, this is ~10x cheaper than the generic _plain walk.
        return {"bucket_size": result.bucket_size or 1,
                "steps": [{"step": p.step, "min": p.min, "max": p.max, "last": p.last, "count": p.count,
                           "nonfinite": p.nonfinite} for p in points]}
    s = _plain(result) or {}
    return {"bucket_size": s.get("bucket_size", 1) or 1, "steps": list(s.get("points", s.get("steps")) or [])}


def list_runs(*, project: Optional[str] = None, status: Optional[str] = None, name: Optional[str] = None) -> list[dict]:
    from server import queries
    with _session() as s:
        return _unwrap(queries.list_runs(s, project=_scoped(project), status=status or None, name=name or None,
                                         stall_seconds=_stall_seconds()), "runs")


def get_run(run_id: int) -> Optional[dict]:
    from server import queries
    with _session() as s:
        if not _run_visible(s, run_id):
            return None
        return _plain(queries.get_run(s, run_id=run_id, stall_seconds=_stall_seconds()))


def _one_series(run_id: int, signal: str, start, end, max_points: int, since) -> dict:
    from server import queries
    with _session() as s:
        return _series(queries.get_series(s, run_id=run_id, signal=signal, start=start, end=end,
                                          max_points=max_points, since=since))


def get_series(run_id: int, signals: Sequence[str], *, start: Optional[float] = None, end: Optional[float] = None,
               max_points: int = 1000, since: Optional[int] = None) -> dict[str, dict]:
    """``{signal: {"bucket_size": n, "steps": [bucket, ...]}}`` for several signals of one run.

    ``start`` / ``end`` may be floats (a zoomed chart's range); ``since``
    returns the raw steps after that step (a live tail).

    A range (or the whole run) is one ``queries.get_series_multi`` call: the
    rollup partials, which hold every step signal, are read once for all the
    signals instead of once per signal (a 1M-step run: ~45 ms instead of
    ~200 ms for the run page's 12). Live tails are raw rows, read in
    parallel, one session per signal: the database does the work with the GIL
    released.
    """
    from server import queries

    start = None if start is None else max(0, int(math.floor(start)))
    end = None if end is None else int(math.ceil(end))
    if signed_in_project() is not None:
        with _session() as s:
            if not _run_visible(s, run_id):
                return {sig: {"bucket_size": 1, "steps": []} for sig in signals}
    if since is None:
        with _session() as s:
            out = queries.get_series_multi(s, run_ids=[run_id], signals=list(signals), start=start, end=end,
                                           max_points=max_points)
        return {sig: _series(one) for sig, one in zip(signals, out)}
    if len(signals) == 1:
        return {signals[0]: _one_series(run_id, signals[0], start, end, max_points, since)}
    futures = {sig: _pool().submit(_one_series, run_id, sig, start, end, max_points, since) for sig in signals}
    return {sig: f.result() for sig, f in futures.items()}


_executor = None


def _pool():
    global _executor
    if _executor is None:
        from concurrent.futures import ThreadPoolExecutor
        _executor = ThreadPoolExecutor(max_workers=4, thread_name_prefix="gradwatch-dash-read")
    return _executor


def get_layer_matrix(run_id: int, stat: str, *, start: Optional[float] = None, end: Optional[float] = None,
                     max_steps: int = 300, max_layers: int = 48) -> dict:
    """``{"steps": [...], "names": [...], "values": [[one per step] per layer], "layer_group_size": n}``."""
    from server import queries
    start = None if start is None else max(0, int(math.floor(start)))
    end = None if end is None else int(math.ceil(end))
    with _session() as s:
        if not _run_visible(s, run_id):
            return {"steps": [], "names": [], "values": []}
        m = _plain(queries.get_layer_matrix(s, run_id=run_id, stat=stat, start=start, end=end,
                                            max_steps=max_steps, max_layers=max_layers)) or {}
    return {"steps": list(m.get("steps") or []), "names": list(m.get("layers") or []),
            "values": list(m.get("values") or []), "layer_group_size": m.get("layer_group_size", 1),
            "bucket_size": m.get("bucket_size", 1)}


def list_alerts(*, run_id: Optional[int] = None, severity: Optional[str] = None, rule: Optional[str] = None,
                status: Optional[str] = None) -> list[dict]:
    from server import queries
    with _session() as s:
        return _unwrap(queries.list_alerts(s, run_id=run_id, severity=severity or None, rule=rule or None,
                                           status=status or None, project=_scoped(None)), "alerts")


def list_events(run_id: int, *, kind: Optional[str] = None) -> list[dict]:
    from server import queries
    with _session() as s:
        if not _run_visible(s, run_id):
            return []
        return _unwrap(queries.list_events(s, run_id=run_id, kind=kind), "events")


# --------------------------------------------------------------------------- writes

def acknowledge_alert(alert_id: int) -> None:
    from server import queries
    from server.rules import alerts
    with _session(write=True) as s:
        alert = queries.get_alert(s, alert_id=alert_id)
        if alert is None or not _run_visible(s, alert.run_id):
            raise LookupError(f"no alert {alert_id}")
        alerts.acknowledge_alert(s, alert_id=alert_id)


def list_endpoints(projects: Sequence[str] = ()) -> list[dict]:
    """Every webhook endpoint (with auth on: the signed-in project's and the server-wide ones);
    ``project`` is filled in for those of the given projects."""
    from server.webhooks import endpoints
    mine = signed_in_project()
    with _session() as s:
        names = {}
        for name in ([mine] if mine else projects):
            for ep in endpoints.list_endpoints(s, project=name):
                if ep.project_id is not None:
                    names[ep.id] = name
        shown = endpoints.list_endpoints(s, project=mine) if mine else endpoints.list_endpoints(s)
        return [endpoints.endpoint_to_dict(ep, names.get(ep.id)) for ep in shown]


def _own_endpoint(session, endpoint_id: int) -> None:
    mine = signed_in_project()
    if mine is None:
        return
    from server.webhooks import endpoints
    if endpoint_id not in {ep.id for ep in endpoints.list_endpoints(session, project=mine) if ep.project_id}:
        raise LookupError(f"no webhook endpoint {endpoint_id} in project {mine}")


def create_endpoint(*, url: str, project: str, format: str = "json", min_severity: str = "info",
                    secret: Optional[str] = None) -> dict:
    """Raises ``ValueError`` saying what is wrong with the URL, format, severity or secret."""
    from server.webhooks import endpoints
    project = _scoped(project)
    with _session(write=True) as s:
        ep = endpoints.create_endpoint(s, project=project, url=url, format=format, min_severity=min_severity,
                                       secret=secret or None)
        return endpoints.endpoint_to_dict(ep, project)


def delete_endpoint(endpoint_id: int) -> bool:
    from server.webhooks import endpoints
    with _session(write=True) as s:
        _own_endpoint(s, endpoint_id)
        return endpoints.delete_endpoint(s, endpoint_id=endpoint_id)


def send_test(endpoint_id: int) -> dict:
    """Queue a sample alert to one endpoint; the server's delivery worker sends it right away."""
    from server.webhooks import endpoints
    with _session(write=True) as s:
        _own_endpoint(s, endpoint_id)
        delivery = endpoints.delivery_to_dict(endpoints.send_test(s, endpoint_id=endpoint_id, settings=_settings,
                                                                  now=time.time()))
    if _deliveries_queued is not None:   # committed: wake the worker instead of waiting for its poll
        _deliveries_queued()
    return delivery


def list_deliveries(*, limit: int = 50) -> list[dict]:
    from server.webhooks import endpoints
    mine = signed_in_project()
    with _session() as s:
        own = None if mine is None else {ep.id for ep in endpoints.list_endpoints(s, project=mine)}
        return [endpoints.delivery_to_dict(d) for d in endpoints.list_deliveries(s, limit=limit)
                if own is None or d.endpoint_id in own]


def get_rule_config(project: str) -> Any:
    from server.rules import config
    with _session() as s:
        return _plain(config.get_rule_config(s, project=_scoped(project), settings=_settings))


def set_rule_override(project: str, rule: str, values: dict) -> None:
    from server.rules import config
    with _session(write=True) as s:
        config.set_rule_override(s, project=_scoped(project), rule=rule, **values)
