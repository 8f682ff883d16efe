"""``/api/v1/alerts``: alerts from the alerts table."""
from __future__ import annotations

from typing import Annotated, Optional

from fastapi import APIRouter, Query

from .. import queries
from ..schemas import AlertListOut, AlertOut
from .deps import ReadScopeDep, SessionDep

router = APIRouter(tags=["alerts"])


@router.get("/api/v1/alerts", response_model=AlertListOut)
def list_alerts(session: SessionDep, scope: ReadScopeDep,
                run: Annotated[Optional[int], Query(ge=0, le=2**62)] = None,
                severity: Annotated[Optional[str], Query(max_length=16)] = None,
                rule: Annotated[Optional[str], Query(max_length=64)] = None,
                status: Annotated[Optional[str], Query(max_length=16)] = None) -> AlertListOut:
    """Newest first; filters: run id, severity, rule (id or name), status (firing | resolved)."""
    alerts = queries.list_alerts(session, run_id=run, severity=severity, rule=rule, status=status, project=scope)
    return AlertListOut(alerts=[AlertOut(**vars(a)) for a in alerts])
