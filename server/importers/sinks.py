"""Where imported batches go: a database through the server's own ingest function, or a running server.

Both take the ingest bodies the agent sends (``POST /api/v1/ingest``,
docs/wire-format.md), so an imported step is validated, stored, rolled up and
run through the rule engine exactly as a live one. ``DatabaseSink`` needs the
server extra; ``HttpSink`` the standard library only.
"""
from __future__ import annotations

import gzip
import json
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass
from typing import Any, Optional

from gradwatch.server.importers.source import ImportProblem
from gradwatch.server.commands.extras import pip_command
from gradwatch.server.commands.http_json import request_json

SERVER_HINT = pip_command("server")


@dataclass
class Sent:
    run_id: int
    duplicate: bool


@dataclass
class StoredRun:
    id: int
    last_step: Optional[int]


@dataclass
class AlertLine:
    rule: str
    name: str
    severity: str
    step: int
    title: str


class DatabaseSink:
    """Writes with ``server.ingest.write.ingest_batch`` in one transaction per batch, as the API does."""

    def __init__(self, url: Optional[str]):
        try:
            from gradwatch.server.storage.db import open_database, prepare_schema, schema_problem
            from gradwatch.server.operations.settings import Settings
        except ImportError as e:
            raise ImportProblem(f"--db writes through the server's ingest code, which needs the server extra "
                                f"({e.name} is missing): {SERVER_HINT}, or send to a server with --server URL") from None
        self.settings = Settings.from_env(db=url)
        self.url = self.settings.database_url
        self.database = open_database(self.url)
        try:
            # as `gradwatch serve` does: an empty database gets the schema, the embedded default is upgraded
            prepare_schema(self.url, upgrade_old=self.settings.embedded_db)
            problem = schema_problem(self.database.engine, self.url)
        except Exception as e:  # noqa: BLE001 - connection errors: one line naming the URL
            self.database.dispose()
            raise ImportProblem(f"cannot open the database {self.url}: {str(e).strip().splitlines()[0]}") from None
        if problem:
            self.database.dispose()
            raise ImportProblem(f"{problem}; run: gradwatch db upgrade --db {self.url}")

    @property
    def where(self) -> str:
        return self.url

    def close(self) -> None:
        self.database.dispose()

    def send(self, body: dict[str, Any]) -> Sent:
        from pydantic import ValidationError
        from sqlalchemy.exc import IntegrityError, OperationalError

        from gradwatch.server.api.ingest import format_validation_error
        from gradwatch.server.ingest.write import ingest_batch
        from gradwatch.server.wire.schemas import IngestBatchIn

        try:
            batch = IngestBatchIn.model_validate(body)
        except ValidationError as e:
            raise ImportProblem(f"batch {body.get('batch_id')} refused: {format_validation_error(e)}") from None
        for attempt in range(5):
            with self.database.write_sessionmaker() as session:
                try:
                    outcome = ingest_batch(session, batch=batch, settings=self.settings, now=time.time())
                    if outcome.duplicate:
                        session.rollback()
                    else:
                        session.commit()
                    return Sent(run_id=outcome.run_id, duplicate=outcome.duplicate)
                except (IntegrityError, OperationalError):
                    # a server writing to the same database won a race or held the lock: the
                    # transaction is rolled back whole; retry it, as the API's write path does
                    session.rollback()
                    if attempt == 4:
                        raise
                    time.sleep(0.05 * (attempt + 1))
        raise AssertionError("unreachable")

    def find_run(self, project: str, name: str) -> Optional[StoredRun]:
        from gradwatch.server import queries

        with self.database.sessionmaker() as session:
            runs = queries.list_runs(session, project=project, name=name)
        return next((StoredRun(r.id, r.last_step) for r in runs if r.name == name and r.project == project), None)

    def alerts(self, run_id: int) -> list[AlertLine]:
        from gradwatch.server import queries

        with self.database.sessionmaker() as session:
            found = queries.list_alerts(session, run_id=run_id)
        return _sorted([AlertLine(a.rule, a.name, a.severity, a.first_step, a.message) for a in found])

    def run_url(self, run_id: int) -> Optional[str]:
        return None


class HttpSink:
    """POSTs to a running server's ingest API (gzip, as the agent does)."""

    def __init__(self, base: str, token: Optional[str] = None, timeout: float = 120.0):
        if not base.startswith(("http://", "https://")):
            raise ImportProblem(f"--server {base!r}: give an http:// or https:// URL, e.g. http://127.0.0.1:8470")
        self.base = base.rstrip("/")
        self.token = token
        self.timeout = timeout
        self._request("GET", "/api/health")    # an unreachable server is said before a long read, not after

    @property
    def where(self) -> str:
        return self.base

    def close(self) -> None:
        pass

    def _request(self, method: str, path: str, body: Optional[dict] = None) -> Any:
        data = None
        req = urllib.request.Request(self.base + path, method=method)
        if body is not None:
            data = gzip.compress(json.dumps(body, allow_nan=False, separators=(",", ":")).encode(), 5)
            req.add_header("Content-Type", "application/json")
            req.add_header("Content-Encoding", "gzip")
        if self.token:
            req.add_header("Authorization", f"Bearer {self.token}")
        return request_json(req, base=self.base, path=path, timeout=self.timeout, error=ImportProblem,
                            token_of="the project (gradwatch token create)", data=data)

    def send(self, body: dict[str, Any]) -> Sent:
        out = self._request("POST", "/api/v1/ingest", body)
        return Sent(run_id=int(out["run_id"]), duplicate=bool(out["duplicate"]))

    def find_run(self, project: str, name: str) -> Optional[StoredRun]:
        out = self._request("GET", "/api/v1/runs?" + urllib.parse.urlencode({"project": project, "name": name}))
        return next((StoredRun(r["id"], r.get("last_step")) for r in out["runs"]
                     if r["name"] == name and r["project"] == project), None)

    def alerts(self, run_id: int) -> list[AlertLine]:
        out = self._request("GET", "/api/v1/alerts?" + urllib.parse.urlencode({"run": run_id}))
        return _sorted([AlertLine(a["rule"], a["name"], a["severity"], a["first_step"], a["message"])
                        for a in out["alerts"]])

    def run_url(self, run_id: int) -> Optional[str]:
        return f"{self.base}/runs/{run_id}"


def _sorted(alerts: list[AlertLine]) -> list[AlertLine]:
    return sorted(alerts, key=lambda a: (a.step, a.rule))
