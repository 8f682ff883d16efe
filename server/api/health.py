from __future__ import annotations

from fastapi import APIRouter
from sqlalchemy import text

from gradwatch.server.wire.schemas import HealthOut
from gradwatch.server.api.deps import DatabaseDep, SessionDep

router = APIRouter(tags=["health"])


@router.get("/api/health", response_model=HealthOut)
def health(session: SessionDep, database: DatabaseDep) -> HealthOut:
    session.execute(text("SELECT 1"))
    return HealthOut(status="ok", database=database.dialect)
