"""``POST /api/v1/ingest``: one batch, one transaction (docs/wire-format.md)."""
from __future__ import annotations

import json
import time
import zlib
from typing import Any

from fastapi import APIRouter, HTTPException, Request
from fastapi.concurrency import run_in_threadpool
from pydantic import ValidationError
from sqlalchemy import bindparam, select
from sqlalchemy.exc import DataError, IntegrityError, OperationalError

from gradwatch.server.ingest.write import ingest_batch
from gradwatch.server.lifecycle.delete import RunDeleted
from gradwatch.server.storage.models import Alert
from gradwatch.server.ingest.pacing import reply_pace
from gradwatch.server.queries import alert_out
from gradwatch.server.wire.schemas import AlertOut, IngestBatchIn, IngestResult
from gradwatch.server.api.deps import SettingsDep, check_scope, get_read_scope

try:  # 3-5x faster JSON parsing when installed (server extra)
    import orjson as _orjson
except ImportError:  # pragma: no cover
    _orjson = None

router = APIRouter(tags=["ingest"])

MAX_JSON_VALUES = 2_000_000     # array elements + object members in one body (~65-130 MB parsed at most)


def format_validation_error(err: ValidationError) -> str:
    """``steps[3].loss: expected a number…``; one line per problem (first 10)."""
    parts = []
    for e in err.errors()[:10]:
        loc = ""
        for item in e["loc"]:
            loc += f"[{item}]" if isinstance(item, int) else (f".{item}" if loc else str(item))
        msg = e["msg"].removeprefix("Value error, ")
        parts.append(f"{loc or 'body'}: {msg}")
    more = len(err.errors()) - 10
    if more > 0:
        parts.append(f"… and {more} more")
    return "; ".join(parts)


async def read_body(request: Request, *, limit: int) -> bytes:
    """The raw body, refusing (413) anything over ``limit`` bytes before reading it all."""
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise HTTPException(413, f"request body is {declared} bytes; the limit is {limit}")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise HTTPException(413, f"request body exceeds the limit of {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def decode_body(raw: bytes, encoding: str, *, limit: int) -> Any:
    """gzip / identity -> JSON (NaN / Infinity tokens accepted). Raises HTTPException."""
    encoding = encoding.strip().lower()
    if encoding in ("gzip", "x-gzip"):
        raw = _gunzip(raw, limit)
    elif encoding not in ("", "identity"):
        raise HTTPException(415, f"unsupported Content-Encoding {encoding!r}: use gzip or none")
    elif raw.count(b",") > MAX_JSON_VALUES:
        raise _too_many_values()
    if _orjson is not None:
        try:
            return _orjson.loads(raw)
        except _orjson.JSONDecodeError:
            pass  # maybe the bare NaN / Infinity tokens Python's json writes: the stdlib parser takes them
    try:
        return json.loads(raw)
    except RecursionError:
        raise HTTPException(400, "body is not valid JSON: nested too deeply") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise HTTPException(400, f"body is not valid JSON: {e}") from None


# Parsed objects take 10-30x the bytes of their text (a list of numbers: ~32 bytes per `0.5,`), so the
# number of values is bounded before parsing: every array element and object member after the first of
# its container follows a comma. An agent's batch (layer arrays as "f32:" strings) holds a few thousand.
_GUNZIP_CHUNK = 1 << 20


def _too_many_values() -> HTTPException:
    return HTTPException(413, f"body holds more than {MAX_JSON_VALUES:,} JSON values; send smaller batches "
                              f"(layer arrays as \"f32:\" strings, docs/wire-format.md)")


def _gunzip(raw: bytes, limit: int) -> bytes:
    """Decompress in 1 MiB pieces, counting JSON values as they come: a gzip bomb of numbers is refused
    after a few MiB of work, not after the whole decompressed limit (each piece is a C-level scan)."""
    d = zlib.decompressobj(16 + zlib.MAX_WBITS)
    out: list[bytes] = []
    size = values = 0
    data = raw
    try:
        while True:
            piece = d.decompress(data, _GUNZIP_CHUNK)
            size += len(piece)
            values += piece.count(b",")
            if size > limit:
                raise HTTPException(413, f"decompressed body exceeds the limit of {limit} bytes")
            if values > MAX_JSON_VALUES:
                raise _too_many_values()
            out.append(piece)
            data = d.unconsumed_tail
            if d.eof or (not data and not piece):     # the end, or no input left and nothing more came
                break
    except zlib.error as e:
        raise HTTPException(400, f"body is not valid gzip: {e}") from None
    if not d.eof or d.unused_data:
        raise HTTPException(400, "body is not valid gzip: " + ("it is cut short" if not d.eof
                                                                else "bytes follow the end of the gzip stream"))
    return b"".join(out)


_BATCH_SCHEMA_REF = {"$ref": "#/components/schemas/IngestBatchIn"}


@router.post(
    "/api/v1/ingest",
    response_model=IngestResult,
    openapi_extra={"requestBody": {"required": True, "content": {"application/json": {"schema": _BATCH_SCHEMA_REF}}}},
    responses={400: {"description": "not JSON / not gzip"}, 401: {"description": "token missing or invalid"},
               403: {"description": "token of another project"},
               410: {"description": "the run was deleted; a late batch of it is refused"}, 413: {"description": "body too large"},
               422: {"description": "a field is invalid; detail names it"}},
)
async def ingest(request: Request, settings: SettingsDep) -> IngestResult:
    """Write one batch of steps (and layer stats, events) for one run and rank.

    Idempotent on ``batch_id``; ``Content-Encoding: gzip`` accepted.
    """
    started = time.perf_counter()
    app = request.app
    try:
        raw = await read_body(request, limit=settings.max_body_bytes)
    except HTTPException:
        app.state.metrics.observe_batch(seconds=time.perf_counter() - started, rejected=True)
        raise
    token_project = get_read_scope(request)

    def work():
        body = decode_body(raw, request.headers.get("content-encoding", ""), limit=settings.max_decoded_bytes)
        if not isinstance(body, dict):
            raise HTTPException(422, "body: expected a JSON object")
        try:
            batch = IngestBatchIn.model_validate(body)
        except ValidationError as e:
            raise HTTPException(422, format_validation_error(e)) from None
        check_scope(token_project, batch.project, field="project")
        with app.state.write_gate:
            return (*_write(app, batch, settings), batch.rank, batch.world_size)

    metrics = app.state.metrics
    try:
        outcome, news, rank, world_size = await run_in_threadpool(work)
    except HTTPException:
        metrics.observe_batch(seconds=time.perf_counter() - started, rejected=True)
        raise
    if not outcome.duplicate:
        app.state.live_news.published(outcome.run_id)   # committed: wake the run pages waiting on it
    if outcome.alerts_enqueued or outcome.alerts_routed:
        # outbox rows to send now, or a group that comes due after its group_wait: the worker's next
        # round reads the earliest due time and sleeps until exactly then, not for its whole poll interval
        app.state.delivery_worker.wake()
    metrics.observe_batch(seconds=time.perf_counter() - started, steps=outcome.accepted,
                          values=outcome.values_written, rows=outcome.rows_written, duplicate=outcome.duplicate)
    result = IngestResult(run_id=outcome.run_id, accepted=outcome.accepted, duplicate=outcome.duplicate,
                          step_shift=outcome.step_shift, already_stored=outcome.already_stored,
                          # rank 0 only: the headline charts read it, and a watched 256-rank run sending
                          # 10 batches/s per rank would be a load no page is worth (server/ingest/live_news.py)
                          live=rank == 0 and app.state.live_news.watching(outcome.run_id),
                          pace=reply_pace(world_size, rank, app.state.lock_hold.seconds,
                                          run_age_s=time.time() - outcome.run_started_at))
    if news is not None:
        result.alerts, result.alerts_cursor = news
    return result


def _write(app, batch: IngestBatchIn, settings):
    database = app.state.database
    for attempt in range(5):
        with database.write_sessionmaker() as session:
            try:
                now = time.time()
                outcome = ingest_batch(session, batch=batch, settings=settings, now=now)
                # read in the batch's own transaction (one indexed query): it sees the alerts this
                # batch just opened or changed, before the commit makes them visible to anyone else
                news = (None if batch.alerts_after is None else
                        _loop_alerts(session, run_id=outcome.run_id, after=batch.alerts_after, now=now))
                if outcome.duplicate:
                    session.rollback()
                else:
                    session.commit()
                    # the run's lock is released with the commit: how long it was held paces the ranks
                    app.state.lock_hold.observe(time.perf_counter() - outcome.locked_at)
                return outcome, news
            except RunDeleted as e:
                session.rollback()
                raise HTTPException(410, str(e)) from None
            except DataError as e:
                session.rollback()
                raise HTTPException(422, f"a value cannot be stored: {str(e.orig).splitlines()[0]}") from None
            except (IntegrityError, OperationalError):
                # A concurrent replica won a race (new project / run) or PostgreSQL
                # broke a deadlock: the transaction is rolled back whole; retry it.
                session.rollback()
                if attempt == 4:
                    raise
                time.sleep(0.01 * (attempt + 1))
    raise AssertionError("unreachable")


# ----------------------------------------------------------------------------- alerts in the loop

# How far back of the agent's cursor a reply looks again. The cursor is a batch's clock reading (`now`), and
# an alert's updated_at is the clock reading of the transaction that wrote it, which may commit after a
# later-started batch was answered: another rank's batch of the run waiting on the run's row lock, a timer
# rule of the delivery worker, an acknowledgement. Anything committed within this many seconds of its clock
# reading still reaches the agent; the agent drops what it has already seen (by id and updated_at).
ALERTS_LOOKBACK_S = 10.0
# the most alerts one reply carries (a run with more news than this gets the newest; the rest are on the
# dashboard): a reply stays small however noisy the run
ALERTS_PER_REPLY = 50

# Core columns, not ORM objects: no identity-map bookkeeping per row (bench/loop_alerts.py; docs/performance.md,
# "Alerts in the ingest reply"). Each row becomes the one alert shape, ``queries.alert_out``.
_ALERT_COLUMNS = tuple(c for c in Alert.__table__.c)
_RUN_ALERTS_SINCE = (select(*_ALERT_COLUMNS)
                     .where(Alert.run_id == bindparam("run_id"), Alert.updated_at >= bindparam("since"))
                     .order_by(Alert.updated_at.desc(), Alert.id.desc()).limit(ALERTS_PER_REPLY))


def _loop_alerts(session, *, run_id: int, after: float, now: float) -> tuple[list[AlertOut], float]:
    """The run's alerts created or changed since ``after`` (a previous reply's cursor), and the next cursor.

    ``after == 0`` (a process's first batch) starts at this batch: a run resumed under its name does not
    hear its earlier processes' alerts as news (they are on the dashboard), only what happens from now on.
    Uses the ``run_id`` index; a run has tens of alerts, not thousands. The session autoflushes first, so
    the alerts this batch changed are read as changed (they are flushed at the commit anyway)."""
    since = now if after == 0 else min(after, now) - ALERTS_LOOKBACK_S
    return [alert_out(row) for row in session.execute(_RUN_ALERTS_SINCE, {"run_id": run_id, "since": since})], now
