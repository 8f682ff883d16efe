"""Runs and their charts: the runs list, one run, series, ranks side by side, layer heatmaps, and the
live wait for new steps."""
from __future__ import annotations

import math
from typing import Any, Optional, Sequence

from gradwatch.dashboard.gateway.context import (plain, run_visible, scoped, server, session, signed_in_project,
                                                 stall_seconds, unwrap)


def _series(result: Any) -> dict:
    """A series (``schemas.SeriesOut``) as ``{"bucket_size", "steps": [bucket dicts]}`` (the read API's shape)."""
    points = getattr(result, "points", None)
    if points is not None:
        # Thousands of points per page: spelled out, this is ~10x cheaper than the generic _plain walk.
        return {"bucket_size": result.bucket_size or 1,
                "steps": [{"step": p.step, "min": p.min, "max": p.max, "last": p.last, "count": p.count,
                           "nonfinite": p.nonfinite} for p in points]}
    s = plain(result) or {}
    return {"bucket_size": s.get("bucket_size", 1) or 1, "steps": list(s.get("points", s.get("steps")) or [])}


def list_runs(*, project: Optional[str] = None, status: Optional[str] = None, name: Optional[str] = None) -> list[dict]:
    """The runs, each with ``bytes``: its estimated size (server/lifecycle/sizes.py)."""
    from gradwatch.server import queries
    from gradwatch.server.lifecycle import sizes
    with session() as s:
        runs = unwrap(queries.list_runs(s, project=scoped(project), status=status or None, name=name or None,
                                         stall_seconds=stall_seconds()), "runs")
        size = sizes.run_bytes(s, [r["id"] for r in runs])
    for r in runs:
        r["bytes"] = size.get(r["id"])
    return runs


def get_run(run_id: int) -> Optional[dict]:
    from gradwatch.server import queries
    with session() as s:
        if not run_visible(s, run_id):
            return None
        return plain(queries.get_run(s, run_id=run_id, stall_seconds=stall_seconds()))


def steps_after(last: Optional[int], cursor: Optional[float]) -> bool:
    """Whether a run whose last step is ``last`` holds steps after a page's ``cursor`` (None: none
    drawn yet).

    >>> steps_after(None, None), steps_after(5, None), steps_after(5, 5), steps_after(6, 5)
    (False, True, False, True)
    """
    return last is not None and (cursor is None or last > cursor)


def wait_for_steps(run_id: int, cursor: Optional[float]) -> Optional[bool]:
    """Park until ``run_id`` holds steps after ``cursor`` (server/ingest/live_news.py): True when it does, False
    after the wait (about a second); None at once when this process cannot park the caller (no LiveNews,
    too many pages waiting): it polls instead. Also marks the run as watched, so its agents send faster."""
    if server.live_news is None:
        return None
    run = get_run(run_id)
    if run is None:   # no such run, or another project's (auth): nothing to wait for, nobody to speed up
        return None
    if run.get("status") in ("finished", "crashed"):
        return None   # an ended run's page polls (a resumed run starts sending again), holding no thread

    if steps_after(run.get("last_step"), cursor):
        server.live_news.watch(run_id)
        return True
    # the recheck also finds the steps another replica stored: no wake-up reaches this process for them
    return server.live_news.wait(run_id, recheck=lambda: steps_after((get_run(run_id) or {}).get("last_step"), cursor))


def _one_series(run_id: int, signal: str, start, end, max_points: int, since, rank: int = 0) -> dict:
    from gradwatch.server import queries
    with session() as s:
        return _series(queries.get_series(s, run_id=run_id, signal=signal, start=start, end=end,
                                          max_points=max_points, since=since, rank=rank))


def get_series(run_id: int, signals: Sequence[str], *, start: Optional[float] = None, end: Optional[float] = None,
               max_points: int = 1000, since: Optional[int] = None, since_by: Optional[dict[str, int]] = None,
               rank: int = 0, sources: Optional[dict[str, int]] = None) -> dict[str, dict]:
    """``{signal: {"bucket_size": n, "steps": [bucket, ...]}}`` for several signals of one run.

    ``start`` / ``end`` may be floats (a zoomed chart's range); ``since``
    returns the raw steps after that step (a live tail; ``since_by`` gives
    some signals their own, each signal's tail is its own query). Signals are read
    from ``rank``, or from the rank ``sources`` names for them (a sharded
    run's grad norm from its combined row, -1).

    A range (or the whole run) is one ``queries.get_series_multi`` call: the
    rollup partials, which hold every step signal, are read once for all the
    signals instead of once per signal (a 1M-step run: ~45 ms instead of
    ~200 ms for the run page's 12). Live tails are raw rows, read in
    parallel, one session per signal: the database does the work with the GIL
    released.
    """
    from gradwatch.server import queries

    start = None if start is None else max(0, int(math.floor(start)))
    end = None if end is None else int(math.ceil(end))
    if signed_in_project() is not None:
        with session() as s:
            if not run_visible(s, run_id):
                return {sig: {"bucket_size": 1, "steps": []} for sig in signals}
    source = {sig: (sources or {}).get(sig, rank) for sig in signals}
    if since is None:
        by_rank: dict[int, list[str]] = {}
        for sig in signals:
            by_rank.setdefault(source[sig], []).append(sig)
        got = {}
        with session() as s:
            for r, sigs in by_rank.items():
                out = queries.get_series_multi(s, run_ids=[run_id], signals=sigs, start=start, end=end,
                                               max_points=max_points, rank=r)
                got.update({sig: _series(one) for sig, one in zip(sigs, out)})
        return {sig: got[sig] for sig in signals}
    after = {sig: (since_by or {}).get(sig, since) for sig in signals}
    if len(signals) == 1:
        return {signals[0]: _one_series(run_id, signals[0], start, end, max_points, after[signals[0]],
                                        source[signals[0]])}
    futures = {sig: _pool().submit(_one_series, run_id, sig, start, end, max_points, after[sig], source[sig])
               for sig in signals}
    return {sig: f.result() for sig, f in futures.items()}


def get_rank_meta(run_id: int) -> Optional[dict]:
    """``{"world_size", "combined", "ranks": [{"rank", "host", "local_rank", "device", "pid"}]}``, or None."""
    from gradwatch.server import queries
    with session() as s:
        if not run_visible(s, run_id):
            return None
        return queries.rank_meta(s, run_id=run_id)


def get_rank_matrix(run_id: int, signals: Sequence[str], *, start: Optional[float] = None,
                    end: Optional[float] = None, max_steps: int = 300) -> dict[str, dict]:
    """``{signal: {"bucket_size", "steps", "ranks", "min", "max", "last", "nonfinite"}}``: every rank of
    the run on one step axis (``queries.get_rank_matrix``)."""
    from gradwatch.server import queries
    start = None if start is None else max(0, int(math.floor(start)))
    end = None if end is None else int(math.ceil(end))
    with session() as s:
        if not run_visible(s, run_id):
            return {}
        out = queries.get_rank_matrix(s, run_id=run_id, signals=list(signals), start=start, end=end,
                                      max_steps=max_steps) or []
    return {m.signal: {"bucket_size": m.bucket_size, "steps": m.steps, "ranks": m.ranks, "min": m.min, "max": m.max,
                       "last": m.last, "nonfinite": m.nonfinite} for m in out}


_executor = None


def _pool():
    global _executor
    if _executor is None:
        from concurrent.futures import ThreadPoolExecutor
        _executor = ThreadPoolExecutor(max_workers=4, thread_name_prefix="gradwatch-dash-read")
    return _executor


def get_layer_matrix(run_id: int, stat: str, *, start: Optional[float] = None, end: Optional[float] = None,
                     max_steps: int = 300, max_layers: int = 48, rank: int = 0) -> dict:
    """``{"steps": [...], "names": [...], "values": [[one per step] per layer], "layer_group_size": n}``."""
    from gradwatch.server import queries
    start = None if start is None else max(0, int(math.floor(start)))
    end = None if end is None else int(math.ceil(end))
    with session() as s:
        if not run_visible(s, run_id):
            return {"steps": [], "names": [], "values": []}
        m = queries.get_layer_matrix(s, run_id=run_id, stat=stat, start=start, end=end,
                                     max_steps=max_steps, max_layers=max_layers, rank=rank)
    if m is None:
        return {"steps": [], "names": [], "values": [], "layer_group_size": 1, "bucket_size": 1}
    # the matrix holds plain lists already: no _plain walk over its cells (~15k per heatmap)
    return {"steps": list(m.steps), "names": list(m.layers), "values": list(m.values),
            "layer_group_size": m.layer_group_size, "bucket_size": m.bucket_size}
