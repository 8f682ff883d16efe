"""With auth on, dashboard callbacks that name another project read nothing and write nothing (hostile-input
report: they created a project called "\\x00no-such-project" on SQLite and answered 500 on PostgreSQL).
The gateway runs in a real Flask request context carrying the signed-in project, as under the server."""
from __future__ import annotations

import time

import pytest
from flask import Flask
from sqlalchemy import select

from gradwatch.dashboard import gateway
from gradwatch.server.storage.db import open_database, upgrade
from gradwatch.server.ingest.write import ingest_batch
from gradwatch.server.storage.models import Project
from gradwatch.server.wire.schemas import IngestBatchIn
from gradwatch.server.operations.settings import Settings


def test_another_project_is_neither_read_nor_created(db_url, tmp_path):
    upgrade(db_url)
    database = open_database(db_url)
    settings = Settings(database_url=db_url, data_dir=tmp_path, auth=True)
    try:
        with database.write_sessionmaker() as s:
            for project in ("alpha", "beta"):
                body = {"batch_id": project, "project": project, "run": "r",
                        "steps": [{"step": 0, "time": time.time(), "loss": 1.0}]}
                ingest_batch(s, batch=IngestBatchIn.model_validate(body), settings=settings, now=time.time())
            s.commit()
        gateway.configure(database.sessionmaker, settings)
        app = Flask("gateway-scope")
        with app.test_request_context(environ_overrides={"asgi.scope": {gateway.SCOPE_KEY: "alpha"}}):
            assert gateway.signed_in_project() == "alpha"
            assert [r["name"] for r in gateway.list_runs(project="alpha")] == ["r"]
            assert gateway.list_runs(project="beta") == []
            with pytest.raises(ValueError, match="signed in to project 'alpha'"):
                gateway.create_endpoint(url="https://93.184.216.34/x", project="beta")
            with pytest.raises(ValueError, match="signed in to project 'alpha'"):
                gateway.set_rule_override("beta", "A2", {"factor": 20})
            ep = gateway.create_endpoint(url="https://93.184.216.34/x", project="alpha")
            assert ep["project"] == "alpha"
        with database.sessionmaker() as s:
            assert sorted(s.scalars(select(Project.name))) == ["alpha", "beta"]
    finally:
        database.dispose()
