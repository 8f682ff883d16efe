"""``create_app(settings)``: the FastAPI app, its lifespan, the routers and the Dash mount."""
from __future__ import annotations

import logging
from contextlib import asynccontextmanager
from typing import Optional

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from gradwatch.server.queries.admission import HeavyReadBusy, HeavyReadGate, HoldUntilSent, set_heavy_reads
from gradwatch.server.api import alerts, health, ingest, runs, silences, webhooks, metrics as metrics_api
from gradwatch.server.storage.db import Database, open_database, schema_problem
from gradwatch.server.ingest.live_news import DASHBOARD_THREADS, LiveNews
from gradwatch.server.operations.metrics import IngestMetrics, RetentionCounters
from gradwatch.server.wire.schemas import IngestBatchIn
from gradwatch.server.operations.settings import Settings
from gradwatch.server.ingest.pacing import LockHoldMeter
from gradwatch.server.ingest.write_gate import FifoGate, default_permits

log = logging.getLogger("gradwatch.server")


class SchemaOutOfDate(RuntimeError):
    """The database is not at this server's migration head."""


def check_schema(database: Database, settings: Settings) -> None:
    problem = schema_problem(database.engine, settings.database_url)
    if problem:
        raise SchemaOutOfDate(
            f"{problem}. Run: gradwatch db upgrade --db {settings.database_url}"
            " (or start the server with --migrate)"
        )


def create_app(settings: Settings, *, database: Optional[Database] = None, mount_dashboard: bool = True) -> FastAPI:
    """Build the app. The database is opened here and closed by the lifespan.

    The schema must already be at the head revision (``gradwatch serve`` upgrades
    the embedded SQLite default, or with ``--migrate``); otherwise the lifespan
    refuses to start with a message saying what to run.
    """
    database = database or open_database(settings.database_url)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        check_schema(database, settings)
        import os

        from gradwatch.server.routing.config import routing_of
        from gradwatch.server.routing.dispatch import flush_due, route_timer_alerts
        from gradwatch.server.routing.groups import mark_delivered, next_flush_at
        from gradwatch.server.routing.receivers.email import EmailSender, SmtpSettings
        from gradwatch.server.webhooks.worker import DeliveryWorker

        routing_of(settings)      # a bad routing file stops the server here, saying where
        worker = DeliveryWorker(database.sessionmaker, settings, route=route_timer_alerts, flush=flush_due,
                                flush_due_at=next_flush_at, delivered=mark_delivered,
                                senders={"mailto": EmailSender(SmtpSettings.from_env(os.environ))})
        app.state.delivery_worker = worker
        await worker.start()
        _finish_deletes(database, app.state.write_gate)
        from gradwatch.server.lifecycle.retention import RetentionJob, retention_configured

        retention = None
        if retention_configured(os.environ):     # docs/deployment.md, "Retention"
            retention = RetentionJob(database, os.environ, gate=app.state.write_gate,
                                     counters=app.state.retention_counters)
            retention.start()
        try:
            yield
        finally:
            if retention is not None:
                retention.stop()
            await worker.stop()
            database.dispose()

    app = FastAPI(title="gradwatch", version="0.1.0", lifespan=lifespan,
                  description="Training-stability monitoring: ingest, read API, alerts.")
    app.state.settings = settings
    app.state.database = database
    app.state.auth = None
    app.state.metrics = IngestMetrics()
    app.state.live_news = LiveNews()
    app.state.retention_counters = RetentionCounters()   # on /metrics, whether or not the job runs
    app.state.lock_hold = LockHoldMeter()   # the ranks' pace follows it (server/ingest/pacing.py)
    app.state.write_gate = FifoGate(settings.write_concurrency or default_permits(database.engine.dialect.name))
    # one memory budget for the heavy reads (heatmaps) of this process, whoever asks (server/queries/admission.py)
    app.state.heavy_reads = HeavyReadGate(settings.heavy_read_budget_bytes)
    set_heavy_reads(app.state.heavy_reads)
    app.add_middleware(HoldUntilSent)     # a heatmap's share is held until its answer is sent
    if settings.auth:
        from gradwatch.server.access.auth import Auth, AuthMiddleware, add_login_routes, load_session_secret

        auth = Auth(database.sessionmaker, lambda: load_session_secret(settings, database.sessionmaker))
        app.state.auth = auth
        add_login_routes(app, auth)
        app.add_middleware(AuthMiddleware, auth=auth)

    for router in (health.router, metrics_api.router, ingest.router, runs.router, alerts.router, webhooks.router,
                   silences.router):
        app.include_router(router)

    _add_error_handlers(app)

    def openapi():
        if app.openapi_schema:
            return app.openapi_schema
        schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
        comps = schema.setdefault("components", {}).setdefault("schemas", {})
        batch = IngestBatchIn.model_json_schema(ref_template="#/components/schemas/{model}")
        comps.update(batch.pop("$defs", {}))
        comps["IngestBatchIn"] = batch
        app.openapi_schema = schema
        return schema

    app.openapi = openapi

    if mount_dashboard:
        # Mounted last so every API route above wins; the Dash app gets the rest.
        _mount_dashboard(app, database, settings)
    return app


def _finish_deletes(database: Database, gate) -> None:
    """Deletes a stopped server left half-done (runs marked deleted, rows still there) are finished in the
    background: the runs stay hidden and refused meanwhile (server/lifecycle/delete.py)."""
    import threading

    from sqlalchemy import select

    from gradwatch.server.lifecycle.delete import purge_pending
    from gradwatch.server.storage.models import Run

    with database.sessionmaker() as session:
        if session.scalar(select(Run.id).where(Run.deleted_at.is_not(None)).limit(1)) is None:
            return

    def work():
        try:
            purge_pending(database.write_sessionmaker, gate=gate)
        except Exception:  # noqa: BLE001 - the next start finishes it
            log.exception("finishing an interrupted delete failed; the next start tries again")

    threading.Thread(target=work, name="gradwatch-finish-deletes", daemon=True).start()


def _add_error_handlers(app: FastAPI) -> None:
    """Values the database cannot hold are the client's problem (422), on every route; a heavy read the
    server has no budget for now is answered 429/503 with ``Retry-After``."""
    from fastapi.responses import JSONResponse
    from sqlalchemy.exc import DataError, StatementError

    async def out_of_range(request, exc):
        return JSONResponse({"detail": f"a value is out of range or cannot be stored: {type(exc).__name__}"},
                            status_code=422)

    async def statement_error(request, exc):
        if isinstance(exc, DataError) or isinstance(getattr(exc, "orig", None), (OverflowError, ValueError)):
            return await out_of_range(request, exc)
        raise exc

    async def busy(request, exc: HeavyReadBusy):
        # the heavy-read budget is taken (429: too many already waiting; 503: the wait ran out)
        return JSONResponse({"detail": str(exc)}, status_code=exc.status,
                            headers={"Retry-After": str(exc.retry_after_s)})

    app.add_exception_handler(HeavyReadBusy, busy)
    app.add_exception_handler(OverflowError, out_of_range)
    app.add_exception_handler(DataError, out_of_range)
    app.add_exception_handler(StatementError, statement_error)


def _mount_dashboard(app: FastAPI, database: Database, settings: Settings) -> None:
    from a2wsgi import WSGIMiddleware

    try:
        from gradwatch.dashboard import create_dash

        def deliveries_queued() -> None:     # the worker exists once the lifespan has started
            worker = getattr(app.state, "delivery_worker", None)
            if worker is not None:
                worker.wake()

        dash_app = create_dash(database.sessionmaker, settings, deliveries_queued=deliveries_queued,
                               live_news=app.state.live_news, write_sessionmaker=database.write_sessionmaker,
                               write_gate=app.state.write_gate)
    except Exception as e:  # noqa: BLE001 - the API must keep serving even if the dashboard cannot load
        log.exception("dashboard failed to load; serving the API only")
        from fastapi.responses import PlainTextResponse
        from starlette.routing import Mount

        message = f"gradwatch dashboard failed to load: {type(e).__name__}: {e}"

        async def unavailable(scope, receive, send):
            await PlainTextResponse(message, status_code=503)(scope, receive, send)

        app.router.routes.append(Mount("/", app=unavailable))
        return
    # more threads than a2wsgi's 10: the run pages' live callbacks park in them (server/ingest/live_news.py)
    app.mount("/", WSGIMiddleware(dash_app.server, workers=DASHBOARD_THREADS))
