"""``GET /metrics``: Prometheus text format."""
from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse

from gradwatch.server.api.health_metrics import render_run_health
from gradwatch.server.operations.metrics import database_lines, lock_hold_lines
from gradwatch.server.api.deps import SessionDep, SettingsDep

router = APIRouter(tags=["metrics"])


@router.get("/metrics", response_class=PlainTextResponse)
def metrics(request: Request, session: SessionDep, settings: SettingsDep) -> PlainTextResponse:
    """Ingest rate (counters), batch latency, rows written, open alerts, webhook delivery failures;
    per-run health (server/api/health_metrics.py).

    The counts are open to any scraper (a load balancer, Prometheus). The per-run families name runs and
    their losses: with auth on they are served only to a scrape that sends a project token
    (``Authorization: Bearer``), for that project's runs."""
    lines = list(request.app.state.metrics.lines())
    hold = request.app.state.lock_hold
    lines += lock_hold_lines(hold.average, hold.seconds)
    lines += database_lines(session)
    retention = getattr(request.app.state, "retention_counters", None)     # server/lifecycle/retention.py
    if retention is not None:
        lines += retention.lines()
    body = "\n".join(lines) + "\n"
    auth = request.app.state.auth
    if auth is None:
        body += render_run_health(session, stall_seconds=settings.stall_seconds)
    else:
        header = request.headers.get("authorization", "")
        token = header[7:].strip() if header[:7].lower() == "bearer " else ""
        project = auth.project_for(token) if token else None
        if project is None:
            body += "# per-run families (gradwatch_run_*) are served to a scrape with a project token\n"
        else:
            body += render_run_health(session, stall_seconds=settings.stall_seconds, project=project)
    return PlainTextResponse(body, media_type="text/plain; version=0.0.4")
