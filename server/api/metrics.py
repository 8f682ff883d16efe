"""``GET /metrics``: Prometheus text format."""
from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse

from ..health_metrics import render_run_health
from ..metrics import database_lines
from .deps import SessionDep, SettingsDep

router = APIRouter(tags=["metrics"])


@router.get("/metrics", response_class=PlainTextResponse)
def metrics(request: Request, session: SessionDep, settings: SettingsDep) -> PlainTextResponse:
    """Ingest rate (counters), batch latency, rows written, open alerts, webhook delivery failures;
    per-run health (server/health_metrics.py)."""
    lines = list(request.app.state.metrics.lines())
    lines += database_lines(session)
    body = "\n".join(lines) + "\n" + render_run_health(session, stall_seconds=settings.stall_seconds)
    return PlainTextResponse(body, media_type="text/plain; version=0.0.4")
