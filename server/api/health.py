from __future__ import annotations

from fastapi import APIRouter

from gradwatch.server.wire.schemas import HealthOut
from gradwatch.server.api.deps import DatabaseDep

router = APIRouter(tags=["health"])


@router.get("/api/health", response_model=HealthOut)
def health(database: DatabaseDep) -> HealthOut:
    # one round trip on a connection of its own, not a pooled session's four (server/storage/db.py, Ping)
    database.ping()
    return HealthOut(status="ok", database=database.dialect)
