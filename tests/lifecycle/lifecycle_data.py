"""Shared by the lifecycle tests: fill a run's rows in every table through a real server, and count the
rows a run owns, table by table, straight from the database (the table list read from SQLAlchemy's
metadata, so a table added later is checked without touching these tests)."""
from __future__ import annotations

import math
import uuid
from typing import Any

from sqlalchemy import create_engine, text

from gradwatch.server.storage.models import Base
from tests.conftest import http_json
from tests.server.gw_payloads import N_PARAMS, batch, step

# tables with a run_id that outlive a delete on purpose: the tombstone
KEPT = {"deleted_runs"}


def _post(srv, body, token=None):
    headers = {"Authorization": f"Bearer {token}"} if token else None
    return http_json("POST", srv.url + "/api/v1/ingest", body, headers=headers)


def fill_run(srv, *, project: str, run: str, steps: int = 40, token: str | None = None) -> int:
    """A 2-rank sharded run with layer stats, custom scalars, events and a NaN loss (an alert, its rule
    state, its notification group and webhook outbox rows when the server has a webhook). Returns its id."""
    run_id = None
    session = uuid.uuid4().hex[:12]
    for rank in (0, 1):
        for lo in range(0, steps, 20):
            rows = []
            for i in range(lo, min(lo + 20, steps)):
                s = step(i)
                if i == steps // 2:
                    s["loss"] = math.nan
                rows.append(s)
            b = batch(rows, project=project, run=run, rank=rank, world_size=2,
                      session=f"{session}-r{rank}", step_origin="given",
                      events=[{"step": lo, "kind": "test_event", "data": {"lo": lo}}])
            b["meta"]["param_shards"] = [[rank, 2]] * N_PARAMS
            status, body = _post(srv, b, token)
            assert status == 200, body
            run_id = body["run_id"]
    return run_id


def tables_with_run_id() -> list[str]:
    return sorted(t.name for t in Base.metadata.sorted_tables if "run_id" in t.c and t.name != "runs")


def tables_keyed_by_alert() -> list[tuple[str, str]]:
    """(table, column) of every foreign key into alerts.id, from the metadata."""
    return sorted((t.name, fk.parent.name) for t in Base.metadata.sorted_tables for fk in t.foreign_keys
                  if fk.column.table.name == "alerts")


def sql_url(db_url: str) -> str:
    return db_url.replace("postgresql://", "postgresql+psycopg://", 1) if db_url.startswith("postgresql://") else db_url


def rows_of_run(db_url: str, run_id: int, alert_ids: list[int] | None = None,
                group_ids: list[int] | None = None) -> dict[str, Any]:
    """Rows of ``run_id`` in every table with a run_id column, the rows keyed by its alerts' ids and by
    its notification groups' ids (webhook_deliveries.group_id), and its runs row."""
    engine = create_engine(sql_url(db_url))
    out: dict[str, Any] = {}
    try:
        with engine.connect() as c:
            for t in tables_with_run_id():
                out[t] = c.execute(text(f"SELECT COUNT(*) FROM {t} WHERE run_id = :r"), {"r": run_id}).scalar()
            out["runs"] = c.execute(text("SELECT COUNT(*) FROM runs WHERE id = :r"), {"r": run_id}).scalar()
            for t, col in tables_keyed_by_alert():
                if alert_ids:
                    ids = ",".join(str(int(a)) for a in alert_ids)
                    out[f"{t}.{col}"] = c.execute(text(f"SELECT COUNT(*) FROM {t} WHERE {col} IN ({ids})")).scalar()
                else:
                    out[f"{t}.{col}"] = 0
            if group_ids:
                ids = ",".join(str(int(g)) for g in group_ids)
                out["webhook_deliveries.group_id"] = c.execute(
                    text(f"SELECT COUNT(*) FROM webhook_deliveries WHERE group_id IN ({ids})")).scalar()
            else:
                out["webhook_deliveries.group_id"] = 0
    finally:
        engine.dispose()
    return out


def ids_of(db_url: str, sql: str, **params) -> list[int]:
    engine = create_engine(sql_url(db_url))
    try:
        with engine.connect() as c:
            return [r[0] for r in c.execute(text(sql), params)]
    finally:
        engine.dispose()


def assert_no_orphans(db_url: str, run_id: int, alert_ids: list[int], group_ids: list[int]) -> None:
    left = rows_of_run(db_url, run_id, alert_ids, group_ids)
    orphans = {t: n for t, n in left.items() if n and t not in KEPT}
    assert not orphans, f"run {run_id} left rows behind: {orphans}"
    assert left["deleted_runs"] == 1, "the delete leaves one tombstone"
