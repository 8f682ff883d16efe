"""``GET /metrics``: Prometheus text format."""
from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse

from ..metrics import database_lines
from .deps import SessionDep

router = APIRouter(tags=["metrics"])


@router.get("/metrics", response_class=PlainTextResponse)
def metrics(request: Request, session: SessionDep) -> PlainTextResponse:
    """Ingest rate (counters), batch latency, rows written, open alerts, webhook delivery failures."""
    lines = list(request.app.state.metrics.lines())
    lines += database_lines(session)
    return PlainTextResponse("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")
