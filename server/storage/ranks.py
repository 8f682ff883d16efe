"""Ranks of a sharded run combined: the full parameters' values and the step's totals, per step.

Under FSDP / DTensor every rank holds a piece of each sharded parameter, and the
agent measures only what the rank holds, because combining them in the training
job would be a collective the agent must never add. The signal table
(agent/signals.py, "Sharded runs") declares each per-rank form: the statistic of
a rank's pieces (``grad_norm_local`` …), the record part it carries
(``pieces_of``), how a parameter's pieces combine (``combine``: ``l2``, the root
of the sum of squares, for norms; ``sum`` for counts; ``max``) and the step part
that is its total over the parameters (``total``). Each rank also sends, once,
which piece of each parameter it holds (``meta.param_shards``: ``[index, count]``,
kept in ``rank_layouts``). This module does the reduction on the server, inside
the ingest transaction of the batch that brings a step's last rank, as one loop
over those declarations (:func:`combine_step`); it names no statistic:

* per parameter, one value per distinct piece ``index`` (the lowest rank
  holding it: replicas, e.g. HSDP's replicate dimension, are never counted
  twice), combined over the ``count`` pieces (for ``l2`` squared in float64,
  summed, the root taken). A piece that no rank reported, or a layout that
  cannot be combined (``count`` 0), leaves that parameter "not measured";
* a total over the parameters, combined the same way over the measured ones; a
  parameter some rank reported but that is not measured (a piece missing, a
  layout that cannot be combined) leaves the total unknown, as a total of part
  of the model is not the total (parameters with no value on any rank, e.g. no
  grad, are left out, as ``clip_grad_norm_`` leaves them out);
* a derived signal of the combined row (update ratio, EMA divergence,
  ``clipped``, the share of zero grad elements) from the combined parts, by the
  function a single process's agent computes it with (agent/derived.py): ratios
  of pieces do not combine, their numerators and denominators do;
* any other signal the combined row holds (``combined``, ``clip_max_norm``) is
  the same on every rank: rank 0's.

The result is written as the run's **combined row**, rank ``COMBINED_RANK``
(-1), through the same write path as any rank's steps (steps, layer stats,
rollups, rules). A step whose ranks have not all arrived has no combined row:
it is incomplete (``server/queries.py``, ``rank_coverage``), never a number
computed from part of the ranks. Batches of one run are serialised by the
run's row lock, so exactly one batch sees a step complete; a step that already
has its combined row is never combined again.
"""
from __future__ import annotations

import math
from typing import Any, Optional

import numpy as np
from sqlalchemy import func, select, text
from sqlalchemy.orm import Session

from gradwatch.agent.derived import DERIVE
from gradwatch.agent.signals import (EXTRA_BASE, LAYER_PART_PREFIX, LAYER_STATS, PIECES, STEP_SIGNAL_NAMES,
                                     STEP_SIGNALS, step_signal)

from gradwatch.server.storage.models import LayerStat, RankLayout, Run, Step, StepRanks
from gradwatch.server.wire.numbers import NULL_F32_BITS, extra_values, null_mask
from gradwatch.server.wire.schemas import StepIn

COMBINED_RANK = -1
# what the server keeps of each rank's meta, per rank (runs.config["_ranks"], server/ingest/write.py: the run
# header's hosts and devices); the rest of a rank's meta is merged run-wide into runs.config["_meta"]
RANK_META_KEYS = ("host", "local_rank", "device", "pid")


_RANK_SETS: dict[tuple[str, str, int], Any] = {}


def among_ranks(column, world_size: int):
    """``column IN (0, 1, ..., world_size - 1)``, for the steps' and layer statistics' rank columns.

    Their keys lead with (run, rank): a rank *range* (``rank >= 0 AND rank < W``) with a step range makes
    SQLite and PostgreSQL alike walk every stored step of the run's ranks (a cost that grew with the run's
    length: 13 ms a query at 64 ranks x 3,000 steps), where an IN list seeks each rank's steps (0.08 ms).
    Literal integers, built once per size: 256 bound parameters would be expanded on every execution."""
    key = (column.table.name, column.name, world_size)
    clause = _RANK_SETS.get(key)
    if clause is None:
        listed = ", ".join(str(r) for r in range(max(world_size, 1)))
        clause = _RANK_SETS[key] = text(f"{column.table.name}.{column.name} IN ({listed})")
    return clause


def steps_sent(session: Session, *, run_id: int, world_size: int, lo: int, hi: int) -> dict[int, int]:
    """{step: how many of the run's ranks have a row for it} for the steps ``lo..hi``."""
    return dict(session.execute(
        select(Step.step, func.count()).where(Step.run_id == run_id, among_ranks(Step.rank, world_size),
                                              Step.step >= lo, Step.step <= hi).group_by(Step.step)).all())


def count_sent(session: Session, *, run_id: int, steps: list[int]) -> dict[int, int]:
    """Count one more rank for each of ``steps`` (steps the batch's rank has just stored, each once) and
    return {step: how many of the run's ranks have stored it now}, in one statement (``step_ranks``).

    What ``steps_sent`` counts from the steps' rows, for the steps the batch stored: a step of the batch
    that this rank had stored already is not among them, so it is not completed twice. Plain SQL with
    the step numbers inlined (integers): one statement, no bound list to expand, the same on SQLite
    (3.35+, for RETURNING) and PostgreSQL."""
    if not steps:
        return {}
    run = int(run_id)
    values = ", ".join(f"({run}, {int(s)}, 1)" for s in steps)
    return dict(session.connection().exec_driver_sql(
        f"INSERT INTO {StepRanks.__tablename__} (run_id, step, ranks) VALUES {values} "
        f"ON CONFLICT (run_id, step) DO UPDATE SET ranks = {StepRanks.__tablename__}.ranks + 1 "
        "RETURNING step, ranks").all())


def all_ranks_sent(sent: dict[int, int], steps, world_size: int) -> list[bool]:
    """For each of ``steps``: whether all ``world_size`` ranks have sent it (``sent``: ``steps_sent``).
    The batch that makes it so is the one that completes the step: the run's lock serialises a run's
    batches, so exactly one batch sees it."""
    return [sent.get(s, 0) >= world_size for s in steps]


def rank_hosts(run_config: Optional[dict]) -> dict[str, Any]:
    """Each rank's host (by rank as a string), from where ingest keeps every rank's own meta."""
    return {r: meta.get("host") for r, meta in ((run_config or {}).get("_ranks") or {}).items()}
# what the ranks send of their pieces: the signal table's per-rank statistics
_LOCAL_STATS = tuple(s.name for s in PIECES)
_NOTHING_MEASURED = dict.fromkeys(STEP_SIGNAL_NAMES)   # a combined row's signals, before it fills some
_TOTALS = {s.total for s in PIECES if s.total}
# what the combined row holds: its per-layer statistics (measured: a combined part; derived: from such parts)
_LAYER_OUT = tuple((s.name, s.derived_from) for s in LAYER_STATS if s.combined)
# ... its step signals: derived from the totals and rank 0's values, or a total, in the table's order
_STEP_DERIVED = tuple(s for s in STEP_SIGNALS if s.combined and s.derived_from)
_STEP_TOTALS = tuple(s.name for s in STEP_SIGNALS if s.combined and not s.derived_from and s.name in _TOTALS)
# ... and the rest, the same on every rank: rank 0's value (with the step inputs of derived ones that are
# step signals, not totals), read from its column or its steps.extra slot
_FROM_RANK0 = tuple(dict.fromkeys(
    [s.name for s in STEP_SIGNALS if s.combined and not s.derived_from and s.name not in _TOTALS]
    + [n for s in _STEP_DERIVED for n in s.derived_from if n not in _TOTALS and n not in _STEP_TOTALS]))
_RANK0_COLUMNS = tuple(n for n in _FROM_RANK0 if step_signal(n).column)
_RANK0_EXTRAS = tuple((n, step_signal(n).id - EXTRA_BASE) for n in _FROM_RANK0 if not step_signal(n).column)


_PROGRESS_QUERIES: dict[int, Any] = {}


def rank_progress(session: Session, run: Run) -> dict[int, tuple[int, float]]:
    """rank -> (its latest stored step, that step's time): one index descent per rank (the steps' primary
    key is (run, rank, step)), not a scan of the run's steps, all in one statement. Ranks that sent no step
    are absent.

    One statement, not one per rank: the silent-rank rule (F4) reads it holding the run's lock, and 256
    round trips to PostgreSQL held it 100-300 ms, every batch of the run waiting behind it (bench/ingest.py
    --ranks 256: a second of p50 300 ms every few seconds). The ranks are literals, built once per size."""
    world = max(run.world_size or 1, 1)
    query = _PROGRESS_QUERIES.get(world)
    if query is None:
        listed = ", ".join(f"({r})" for r in range(world))
        last = "SELECT s.{col} FROM steps s WHERE s.run_id = :run AND s.rank = r.rank ORDER BY s.step DESC LIMIT 1"
        query = _PROGRESS_QUERIES[world] = text(
            f"WITH r(rank) AS (VALUES {listed}) "
            f"SELECT r.rank, ({last.format(col='step')}) AS step, ({last.format(col='time')}) AS time FROM r")
    return {int(r): (int(step), float(t)) for r, step, t in session.execute(query, {"run": run.id})
            if step is not None}


def record_layout(session: Session, *, run: Run, rank: int, world_size: int, shards: Optional[list],
                  now: float) -> None:
    """Keep the layout a rank sent in its meta (once per process; a changed one replaces the old)."""
    if shards is None:
        return
    shards = [[int(i), int(c)] for i, c in shards]
    row = session.get(RankLayout, (run.id, rank))
    if row is None:
        session.add(RankLayout(run_id=run.id, rank=rank, world_size=world_size, shards=shards, updated_at=now))
    elif row.shards != shards or row.world_size != world_size:
        row.shards, row.world_size, row.updated_at = shards, world_size, now


class _Plan:
    """Which rank's value of each parameter is counted: static per run, derived from the layouts."""

    def __init__(self, layouts: dict[int, list], world_size: int):
        self.world_size = W = world_size
        n = max((len(s) for s in layouts.values()), default=0)
        self.n = n
        index = np.full((W, n), -1, dtype=np.int64)
        count = np.zeros((W, n), dtype=np.int64)
        for r, shards in layouts.items():
            if 0 <= r < W and shards:
                arr = np.asarray(shards, dtype=np.int64).reshape(-1, 2)
                index[r, :len(arr)], count[r, :len(arr)] = arr[:, 0], arr[:, 1]
        self.pick = np.zeros((W, n), dtype=bool)
        self.known = np.zeros(n, dtype=bool)
        # a column per parameter, numpy per column rather than Python per (rank, parameter): 38,400 of
        # those at 256 ranks x 150 parameters took 25 ms of every batch that completed a step
        agreed = (count == count[:1]).all(axis=0) & (count[0] != 0) if W else np.zeros(n, dtype=bool)
        for j in np.flatnonzero(agreed).tolist():   # else the ranks disagree on the cut, or it is Partial
            # the lowest rank of each piece; replicas of it are left out
            pieces, first = np.unique(index[:, j], return_index=True)
            self.pick[first, j] = True
            self.known[j] = len(pieces) == count[0, j] and pieces[0] >= 0

    def full(self, blobs: dict[int, bytes], combine: str) -> "_Part":
        """One per-rank statistic of every rank, its pieces combined into each full parameter's."""
        W, n = self.world_size, self.n
        vals = np.zeros((W, n))
        missing = np.ones((W, n), dtype=bool)
        for r, blob in blobs.items():
            arr = np.frombuffer(blob, dtype="<f4")[:n]
            k = len(arr)
            vals[r, :k] = arr.astype(np.float64)
            missing[r, :k] = null_mask(arr)
        vals[missing] = 0.0
        if combine == "max":
            acc = np.where(self.pick, vals, -np.inf).max(axis=0, initial=-np.inf)
        else:
            acc = np.where(self.pick, vals * vals if combine == "l2" else vals, 0.0).sum(axis=0)
        measured = self.known & ~(self.pick & missing).any(axis=0)
        # parameters some rank has a value for (the rest, e.g. without a grad, are left out of totals)
        return _Part(acc, measured, (~missing).any(axis=0), combine)


class _Part:
    """A part combined over the ranks' pieces: per parameter, the accumulated pieces (for ``l2`` the sum
    of squares, so that a total is the root of their sum, not of re-squared roots) and which are measured."""

    def __init__(self, acc: np.ndarray, measured: np.ndarray, reported: np.ndarray, combine: str):
        self.acc, self.measured, self.reported, self.combine = acc, measured, reported, combine

    def values(self) -> np.ndarray:
        return np.sqrt(self.acc) if self.combine == "l2" else self.acc

    def total(self) -> Optional[float]:
        """Over the parameters: None when none is measured, or one that some rank reported is not."""
        ok = self.measured
        if not ok.any() or (self.reported & ~ok).any():
            return None
        if self.combine == "max":
            return float(self.acc[ok].max())
        t = float(self.acc[ok].sum())
        return math.sqrt(t) if self.combine == "l2" else t


def _f32(values: np.ndarray, measured: np.ndarray) -> bytes:
    out = values.astype("<f4")
    out.view("<u4")[~measured] = NULL_F32_BITS
    return out.tobytes()


def combine_steps(session: Session, *, run: Run, steps: list[int], sent: Optional[dict[int, int]] = None) -> list:
    """The combined rows (``StepIn``) of those of ``steps`` that are now complete: every rank of the run
    has sent them, and they have no combined row yet. Empty for runs without a sharded layout.
    ``sent``: ``steps_sent`` of the run's world size over (at least) ``steps``, when the caller has it."""
    if not steps:
        return []
    lo, hi = min(steps), max(steps)
    # most batches complete no step (only a step's last rank does): find that out from the steps' key
    # before reading every rank's layout (256 JSON rows of a shard a parameter at 256 ranks)
    if sent is None:
        sent = steps_sent(session, run_id=run.id, world_size=run.world_size or 1, lo=lo, hi=hi)
    if not any(all_ranks_sent(sent, steps, run.world_size or 1)):
        return []
    layouts = dict(session.execute(select(RankLayout.rank, RankLayout.shards)
                                   .where(RankLayout.run_id == run.id)).all())
    W = max([run.world_size or 1] + [r + 1 for r in layouts])
    if not layouts or W < 2 or any(r not in layouts for r in range(W)):
        return []      # not sharded, or a rank whose layout has not arrived yet: its batch will complete them
    wanted = set(steps)
    counts = (sent if W == (run.world_size or 1) else
              steps_sent(session, run_id=run.id, world_size=W, lo=lo, hi=hi)).items()
    done = set(session.scalars(select(Step.step).where(Step.run_id == run.id, Step.rank == COMBINED_RANK,
                                                       Step.step >= lo, Step.step <= hi)))
    complete = sorted(s for s, c in counts if c == W and s in wanted and s not in done)
    if not complete:
        return []
    c_lo, c_hi = complete[0], complete[-1]
    keep = set(complete)
    times: dict[int, float] = {}
    rank0: dict[int, dict[str, Any]] = {}
    # Core, not the ORM's row loading: these read a row per rank and step (and stat), 5,000 rows for
    # 10 steps of 256 ranks, where the ORM's per-row bookkeeping took most of the time
    conn = session.connection()
    cols = [getattr(Step, n) for n in _RANK0_COLUMNS] + ([Step.extra] if _RANK0_EXTRAS else [])
    for r, s, t, *row in conn.execute(
            select(Step.rank, Step.step, Step.time, *cols).where(
                Step.run_id == run.id, among_ranks(Step.rank, W), Step.step >= c_lo, Step.step <= c_hi)).all():
        if s in keep:
            times[s] = max(times.get(s, t), t)
            if r == 0:
                rank0[s] = _rank0_values(row)
    blobs: dict[int, dict[str, dict[int, bytes]]] = {}
    for r, s, stat, blob in conn.execute(
            select(LayerStat.rank, LayerStat.step, LayerStat.stat, LayerStat.values).where(
                LayerStat.run_id == run.id, LayerStat.stat.in_(_LOCAL_STATS), among_ranks(LayerStat.rank, W),
                LayerStat.step >= c_lo, LayerStat.step <= c_hi)).all():   # one fetch, not a fetch a row
        if s in keep and blob:
            blobs.setdefault(s, {}).setdefault(stat, {})[r] = bytes(blob)
    plan = _Plan(layouts, W)
    return [combine_step(plan, s, times[s], blobs.get(s, {}), rank0.get(s, {})) for s in complete]


def _rank0_values(row) -> dict[str, Any]:
    """Rank 0's values of the signals the combined row takes from it (its columns, then its extra blob)."""
    out = {n: v for n, v in zip(_RANK0_COLUMNS, row) if v is not None}
    if _RANK0_EXTRAS and row[len(_RANK0_COLUMNS)]:
        extra, ok = extra_values(row[len(_RANK0_COLUMNS)])
        out.update({n: float(extra[i]) for n, i in _RANK0_EXTRAS if i < len(extra) and ok[i]})
    return out


def combine_step(plan: _Plan, step: int, time: float, by_stat: dict[str, dict[int, bytes]],
                 rank0: dict[str, Any]):
    """One complete step's combined row (``StepIn``), from every rank's per-rank statistics (``by_stat``:
    stat -> rank -> float32 blob) and rank 0's values, by the signal table's declarations alone."""
    parts: dict[str, _Part] = {}         # record part ("layers.grad_norm") -> combined over the pieces
    for stat in PIECES:
        if by_stat.get(stat.name):
            parts[stat.pieces_of] = plan.full(by_stat[stat.name], stat.combine)
    step_parts: dict[str, Any] = dict(rank0)   # step part -> value: the totals, and rank 0's values
    for stat in PIECES:
        if stat.total and stat.pieces_of in parts:
            step_parts[stat.total] = parts[stat.pieces_of].total()
    fields: dict[str, Any] = {**_NOTHING_MEASURED, "step": step, "time": time, "custom": {}, "layers": {}}
    layers = fields["layers"]
    for name, inputs in _LAYER_OUT:
        if not inputs:
            part = parts.get(LAYER_PART_PREFIX + name)
            if part is not None:
                layers[name] = _f32(part.values(), part.measured)
        elif all(n in parts for n in inputs):
            got = DERIVE[name](*[parts[n].values().tolist() for n in inputs])
            measured = np.logical_and.reduce([parts[n].measured for n in inputs]) & \
                np.array([v is not None for v in got], dtype=bool)
            layers[name] = _f32(np.array([np.nan if v is None else v for v in got], dtype=np.float64), measured)
    for name in _STEP_TOTALS:
        fields[name] = step_parts.get(name)
    for name in _FROM_RANK0:
        if name in fields:
            fields[name] = rank0.get(name)
    for sig in _STEP_DERIVED:   # in the table's order: a derived signal may read one derived before it
        value = DERIVE[sig.name](*[fields[n] if fields.get(n) is not None else step_parts.get(n)
                                   for n in sig.derived_from])
        if value is not None:
            fields[sig.name] = value
    return StepIn.model_construct(**fields)
