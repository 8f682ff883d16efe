"""``POST /api/v1/ingest``: one batch, one transaction (docs/wire-format.md)."""
from __future__ import annotations

import gzip
import json
import time
import zlib
from typing import Any

from fastapi import APIRouter, HTTPException, Request
from fastapi.concurrency import run_in_threadpool
from pydantic import ValidationError
from sqlalchemy.exc import DataError, IntegrityError, OperationalError

from ..ingest import ingest_batch
from ..schemas import IngestBatchIn, IngestResult
from .deps import SettingsDep, get_read_scope

try:  # 3-5x faster JSON parsing when installed (server extra)
    import orjson as _orjson
except ImportError:  # pragma: no cover
    _orjson = None

router = APIRouter(tags=["ingest"])


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
        d = zlib.decompressobj(16 + zlib.MAX_WBITS)
        try:
            raw = d.decompress(raw, limit + 1)
        except zlib.error as e:
            raise HTTPException(400, f"body is not valid gzip: {e}") from None
        if len(raw) > limit or d.unconsumed_tail:
            raise HTTPException(413, f"decompressed body exceeds the limit of {limit} bytes")
    elif encoding not in ("", "identity"):
        raise HTTPException(415, f"unsupported Content-Encoding {encoding!r}: use gzip or none")
    if _orjson is not None:
        try:
            return _orjson.loads(raw)
        except _orjson.JSONDecodeError:
            pass  # maybe the bare NaN / Infinity tokens Python's json writes: the stdlib parser takes them
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise HTTPException(400, f"body is not valid JSON: {e}") from None


_BATCH_SCHEMA_REF = {"$ref": "#/components/schemas/IngestBatchIn"}


@router.post(
    "/api/v1/ingest",
    response_model=IngestResult,
    openapi_extra={"requestBody": {"required": True, "content": {"application/json": {"schema": _BATCH_SCHEMA_REF}}}},
    responses={400: {"description": "not JSON / not gzip"}, 401: {"description": "token missing or invalid"},
               403: {"description": "token of another project"}, 413: {"description": "body too large"},
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
        if token_project is not None and batch.project != token_project:
            raise HTTPException(403, f"project: this token is for project {token_project!r}, "
                                     f"not {batch.project!r}")
        with app.state.write_gate:
            return _write(app, batch, settings)

    metrics = app.state.metrics
    try:
        outcome = await run_in_threadpool(work)
    except HTTPException:
        metrics.observe_batch(seconds=time.perf_counter() - started, rejected=True)
        raise
    if outcome.alerts_enqueued:
        app.state.delivery_worker.wake()
    metrics.observe_batch(seconds=time.perf_counter() - started, steps=outcome.accepted,
                          values=outcome.values_written, rows=outcome.rows_written, duplicate=outcome.duplicate)
    return IngestResult(run_id=outcome.run_id, accepted=outcome.accepted, duplicate=outcome.duplicate)


def _write(app, batch: IngestBatchIn, settings):
    database = app.state.database
    for attempt in range(5):
        with database.write_sessionmaker() as session:
            try:
                outcome = ingest_batch(session, batch=batch, settings=settings, now=time.time())
                if outcome.duplicate:
                    session.rollback()
                else:
                    session.commit()
                return outcome
            except DataError as e:
                session.rollback()
                raise HTTPException(422, f"a value cannot be stored: {str(e.orig).splitlines()[0]}") from None
            except (IntegrityError, OperationalError) as e:
                # A concurrent replica won a race (new project / run) or PostgreSQL
                # broke a deadlock: the transaction is rolled back whole; retry it.
                session.rollback()
                if attempt == 4:
                    raise
                time.sleep(0.01 * (attempt + 1))
    raise AssertionError("unreachable")
