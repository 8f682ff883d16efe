"""Runs and their data: ``/api/v1/runs``, series, layer matrix, events, checkpoints, rewinds, multi-run series."""
from __future__ import annotations

from contextlib import contextmanager
from typing import Annotated, Iterator, Optional

from fastapi import APIRouter, HTTPException, Path, Query, Request
from fastapi.responses import JSONResponse as _StdJSONResponse, StreamingResponse

from gradwatch.server import queries
from gradwatch.server.lifecycle import delete as lifecycle_delete, sizes
from gradwatch.server.wire.numbers import encode_float
from gradwatch.server.wire.schemas import (
    CheckpointListOut, DeletedRunOut, DeleteOut, EventListOut, LayerMatrixOut, RewindListOut,
    RunDetailOut, RunListOut, SeriesMultiOut, SeriesOut, StorageOut,
)
from gradwatch.server.access.scope import in_scope
from gradwatch.server.api.deps import ReadScopeDep, SessionDep, SettingsDep
from gradwatch.server.api.layer_matrix_json import layer_matrix_json

router = APIRouter(tags=["runs"])


class JSONResponse(_StdJSONResponse):
    """orjson when installed: a 500 x 150 heatmap serialises in ~10 ms instead of ~100 ms.
    Non-finite floats are already wire strings here, so both encoders give the same JSON."""

    def render(self, content) -> bytes:
        try:
            import orjson
        except ImportError:
            return super().render(content)
        return orjson.dumps(content)

StepParam = Annotated[Optional[int], Query(ge=0, le=2**62)]
# -1: a sharded run's combined row (server/storage/ranks.py): the full parameters' norms and the global grad norm
RankParam = Annotated[int, Query(ge=-1, le=1_000_000)]
RunId = Annotated[int, Path(ge=0, le=2**62)]


def _series_out(s: SeriesOut) -> dict:
    """The series' JSON, written here: thousands of points, each float encoded once (no serializer per item)."""
    return {"run_id": s.run_id, "signal": s.signal, "rank": s.rank, "bucket_size": s.bucket_size,
            "steps": [{"step": p.step, "min": encode_float(p.min), "max": encode_float(p.max), "last": encode_float(p.last),
                       "count": p.count, "nonfinite": p.nonfinite} for p in s.points]}


@contextmanager
def _refusals_as_422(param: str) -> Iterator[None]:
    """A query's refusal as a 422: an unknown signal (named after the query parameter that gave it), or an
    answer that would be too large (server/queries/ bounds every read)."""
    try:
        yield
    except queries.UnknownSignal as e:
        raise HTTPException(422, f"{param}: {e}") from None
    except queries.RequestTooLarge as e:
        raise HTTPException(422, str(e)) from None


def _check_run(session, scope: Optional[str], run_id: int) -> None:
    """404 for a run that does not exist or that the caller's token may not read."""
    project = queries.run_project(session, run_id=run_id)
    if project is None or not in_scope(scope, project):
        raise HTTPException(404, f"run {run_id} not found")


@router.get("/api/v1/runs", response_model=RunListOut)
def list_runs(session: SessionDep, settings: SettingsDep, scope: ReadScopeDep,
              project: Optional[str] = None, status: Optional[str] = None, name: Optional[str] = None) -> RunListOut:
    if scope is not None:
        if project is not None and not in_scope(scope, project):
            return RunListOut(runs=[])
        project = scope
    runs = queries.list_runs(session, project=project, status=status, name=name, stall_seconds=settings.stall_seconds)
    size = sizes.run_bytes(session, [r.id for r in runs])
    for r in runs:
        r.bytes = size.get(r.id)
    return RunListOut(runs=runs)


@router.get("/api/v1/runs/{run_id}", response_model=RunDetailOut, responses={404: {"description": "no such run"}})
def get_run(run_id: RunId, session: SessionDep, settings: SettingsDep, scope: ReadScopeDep) -> RunDetailOut:
    _check_run(session, scope, run_id)
    r = queries.get_run(session, run_id=run_id, stall_seconds=settings.stall_seconds)
    if r is None:
        raise HTTPException(404, f"run {run_id} not found")
    coverage = queries.list_events(session, run_id=run_id, kind="attention_coverage")
    measured = coverage[-1].data.get("measured") if coverage and isinstance(coverage[-1].data, dict) else None
    r.bytes = sizes.run_bytes(session, [run_id]).get(run_id)
    r.signals = queries.list_signals(session, run_id=run_id)
    r.attention_modules = measured
    return r


@router.get("/api/v1/runs/{run_id}/ranks", responses={404: {"description": "no such run"}})
def get_ranks(run_id: RunId, session: SessionDep, scope: ReadScopeDep, start: StepParam = None, end: StepParam = None,
              limit: Annotated[int, Query(ge=1, le=100_000)] = 1000) -> JSONResponse:
    """Which ranks sent which steps; a sharded run's steps still missing a rank (no combined values yet)."""
    _check_run(session, scope, run_id)
    c = queries.rank_coverage(session, run_id=run_id, start=start, end=end, limit=limit)
    if c is None:
        raise HTTPException(404, f"run {run_id} not found")
    meta = {m["rank"]: m for m in (queries.rank_meta(session, run_id=run_id) or {}).get("ranks", [])}
    # where each rank runs (host, local rank, device), as its agent's meta said
    ranks = [{**vars(r), **{k: v for k, v in meta.get(r.rank, {}).items() if k != "rank"}} for r in c.ranks]
    return JSONResponse({"run_id": c.run_id, "world_size": c.world_size, "combined": c.combined,
                         "ranks": ranks, "incomplete": c.incomplete})


@router.get("/api/v1/runs/{run_id}/rank-matrix",
            responses={404: {"description": "no such run"},
                       422: {"description": "unknown signal, or the answer would be too large"}})
def get_rank_matrix(run_id: RunId, session: SessionDep, scope: ReadScopeDep,
                    signals: Annotated[list[str], Query(min_length=1, max_length=20)],
                    start: StepParam = None, end: StepParam = None,
                    max_steps: Annotated[int, Query(ge=1, le=10_000)] = 300,
                    ranks: Annotated[Optional[list[Annotated[int, Query(ge=-1, le=1_000_000)]]],
                                     Query(max_length=10_000)] = None) -> JSONResponse:
    """Rank × step matrices of step signals (``?signals=loss&signals=step_time``), one shared step axis:
    per cell the bucket's min, max, last value and non-finite count; rows are ``ranks`` (default every rank)."""
    _check_run(session, scope, run_id)
    with _refusals_as_422("signals"):
        out = queries.get_rank_matrix(session, run_id=run_id, signals=signals, start=start, end=end,
                                      max_steps=max_steps, ranks=ranks)
    if out is None:
        raise HTTPException(404, f"run {run_id} not found")

    def grid(rows):
        return [[encode_float(v) for v in row] for row in rows]
    return JSONResponse({"run_id": run_id, "matrices": [
        {"signal": m.signal, "bucket_size": m.bucket_size, "steps": m.steps, "ranks": m.ranks, "min": grid(m.min),
         "max": grid(m.max), "last": grid(m.last), "nonfinite": m.nonfinite} for m in out]})


@router.get("/api/v1/runs/{run_id}/series", response_model=SeriesOut,
            responses={404: {"description": "no such run"}, 422: {"description": "unknown signal"}})
def get_series(run_id: RunId, session: SessionDep, scope: ReadScopeDep,
               signal: Annotated[str, Query(min_length=1, max_length=210)] = "loss",
               start: StepParam = None, end: StepParam = None,
               max_points: Annotated[int, Query(ge=1, le=100_000)] = 2000,
               since: Annotated[Optional[int], Query(ge=-1, le=2**62)] = None, rank: RankParam = 0) -> JSONResponse:
    """A signal in at most ``max_points`` buckets (min/max/last/count/nonfinite); ``since`` for live tails."""
    _check_run(session, scope, run_id)
    with _refusals_as_422("signal"):
        s = queries.get_series(session, run_id=run_id, signal=signal, start=start, end=end,
                               max_points=max_points, since=since, rank=rank)
    return JSONResponse(_series_out(s))


@router.get("/api/v1/series", response_model=SeriesMultiOut,
            responses={404: {"description": "no such run"},
                       422: {"description": "unknown signal, a run or signal named twice, or too many points"}})
def get_series_multi(session: SessionDep, scope: ReadScopeDep,
                     runs: Annotated[list[Annotated[int, Query(ge=0, le=2**62)]], Query(min_length=1, max_length=50)],
                     signals: Annotated[list[str], Query(min_length=1, max_length=20)],
                     start: StepParam = None, end: StepParam = None,
                     max_points: Annotated[int, Query(ge=1, le=100_000)] = 2000, rank: RankParam = 0) -> JSONResponse:
    """Several runs' series on one shared step axis: ``?runs=1&runs=2&signals=loss``."""
    for run_id in runs:
        _check_run(session, scope, run_id)
    with _refusals_as_422("signals"):
        out = queries.get_series_multi(session, run_ids=runs, signals=signals, start=start, end=end,
                                       max_points=max_points, rank=rank)
    return JSONResponse({"series": [_series_out(s) for s in out]})


@router.get("/api/v1/runs/{run_id}/layers", response_model=LayerMatrixOut,
            responses={404: {"description": "no such run"}, 422: {"description": "the answer would be too large"}})
def get_layer_matrix(run_id: RunId, session: SessionDep, scope: ReadScopeDep,
                     stat: Annotated[str, Query(pattern=r"^[A-Za-z0-9_.:/-]{1,32}$")] = "grad_norm",
                     start: StepParam = None, end: StepParam = None,
                     max_steps: Annotated[int, Query(ge=1, le=10_000)] = 500,
                     max_layers: Annotated[int, Query(ge=1, le=10_000)] = 200,
                     rank: RankParam = 0,
                     agg: Annotated[str, Query(pattern="^(max|min|mean|last)$")] = "max") -> StreamingResponse:
    """Layer × step matrix of one per-layer statistic, downsampled on both axes. Streamed: encoded from the
    cells' arrays a block of rows at a time (server/api/layer_matrix_json.py)."""
    _check_run(session, scope, run_id)
    with _refusals_as_422("stat"):
        m = queries.get_layer_matrix(session, run_id=run_id, stat=stat, start=start, end=end, max_steps=max_steps,
                                     max_layers=max_layers, rank=rank, agg=agg)
    if m is None:
        raise HTTPException(404, f"run {run_id} not found")
    session.close()     # the cells are read: the connection goes back to the pool while the answer is sent
    return StreamingResponse(layer_matrix_json(m), media_type="application/json")


@router.get("/api/v1/runs/{run_id}/events", response_model=EventListOut,
            responses={404: {"description": "no such run"}})
def list_events(run_id: RunId, session: SessionDep, scope: ReadScopeDep,
                kind: Annotated[Optional[str], Query(max_length=64)] = None) -> EventListOut:
    _check_run(session, scope, run_id)
    return EventListOut(events=queries.list_events(session, run_id=run_id, kind=kind))


@router.get("/api/v1/runs/{run_id}/checkpoints", response_model=CheckpointListOut,
            responses={404: {"description": "no such run"}})
def list_checkpoints(run_id: RunId, session: SessionDep, scope: ReadScopeDep) -> CheckpointListOut:
    """The run's checkpoints in step order (docs/checkpoints.md)."""
    _check_run(session, scope, run_id)
    return CheckpointListOut(run_id=run_id, checkpoints=queries.list_checkpoints(session, run_id=run_id))


@router.get("/api/v1/runs/{run_id}/rewinds", response_model=RewindListOut,
            responses={404: {"description": "no such run"}})
def list_rewinds(run_id: RunId, session: SessionDep, scope: ReadScopeDep) -> RewindListOut:
    """The run's rewinds (the agent's Rewind policy: ``rewind`` events) in step order, each with the
    sentence that says what it did (docs/api.md)."""
    _check_run(session, scope, run_id)
    return RewindListOut(run_id=run_id, rewinds=queries.list_rewinds(session, run_id=run_id))


# ----------------------------------------------------------------------------- deleting (server/lifecycle)

_DELETE_RESPONSES = {404: {"description": "no such run or project (or another project's)"},
                     409: {"description": "a run is still sending; stop it or pass force=true"}}


def _delete_out(report: lifecycle_delete.DeleteReport, project: Optional[str] = None) -> DeleteOut:
    return DeleteOut(dry_run=report.dry_run, project=project, rows=report.rows, seconds=round(report.seconds, 3),
                     bytes=sum(report.bytes.get(r.id, 0) for r in report.runs),
                     runs=[DeletedRunOut(id=r.id, project=r.project, name=r.name, status=r.status,
                                         last_seen=r.last_seen, bytes=report.bytes.get(r.id, 0)) for r in report.runs])


@contextmanager
def _still_sending_as_409() -> Iterator[None]:
    try:
        yield
    except lifecycle_delete.RunStillSending as e:
        raise HTTPException(409, str(e)) from None


@router.delete("/api/v1/runs/{run_id}", response_model=DeleteOut, responses=_DELETE_RESPONSES)
def delete_run(run_id: RunId, request: Request, session: SessionDep, settings: SettingsDep, scope: ReadScopeDep,
               force: bool = False, dry_run: bool = False) -> DeleteOut:
    """Delete a run and every row it owns (docs/deployment.md, "Deleting runs"). A run still sending is
    refused (409) unless ``force``; its later batches are refused with 410. ``dry_run``: what would go."""
    _check_run(session, scope, run_id)
    runs = lifecycle_delete.select_runs(session, run_ids=[run_id], stall_seconds=settings.stall_seconds)
    session.rollback()              # end the read transaction before the long write
    if not runs:
        raise HTTPException(404, f"run {run_id} not found")
    with _still_sending_as_409():
        report = lifecycle_delete.delete_runs(request.app.state.database, runs=runs, force=force, dry_run=dry_run,
                                              stall_seconds=settings.stall_seconds, gate=request.app.state.write_gate)
    return _delete_out(report)


@router.delete("/api/v1/runs", response_model=DeleteOut,
               responses={**_DELETE_RESPONSES, 422: {"description": "no filter given"}})
def delete_runs(request: Request, session: SessionDep, settings: SettingsDep, scope: ReadScopeDep,
                project: Annotated[Optional[str], Query(max_length=200)] = None,
                name: Annotated[Optional[str], Query(max_length=200)] = None,
                status: Annotated[Optional[str], Query(pattern="^(running|stalled|finished|crashed)$")] = None,
                older_than_s: Annotated[Optional[float], Query(ge=0, le=1e10)] = None,
                force: bool = False, dry_run: bool = False) -> DeleteOut:
    """Delete the runs matching every filter given: ``project``, ``name`` (a shell pattern: ``exp-*``),
    ``status`` (running | stalled | finished | crashed), ``older_than_s`` (last seen longer ago than that).
    At least one filter is required. A run still sending among them refuses the whole delete (409) unless
    ``force``. ``dry_run``: what would go, and its estimated bytes."""
    if project is None and name is None and status is None and older_than_s is None:
        raise HTTPException(422, "give at least one filter (project, name, status, older_than_s); "
                                 "to delete a whole project use DELETE /api/v1/projects/{name}")
    if scope is not None:
        if project is not None and not in_scope(scope, project):
            return DeleteOut(dry_run=dry_run, runs=[], bytes=0, rows=0, seconds=0.0)
        project = scope
    runs = lifecycle_delete.select_runs(session, project=project, name=name, status=status,
                                        older_than_s=older_than_s, stall_seconds=settings.stall_seconds)
    session.rollback()
    with _still_sending_as_409():
        report = lifecycle_delete.delete_runs(request.app.state.database, runs=runs, force=force, dry_run=dry_run,
                                              stall_seconds=settings.stall_seconds, gate=request.app.state.write_gate)
    return _delete_out(report)


@router.delete("/api/v1/projects/{project}", response_model=DeleteOut, responses=_DELETE_RESPONSES)
def delete_project(project: Annotated[str, Path(min_length=1, max_length=200)], request: Request,
                   settings: SettingsDep, scope: ReadScopeDep, force: bool = False, dry_run: bool = False) -> DeleteOut:
    """Delete a project: every run (as ``DELETE /api/v1/runs/{id}``), then its tokens, silences, rule
    overrides, webhook endpoints and notification groups, then the project itself."""
    if not in_scope(scope, project):
        raise HTTPException(404, f"project {project!r} not found")
    with _still_sending_as_409():
        report = lifecycle_delete.delete_project(request.app.state.database, project=project, force=force,
                                                 dry_run=dry_run, stall_seconds=settings.stall_seconds,
                                                 gate=request.app.state.write_gate)
    if report is None:
        raise HTTPException(404, f"project {project!r} not found")
    return _delete_out(report, project=project)


@router.get("/api/v1/storage", response_model=StorageOut)
def get_storage(session: SessionDep) -> StorageOut:
    """The database's size (server/lifecycle/sizes.py): bytes, and on SQLite the free part of the file."""
    size = sizes.database_size(session)
    return StorageOut(dialect=size.dialect, bytes=size.bytes, free_bytes=size.free_bytes)
