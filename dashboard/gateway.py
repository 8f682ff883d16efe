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

from gradwatch.server.scope import in_scope

_sessionmaker = None
_settings = None
_deliveries_queued = None   # the server's "send due webhook deliveries now" (None: it polls every second)
_live_news = None           # the server's LiveNews: run pages wait for new steps (None: they poll)
_write_sessionmaker = None  # the server's write sessions and ingest gate: a delete's transactions take them
_write_gate = None


def configure(sessionmaker, settings, *, deliveries_queued=None, live_news=None, write_sessionmaker=None,
              write_gate=None) -> None:
    """Called once by ``create_dash``: every later call reads through this sessionmaker."""
    global _sessionmaker, _settings, _deliveries_queued, _live_news, _write_sessionmaker, _write_gate
    _sessionmaker = sessionmaker
    _settings = settings
    _deliveries_queued = deliveries_queued
    _live_news = live_news
    _write_sessionmaker = write_sessionmaker
    _write_gate = write_gate


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


# A project filter no stored project matches (names are at most 200 characters): what a signed-in user
# asking for another project's data reads. Plain text: PostgreSQL refuses a NUL even in a parameter.
_NO_PROJECT = "~" * 201


def _scoped(project: Optional[str]) -> Optional[str]:
    """The project filter to apply: the signed-in one when auth is on (a request for another sees nothing)."""
    mine = signed_in_project()
    if mine is None:
        return project or None
    return mine if not project or in_scope(mine, project) else _NO_PROJECT


def _writable(project: str) -> str:
    """The project a write goes to: with auth on, only the signed-in one (``ValueError`` otherwise, shown to
    the user; nothing is created)."""
    mine = signed_in_project()
    if project and not in_scope(mine, project):
        raise ValueError(f"you are signed in to project {mine!r}: sign in with its token to change another")
    return mine or project


def _run_visible(session, run_id: int) -> bool:
    mine = signed_in_project()
    if mine is None:
        return True
    from gradwatch.server import queries
    return in_scope(mine, queries.run_project(session, run_id=run_id))


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

def stall_seconds() -> float:
    """Seconds without data before a running run reads as stalled: the server's setting, else its default."""
    from gradwatch.server.settings import DEFAULT_STALL_SECONDS
    return float(getattr(_settings, "stall_seconds", None) or DEFAULT_STALL_SECONDS)


def _series(result: Any) -> dict:
    """A series (``schemas.SeriesOut``) as ``{"bucket_size", "steps": [bucket dicts]}`` (the read API's shape)."""
    points = getattr(result, "points", None)
    if points is not None:
        # Thousands of points per page: spelled out, this is ~10x cheaper than the generic _plain walk.
        return {"bucket_size": result.bucket_size or 1,
                "steps": [{"step": p.step, "min": p.min, "max": p.max, "last": p.last, "count": p.count,
                           "nonfinite": p.nonfinite} for p in points]}
    s = _plain(result) or {}
    return {"bucket_size": s.get("bucket_size", 1) or 1, "steps": list(s.get("points", s.get("steps")) or [])}


def list_runs(*, project: Optional[str] = None, status: Optional[str] = None, name: Optional[str] = None) -> list[dict]:
    """The runs, each with ``bytes``: its estimated size (server/lifecycle/sizes.py)."""
    from gradwatch.server import queries
    from gradwatch.server.lifecycle import sizes
    with _session() as s:
        runs = _unwrap(queries.list_runs(s, project=_scoped(project), status=status or None, name=name or None,
                                         stall_seconds=stall_seconds()), "runs")
        size = sizes.run_bytes(s, [r["id"] for r in runs])
    for r in runs:
        r["bytes"] = size.get(r["id"])
    return runs


def get_run(run_id: int) -> Optional[dict]:
    from gradwatch.server import queries
    with _session() as s:
        if not _run_visible(s, run_id):
            return None
        return _plain(queries.get_run(s, run_id=run_id, stall_seconds=stall_seconds()))


def steps_after(last: Optional[int], cursor: Optional[float]) -> bool:
    """Whether a run whose last step is ``last`` holds steps after a page's ``cursor`` (None: none
    drawn yet).

    >>> steps_after(None, None), steps_after(5, None), steps_after(5, 5), steps_after(6, 5)
    (False, True, False, True)
    """
    return last is not None and (cursor is None or last > cursor)


def wait_for_steps(run_id: int, cursor: Optional[float]) -> Optional[bool]:
    """Park until ``run_id`` holds steps after ``cursor`` (server/live_news.py): True when it does, False
    after the wait (about a second); None at once when this process cannot park the caller (no LiveNews,
    too many pages waiting): it polls instead. Also marks the run as watched, so its agents send faster."""
    if _live_news is None:
        return None
    run = get_run(run_id)
    if run is None:   # no such run, or another project's (auth): nothing to wait for, nobody to speed up
        return None
    if run.get("status") in ("finished", "crashed"):
        return None   # an ended run's page polls (a resumed run starts sending again), holding no thread

    if steps_after(run.get("last_step"), cursor):
        _live_news.watch(run_id)
        return True
    # the recheck also finds the steps another replica stored: no wake-up reaches this process for them
    return _live_news.wait(run_id, recheck=lambda: steps_after((get_run(run_id) or {}).get("last_step"), cursor))


def _one_series(run_id: int, signal: str, start, end, max_points: int, since, rank: int = 0) -> dict:
    from gradwatch.server import queries
    with _session() as s:
        return _series(queries.get_series(s, run_id=run_id, signal=signal, start=start, end=end,
                                          max_points=max_points, since=since, rank=rank))


def get_series(run_id: int, signals: Sequence[str], *, start: Optional[float] = None, end: Optional[float] = None,
               max_points: int = 1000, since: Optional[int] = None, since_by: Optional[dict[str, int]] = None,
               rank: int = 0, sources: Optional[dict[str, int]] = None) -> dict[str, dict]:
    """``{signal: {"bucket_size": n, "steps": [bucket, ...]}}`` for several signals of one run.

    ``start`` / ``end`` may be floats (a zoomed chart's range); ``since``
    returns the raw steps after that step (a live tail; ``since_by`` gives
    some signals their own, each signal's tail is its own query). Signals are read
    from ``rank``, or from the rank ``sources`` names for them (a sharded
    run's grad norm from its combined row, -1).

    A range (or the whole run) is one ``queries.get_series_multi`` call: the
    rollup partials, which hold every step signal, are read once for all the
    signals instead of once per signal (a 1M-step run: ~45 ms instead of
    ~200 ms for the run page's 12). Live tails are raw rows, read in
    parallel, one session per signal: the database does the work with the GIL
    released.
    """
    from gradwatch.server import queries

    start = None if start is None else max(0, int(math.floor(start)))
    end = None if end is None else int(math.ceil(end))
    if signed_in_project() is not None:
        with _session() as s:
            if not _run_visible(s, run_id):
                return {sig: {"bucket_size": 1, "steps": []} for sig in signals}
    source = {sig: (sources or {}).get(sig, rank) for sig in signals}
    if since is None:
        by_rank: dict[int, list[str]] = {}
        for sig in signals:
            by_rank.setdefault(source[sig], []).append(sig)
        got = {}
        with _session() as s:
            for r, sigs in by_rank.items():
                out = queries.get_series_multi(s, run_ids=[run_id], signals=sigs, start=start, end=end,
                                               max_points=max_points, rank=r)
                got.update({sig: _series(one) for sig, one in zip(sigs, out)})
        return {sig: got[sig] for sig in signals}
    after = {sig: (since_by or {}).get(sig, since) for sig in signals}
    if len(signals) == 1:
        return {signals[0]: _one_series(run_id, signals[0], start, end, max_points, after[signals[0]],
                                        source[signals[0]])}
    futures = {sig: _pool().submit(_one_series, run_id, sig, start, end, max_points, after[sig], source[sig])
               for sig in signals}
    return {sig: f.result() for sig, f in futures.items()}


def get_rank_meta(run_id: int) -> Optional[dict]:
    """``{"world_size", "combined", "ranks": [{"rank", "host", "local_rank", "device", "pid"}]}``, or None."""
    from gradwatch.server import queries
    with _session() as s:
        if not _run_visible(s, run_id):
            return None
        return queries.rank_meta(s, run_id=run_id)


def get_rank_matrix(run_id: int, signals: Sequence[str], *, start: Optional[float] = None,
                    end: Optional[float] = None, max_steps: int = 300) -> dict[str, dict]:
    """``{signal: {"bucket_size", "steps", "ranks", "min", "max", "last", "nonfinite"}}``: every rank of
    the run on one step axis (``queries.get_rank_matrix``)."""
    from gradwatch.server import queries
    start = None if start is None else max(0, int(math.floor(start)))
    end = None if end is None else int(math.ceil(end))
    with _session() as s:
        if not _run_visible(s, run_id):
            return {}
        out = queries.get_rank_matrix(s, run_id=run_id, signals=list(signals), start=start, end=end,
                                      max_steps=max_steps) or []
    return {m.signal: {"bucket_size": m.bucket_size, "steps": m.steps, "ranks": m.ranks, "min": m.min, "max": m.max,
                       "last": m.last, "nonfinite": m.nonfinite} for m in out}


_executor = None


def _pool():
    global _executor
    if _executor is None:
        from concurrent.futures import ThreadPoolExecutor
        _executor = ThreadPoolExecutor(max_workers=4, thread_name_prefix="gradwatch-dash-read")
    return _executor


def get_layer_matrix(run_id: int, stat: str, *, start: Optional[float] = None, end: Optional[float] = None,
                     max_steps: int = 300, max_layers: int = 48, rank: int = 0) -> dict:
    """``{"steps": [...], "names": [...], "values": [[one per step] per layer], "layer_group_size": n}``."""
    from gradwatch.server import queries
    start = None if start is None else max(0, int(math.floor(start)))
    end = None if end is None else int(math.ceil(end))
    with _session() as s:
        if not _run_visible(s, run_id):
            return {"steps": [], "names": [], "values": []}
        m = queries.get_layer_matrix(s, run_id=run_id, stat=stat, start=start, end=end,
                                     max_steps=max_steps, max_layers=max_layers, rank=rank)
    if m is None:
        return {"steps": [], "names": [], "values": [], "layer_group_size": 1, "bucket_size": 1}
    # the matrix holds plain lists already: no _plain walk over its cells (~15k per heatmap)
    return {"steps": list(m.steps), "names": list(m.layers), "values": list(m.values),
            "layer_group_size": m.layer_group_size, "bucket_size": m.bucket_size}


def list_alerts(*, run_id: Optional[int] = None, severity: Optional[str] = None, rule: Optional[str] = None,
                status: Optional[str] = None) -> list[dict]:
    from gradwatch.server import queries
    with _session() as s:
        return _unwrap(queries.list_alerts(s, run_id=run_id, severity=severity or None, rule=rule or None,
                                           status=status or None, project=_scoped(None)), "alerts")


def recoveries(run_ids: Sequence[int]) -> dict[int, tuple[int, Optional[str]]]:
    """For the runs list's health badge: each run's resolved warning / critical alerts, (count, "C3 at step
    80" for the latest). One read of the newest 1000 resolved alerts in scope (the query layer's cap): a run
    whose resolved alerts are all older than those shows no count."""
    from gradwatch.dashboard.alert_cards import recovery
    from gradwatch.server import queries
    wanted = set(run_ids)
    with _session() as s:
        resolved = _unwrap(queries.list_alerts(s, status="resolved", project=_scoped(None)), "alerts")
    by_run: dict[int, list] = {}
    for a in resolved:
        if a.get("run_id") in wanted:
            by_run.setdefault(a["run_id"], []).append(a)
    return {rid: recovery(alerts) for rid, alerts in by_run.items()}


def early_warnings(run_ids: Sequence[int]) -> dict[int, dict[str, list]]:
    """The runs' firing early-warning alerts (``server.queries.early_warnings``), for the runs list's badge."""
    from gradwatch.server import queries
    with _session() as s:
        return queries.early_warnings(s, run_ids=list(run_ids))


def list_events(run_id: int, *, kind: Optional[str] = None) -> list[dict]:
    from gradwatch.server import queries
    with _session() as s:
        if not _run_visible(s, run_id):
            return []
        return _unwrap(queries.list_events(s, run_id=run_id, kind=kind), "events")


def get_incident(alert_id: int) -> Optional[dict]:
    """One alert's incident (``server.forensics.incident.get_incident``): the alert, its incident's other
    alerts, the checkpoint to roll back to and the timeline; None for no such alert (or another project's)."""
    from gradwatch.server.forensics import incident
    with _session() as s:
        found = incident.get_incident(s, alert_id=alert_id)
        if found is None or not _run_visible(s, found["alert"]["run_id"]):
            return None
        return found


def list_checkpoints(run_id: int) -> list[dict]:
    """The run's checkpoints in step order (``queries.list_checkpoints``)."""
    from gradwatch.server import queries
    with _session() as s:
        if not _run_visible(s, run_id):
            return []
        return _unwrap(queries.list_checkpoints(s, run_id=run_id), "checkpoints")


def list_rewinds(run_id: int) -> list[dict]:
    """The run's rewinds in step order (``queries.list_rewinds``: the agent's Rewind policy)."""
    from gradwatch.server import queries
    with _session() as s:
        if not _run_visible(s, run_id):
            return []
        return _unwrap(queries.list_rewinds(s, run_id=run_id), "rewinds")


# --------------------------------------------------------------------------- writes

def acknowledge_alert(alert_id: int) -> None:
    from gradwatch.server import queries
    from gradwatch.server.rules import alerts
    with _session(write=True) as s:
        alert = queries.get_alert(s, alert_id=alert_id)
        if alert is None or not _run_visible(s, alert.run_id):
            raise LookupError(f"no alert {alert_id}")
        alerts.acknowledge_alert(s, alert_id=alert_id)


def list_endpoints(projects: Sequence[str] = ()) -> list[dict]:
    """Every webhook endpoint (with auth on: the signed-in project's only; server-wide endpoints are the
    operator's); ``project`` is filled in for those of the given projects."""
    from gradwatch.server.webhooks import endpoints
    mine = signed_in_project()
    with _session() as s:
        names = {}
        for name in ([mine] if mine else projects):
            for ep in endpoints.list_endpoints(s, project=name):
                if ep.project_id is not None:
                    names[ep.id] = name
        shown = endpoints.list_endpoints(s, project=mine, server_wide=False) if mine else endpoints.list_endpoints(s)
        return [endpoints.endpoint_to_dict(ep, names.get(ep.id)) for ep in shown]


def _own_endpoint(session, endpoint_id: int) -> None:
    mine = signed_in_project()
    if mine is None:
        return
    from gradwatch.server.webhooks import endpoints
    if endpoint_id not in {ep.id for ep in endpoints.list_endpoints(session, project=mine, server_wide=False)}:
        raise LookupError(f"no webhook endpoint {endpoint_id} in project {mine}")


def create_endpoint(*, url: str, project: str, format: str = "json", min_severity: str = "info",
                    secret: Optional[str] = None) -> dict:
    """Raises ``ValueError`` saying what is wrong with the URL, format, severity or secret."""
    from gradwatch.server.webhooks import endpoints
    project = _writable(project)
    with _session(write=True) as s:
        ep = endpoints.create_endpoint(s, project=project, url=url, format=format, min_severity=min_severity,
                                       secret=secret or None, settings=_settings)
        return endpoints.endpoint_to_dict(ep, project)


def delete_endpoint(endpoint_id: int) -> bool:
    from gradwatch.server.webhooks import endpoints
    with _session(write=True) as s:
        _own_endpoint(s, endpoint_id)
        return endpoints.delete_endpoint(s, endpoint_id=endpoint_id)


def send_test(endpoint_id: int) -> dict:
    """Queue a sample alert to one endpoint; the server's delivery worker sends it right away."""
    from gradwatch.server.webhooks import endpoints
    with _session(write=True) as s:
        _own_endpoint(s, endpoint_id)
        delivery = endpoints.delivery_to_dict(endpoints.send_test(s, endpoint_id=endpoint_id, settings=_settings,
                                                                  now=time.time()))
    if _deliveries_queued is not None:   # committed: wake the worker instead of waiting for its poll
        _deliveries_queued()
    return delivery


def list_deliveries(*, limit: int = 50) -> list[dict]:
    from gradwatch.server.webhooks import endpoints
    mine = signed_in_project()
    with _session() as s:
        own = None if mine is None else {ep.id for ep in endpoints.list_endpoints(s, project=mine, server_wide=False)}
        return [endpoints.delivery_to_dict(d) for d in endpoints.list_deliveries(s, limit=limit)
                if own is None or d.endpoint_id in own]


def rule_text(rule_id: str, values: dict) -> str:
    """What rule ``rule_id`` fires on with ``values`` (the static catalogue: text only, no database);
    its default text where the values cannot be described, "" for a rule the catalogue lacks."""
    from gradwatch.server.rules.catalogue import RULES_BY_ID, describe
    spec = RULES_BY_ID.get(rule_id)
    try:
        return describe(spec, values) if spec else ""
    except Exception:  # noqa: BLE001 - a description is a nicety; the thresholds are what matter
        return spec.fires_when if spec else ""


def setup_rule_ids() -> frozenset:
    """The configuration-advice rules (H5-H9: every rule of ``setup_advice.py``'s ``SetupRule`` family)."""
    from gradwatch.server.rules.catalog.setup_advice import SetupRule
    from gradwatch.server.rules.registry import rule_classes
    return frozenset(c.id for c in rule_classes() if issubclass(c, SetupRule))


def cross_rank_rule_ids() -> frozenset:
    """The rules whose alert names the rank that stands out (family ``spec.CROSS_RANK``: F1, F3, F5, …)."""
    from gradwatch.server.rules.registry import ids_of_family
    from gradwatch.server.rules.spec import CROSS_RANK
    return frozenset(ids_of_family(CROSS_RANK))


def get_rule_config(project: str) -> Any:
    from gradwatch.server.rules import config
    with _session() as s:
        return _plain(config.get_rule_config(s, project=_scoped(project), settings=_settings))


def set_rule_override(project: str, rule: str, values: dict) -> None:
    from gradwatch.server.rules import config
    with _session(write=True) as s:
        config.set_rule_override(s, project=_writable(project), rule=rule, **values)


# --------------------------------------------------------------------------- silences

def list_silences() -> list[dict]:
    """Not yet ended silences, newest first (with auth on: the signed-in project's)."""
    from gradwatch.server.models import Project
    from gradwatch.server.routing import silences
    mine = signed_in_project()
    with _session() as s:
        rows = silences.list_silences(s, project=mine, active_only=True)
        if mine is not None:
            rows = [r for r in rows if r.project_id is not None]
        names = {p.id: p.name for p in s.query(Project).filter(Project.id.in_({r.project_id for r in rows}))}
        return [silences.silence_to_dict(r, names.get(r.project_id)) for r in rows]


def create_silence(*, project: Optional[str], matchers: Sequence[str], duration: str, comment: str = "",
                   created_by: str = "") -> dict:
    """Raises ``ValueError`` saying what is wrong with a matcher or the duration."""
    from gradwatch.server.routing import silences
    mine = signed_in_project()
    project = _writable(project) if (project or mine) else None
    with _session(write=True) as s:
        row = silences.create_silence(s, project=project, matchers=list(matchers),
                                      duration_s=silences.parse_duration(duration), comment=comment,
                                      created_by=created_by or ("dashboard" if mine is None else f"dashboard:{mine}"))
        out = silences.silence_to_dict(row, project)
    if _deliveries_queued is not None:
        _deliveries_queued()
    return out


def expire_silence(silence_id: int) -> bool:
    from gradwatch.server.routing import silences
    with _session(write=True) as s:
        row = silences.expire_silence(s, silence_id=silence_id, project=signed_in_project())
    if _deliveries_queued is not None:
        _deliveries_queued()
    return row is not None


# --------------------------------------------------------------------------- data lifecycle

def delete_preview(run_id: int) -> Optional[dict]:
    """What deleting a run would take: its name, project, status and estimated bytes (None: not visible)."""
    from gradwatch.server.lifecycle import delete, sizes
    with _session() as s:
        if not _run_visible(s, run_id):
            return None
        refs = delete.select_runs(s, run_ids=[run_id], stall_seconds=stall_seconds())
        if not refs:
            return None
        r = refs[0]
        return {"id": r.id, "name": r.name, "project": r.project, "status": r.status,
                "bytes": sizes.run_bytes(s, [r.id]).get(r.id, 0)}


def delete_run(run_id: int, *, force: bool) -> dict:
    """Delete a run (server/lifecycle/delete.py): ``{"deleted": bool, "rows", "bytes", "message"}``.
    A run still sending is refused unless ``force`` (the message says so)."""
    from types import SimpleNamespace

    from gradwatch.server.lifecycle import delete
    with _session() as s:
        if not _run_visible(s, run_id):
            return {"deleted": False, "rows": 0, "bytes": 0, "message": f"run {run_id} not found"}
        refs = delete.select_runs(s, run_ids=[run_id], stall_seconds=stall_seconds())
    if not refs:
        return {"deleted": False, "rows": 0, "bytes": 0, "message": f"run {run_id} not found"}
    database = SimpleNamespace(sessionmaker=_sessionmaker, write_sessionmaker=_write_sessionmaker or _sessionmaker)
    try:
        report = delete.delete_runs(database, runs=refs, force=force, stall_seconds=stall_seconds(),
                                    gate=_write_gate)
    except delete.RunStillSending as e:
        return {"deleted": False, "rows": 0, "bytes": 0, "message": str(e)}
    done = bool(report.runs)
    return {"deleted": done, "rows": report.rows, "bytes": sum(report.bytes.values()),
            "message": f"deleted run {refs[0].name!r}" if done else f"run {run_id} was already being deleted"}


def format_bytes(n: Optional[float]) -> str:
    """``1.38 GB``: decimal units, as the CLI prints them."""
    from gradwatch.server.lifecycle.cli import human_bytes
    return human_bytes(n)


def database_size() -> dict:
    """``{"dialect", "bytes", "free_bytes"}`` (server/lifecycle/sizes.py)."""
    from gradwatch.server.lifecycle import sizes
    with _session() as s:
        return _plain(sizes.database_size(s))
