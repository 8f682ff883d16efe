"""Runs and their data: ``/api/v1/runs``, series, layer matrix, events, multi-run series."""
from __future__ import annotations

from typing import Annotated, Optional

from fastapi import APIRouter, HTTPException, Path, Query
from fastapi.responses import JSONResponse as _StdJSONResponse

from .. import queries
from ..numbers import to_wire
from ..schemas import (
    EventListOut, EventOut, LayerMatrixOut, RunDetailOut, RunListOut, RunOut, SeriesMultiOut, SeriesOut,
)
from .deps import ReadScopeDep, SessionDep, SettingsDep

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
RankParam = Annotated[int, Query(ge=0, le=1_000_000)]
RunId = Annotated[int, Path(ge=0, le=2**62)]


def _run_out(r: queries.RunSummary, cls=RunOut, **extra):
    return cls(id=r.id, project=r.project, name=r.name, status=r.status, last_step=r.last_step,
               last_loss=to_wire(r.last_loss), started_at=r.started_at, last_seen=r.last_seen,
               open_alerts=r.open_alerts, health=r.health, world_size=r.world_size, **extra)


def _series_out(s: queries.Series) -> dict:
    """SeriesOut as a plain dict: thousands of points skip per-item model validation."""
    return {"run_id": s.run_id, "signal": s.signal, "rank": s.rank, "bucket_size": s.bucket_size,
            "steps": [{"step": p.step, "min": to_wire(p.min), "max": to_wire(p.max), "last": to_wire(p.last),
                       "count": p.count, "nonfinite": p.nonfinite} for p in s.points]}


def _check_run(session, scope: Optional[str], run_id: int) -> None:
    """404 for a run that does not exist or that the caller's token may not read."""
    project = queries.run_project(session, run_id=run_id)
    if project is None or (scope is not None and project != scope):
        raise HTTPException(404, f"run {run_id} not found")


@router.get("/api/v1/runs", response_model=RunListOut)
def list_runs(session: SessionDep, settings: SettingsDep, scope: ReadScopeDep,
              project: Optional[str] = None, status: Optional[str] = None, name: Optional[str] = None) -> RunListOut:
    if scope is not None:
        if project is not None and project != scope:
            return RunListOut(runs=[])
        project = scope
    runs = queries.list_runs(session, project=project, status=status, name=name, stall_seconds=settings.stall_seconds)
    return RunListOut(runs=[_run_out(r) for r in runs])


@router.get("/api/v1/runs/{run_id}", response_model=RunDetailOut, responses={404: {"description": "no such run"}})
def get_run(run_id: RunId, session: SessionDep, settings: SettingsDep, scope: ReadScopeDep) -> RunDetailOut:
    _check_run(session, scope, run_id)
    r = queries.get_run(session, run_id=run_id, stall_seconds=settings.stall_seconds)
    if r is None:
        raise HTTPException(404, f"run {run_id} not found")
    return _run_out(r, RunDetailOut, param_names=r.param_names, module_names=r.module_names,
                    bn_names=r.bn_names, config=r.config)


@router.get("/api/v1/runs/{run_id}/series", response_model=SeriesOut,
            responses={404: {"description": "no such run"}, 422: {"description": "unknown signal"}})
def get_series(run_id: RunId, session: SessionDep, scope: ReadScopeDep,
               signal: Annotated[str, Query(min_length=1, max_length=210)] = "loss",
               start: StepParam = None, end: StepParam = None,
               max_points: Annotated[int, Query(ge=1, le=100_000)] = 2000,
               since: Annotated[Optional[int], Query(ge=-1, le=2**62)] = None, rank: RankParam = 0) -> JSONResponse:
    """A signal in at most ``max_points`` buckets (min/max/last/count/nonfinite); ``since`` for live tails."""
    _check_run(session, scope, run_id)
    try:
        s = queries.get_series(session, run_id=run_id, signal=signal, start=start, end=end,
                               max_points=max_points, since=since, rank=rank)
    except queries.UnknownSignal as e:
        raise HTTPException(422, f"signal: {e}") from None
    return JSONResponse(_series_out(s))


@router.get("/api/v1/series", response_model=SeriesMultiOut,
            responses={404: {"description": "no such run"}, 422: {"description": "unknown signal"}})
def get_series_multi(session: SessionDep, scope: ReadScopeDep,
                     runs: Annotated[list[Annotated[int, Query(ge=0, le=2**62)]], Query(min_length=1, max_length=50)],
                     signals: Annotated[list[str], Query(min_length=1, max_length=20)],
                     start: StepParam = None, end: StepParam = None,
                     max_points: Annotated[int, Query(ge=1, le=100_000)] = 2000, rank: RankParam = 0) -> JSONResponse:
    """Several runs' series on one shared step axis: ``?runs=1&runs=2&signals=loss``."""
    for run_id in runs:
        _check_run(session, scope, run_id)
    try:
        out = queries.get_series_multi(session, run_ids=runs, signals=signals, start=start, end=end,
                                       max_points=max_points, rank=rank)
    except queries.UnknownSignal as e:
        raise HTTPException(422, f"signals: {e}") from None
    return JSONResponse({"series": [_series_out(s) for s in out]})


@router.get("/api/v1/runs/{run_id}/layers", response_model=LayerMatrixOut,
            responses={404: {"description": "no such run"}})
def get_layer_matrix(run_id: RunId, session: SessionDep, scope: ReadScopeDep,
                     stat: Annotated[str, Query(pattern=r"^[A-Za-z0-9_.:/-]{1,32}$")] = "grad_norm",
                     start: StepParam = None, end: StepParam = None,
                     max_steps: Annotated[int, Query(ge=1, le=10_000)] = 500,
                     max_layers: Annotated[int, Query(ge=1, le=10_000)] = 200,
                     rank: RankParam = 0,
                     agg: Annotated[str, Query(pattern="^(max|min|mean|last)$")] = "max") -> JSONResponse:
    """Layer × step matrix of one per-layer statistic, downsampled on both axes."""
    _check_run(session, scope, run_id)
    m = queries.get_layer_matrix(session, run_id=run_id, stat=stat, start=start, end=end, max_steps=max_steps,
                                 max_layers=max_layers, rank=rank, agg=agg)
    if m is None:
        raise HTTPException(404, f"run {run_id} not found")
    return JSONResponse({"run_id": m.run_id, "stat": m.stat, "rank": m.rank, "agg": m.agg,
                         "bucket_size": m.bucket_size, "layer_group_size": m.layer_group_size, "steps": m.steps,
                         "layers": m.layers, "values": [[to_wire(v) for v in row] for row in m.values]})


@router.get("/api/v1/runs/{run_id}/events", response_model=EventListOut,
            responses={404: {"description": "no such run"}})
def list_events(run_id: RunId, session: SessionDep, scope: ReadScopeDep,
                kind: Annotated[Optional[str], Query(max_length=64)] = None) -> EventListOut:
    _check_run(session, scope, run_id)
    return EventListOut(events=[EventOut(**vars(e)) for e in queries.list_events(session, run_id=run_id, kind=kind)])
