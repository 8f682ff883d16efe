"""Rule tests run the real write path in-process: ``ingest_batch`` on a real SQLite file
(migrated with the real Alembic revisions), or the real PostgreSQL, then read the alerts table."""
from __future__ import annotations

import itertools
import time
import uuid
from typing import Any, Iterable, Optional

import pytest
from sqlalchemy import select

from gradwatch.server.storage.db import open_database, upgrade
from gradwatch.server.ingest.write import ingest_batch
from gradwatch.server.storage.models import Alert, Run
from gradwatch.server.wire.schemas import IngestBatchIn
from gradwatch.server.operations.settings import Settings

_counter = itertools.count()


class RulesDB:
    def __init__(self, url: str, tmp_path, rules_file: Optional[str] = None, **settings_kw):
        upgrade(url)
        self.url = url
        self.db = open_database(url)
        self.settings = Settings(data_dir=tmp_path, database_url=url, rules_file=rules_file, **settings_kw)

    def feed(self, run: str, steps: Iterable[dict], *, project: str = "p", rank: int = 0, world_size: int = 1,
             batch: int = 50, events: Optional[list[dict]] = None, meta: Optional[dict] = None,
             now: Optional[float] = None) -> list[dict]:
        """Send ``steps`` through the real ingest path in batches; returns the notified alerts."""
        steps = list(steps)
        notified = []
        events = list(events or [])
        first = True
        for i in range(0, max(len(steps), 1), batch):
            chunk = steps[i:i + batch]
            hi = chunk[-1]["step"] if chunk else 10**12
            # an event travels with the first batch that reaches its step (late events: the first batch)
            mine = [e for e in events if e.get("step") is None or e["step"] <= hi]
            events = [e for e in events if e not in mine]
            body = {"batch_id": uuid.uuid4().hex, "project": project, "run": run, "rank": rank,
                    "world_size": world_size, "steps": chunk, "events": mine}
            if first and meta:
                body["meta"] = meta
            first = False
            b = IngestBatchIn.model_validate(body)
            with self.db.write_sessionmaker() as s, s.begin():
                out = ingest_batch(s, batch=b, settings=self.settings, now=now or time.time())
                notified.append(out.alerts_enqueued)
        return notified

    def alerts(self, run: str, project: str = "p") -> list[Alert]:
        with self.db.sessionmaker() as s:
            run_row = s.scalar(select(Run).where(Run.name == run))
            if run_row is None:
                return []
            return list(s.scalars(select(Alert).where(Alert.run_id == run_row.id).order_by(Alert.id)))

    def rules(self, run: str) -> dict[str, Alert]:
        return {a.rule: a for a in self.alerts(run)}

    def close(self):
        self.db.dispose()


@pytest.fixture
def rdb(tmp_path):
    r = RulesDB(f"sqlite:///{tmp_path / 'rules.db'}", tmp_path)
    yield r
    r.close()


def step(i: int, **kw: Any) -> dict:
    d = {"step": i, "time": 1_700_000_000.0 + i * 0.05}
    d.update(kw)
    return d


def run_name() -> str:
    return f"run-{next(_counter)}-{uuid.uuid4().hex[:6]}"
