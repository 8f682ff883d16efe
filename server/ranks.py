"""Ranks of a sharded run combined: the full parameters' norms and the global grad norm, per step.

Under FSDP / DTensor every rank holds a piece of each sharded parameter, and the
agent measures only what the rank holds (``grad_norm_local``,
``layers.grad_norm_local`` / ``weight_norm_local`` / ``update_norm_local``;
agent/wire.py), because combining them in the training job would be a
collective the agent must never add. Each rank also sends, once, which piece
of each parameter it holds (``meta.param_shards``: ``[index, count]``, kept in
``rank_layouts``). This module does the reduction on the server, inside the
ingest transaction of the batch that brings a step's last rank:

* per parameter, one value per distinct piece ``index`` (the lowest rank
  holding it: replicas, e.g. HSDP's replicate dimension, are never counted
  twice), squared in float64 and summed over the ``count`` pieces; the square
  root is the full parameter's norm. A piece that no rank reported, or a layout
  that cannot be combined (``count`` 0), leaves that parameter "not measured";
* the global grad norm is the norm of the full parameters' norms, exactly as
  ``clip_grad_norm_`` computes it (parameters with no grad on any rank are
  left out, as clipping leaves them out);
* update ratio = ‖Δθ‖ / ‖θ‖ of the full parameter, from the combined numerator
  and denominator (ratios of pieces do not combine);
* EMA divergence ‖θ_ema − θ‖ / ‖θ‖ over the parameters the EMA holds, the same
  way (``ema_diff_local`` / ``ema_ref_local``);
* ``clipped``: the combined grad norm above rank 0's ``clip_max_norm``.

The update ratio, EMA divergence and ``clipped`` come from the functions a single
process's agent computes them with (agent/derived.py), from the combined norms.
* the share of gradient elements exactly zero, per parameter and over the
  model, from each distinct piece's zero count and element count
  (``grad_zero_count_local`` / ``numel_local``; counts are added, not squared).

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

from gradwatch.agent.derived import clipped, ema_divergence, update_ratios
from gradwatch.agent.signals import STEP_SIGNAL_NAMES

from .models import LayerStat, RankLayout, Run, Step, StepRanks
from .numbers import NULL_F32_BITS, null_mask
from .schemas import StepIn

COMBINED_RANK = -1
# what the server keeps of each rank's meta, per rank (runs.config["_ranks"], server/ingest.py: the run
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
# what the ranks send -> what the combined row holds (update norms become update_ratio)
_LOCAL_STATS = ("grad_norm_local", "weight_norm_local", "update_norm_local", "ema_diff_local", "ema_ref_local",
                "grad_zero_count_local", "numel_local")
_NOTHING_MEASURED = dict.fromkeys(STEP_SIGNAL_NAMES)   # a combined row's signals, before it fills some


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

    def full_squares(self, blobs: dict[int, bytes]) -> tuple[np.ndarray, np.ndarray]:
        """(sum of squares of each full parameter, measured) from one statistic (a norm) of every rank."""
        return self._full(blobs, square=True)

    def full_sums(self, blobs: dict[int, bytes]) -> tuple[np.ndarray, np.ndarray]:
        """(sum over each full parameter's pieces, measured) from one statistic (a count) of every rank."""
        return self._full(blobs, square=False)

    def _full(self, blobs: dict[int, bytes], square: bool) -> tuple[np.ndarray, np.ndarray]:
        W, n = self.world_size, self.n
        vals = np.zeros((W, n))
        missing = np.ones((W, n), dtype=bool)
        for r, blob in blobs.items():
            arr = np.frombuffer(blob, dtype="<f4")[:n]
            k = len(arr)
            vals[r, :k] = arr.astype(np.float64)
            missing[r, :k] = null_mask(arr)
        vals[missing] = 0.0
        sq = np.where(self.pick, vals * vals if square else vals, 0.0).sum(axis=0)
        measured = self.known & ~(self.pick & missing).any(axis=0)
        return sq, measured


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
    max_norm: dict[int, Optional[float]] = {}
    # Core, not the ORM's row loading: these read a row per rank and step (and stat), 5,000 rows for
    # 10 steps of 256 ranks, where the ORM's per-row bookkeeping took most of the time
    conn = session.connection()
    for r, s, t, m in conn.execute(
            select(Step.rank, Step.step, Step.time, Step.clip_max_norm).where(
                Step.run_id == run.id, among_ranks(Step.rank, W), Step.step >= c_lo, Step.step <= c_hi)).all():
        if s in keep:
            times[s] = max(times.get(s, t), t)
            if m is not None and (s not in max_norm or r == 0):
                max_norm[s] = m
    blobs: dict[int, dict[str, dict[int, bytes]]] = {}
    for r, s, stat, blob in conn.execute(
            select(LayerStat.rank, LayerStat.step, LayerStat.stat, LayerStat.values).where(
                LayerStat.run_id == run.id, LayerStat.stat.in_(_LOCAL_STATS), among_ranks(LayerStat.rank, W),
                LayerStat.step >= c_lo, LayerStat.step <= c_hi)).all():   # one fetch, not a fetch a row
        if s in keep and blob:
            blobs.setdefault(s, {}).setdefault(stat, {})[r] = bytes(blob)
    plan = _Plan(layouts, W)
    out = []
    for s in complete:
        by_stat = blobs.get(s, {})
        fields: dict[str, Any] = {**_NOTHING_MEASURED, "step": s, "time": times[s], "custom": {}, "layers": {}}
        layers = fields["layers"]
        if by_stat.get("grad_norm_local"):
            sq, ok = plan.full_squares(by_stat["grad_norm_local"])
            layers["grad_norm"] = _f32(np.sqrt(sq), ok)
            # parameters no rank has a grad for are left out, as clip_grad_norm_ leaves them out;
            # one only partly reported (or a layout that cannot be combined) makes the total unknown
            seen = np.zeros(plan.n, dtype=bool)
            for blob in by_stat["grad_norm_local"].values():
                arr = np.frombuffer(blob, dtype="<f4")[:plan.n]
                seen[:len(arr)] |= ~null_mask(arr)
            if ok.any() and not (seen & ~ok).any():
                total = math.sqrt(float(sq[ok].sum()))
                fields["grad_norm"] = total
                m = max_norm.get(s)
                if m is not None:
                    fields["clip_max_norm"] = m
                    was_clipped = clipped(total, m)
                    if was_clipped is not None:
                        fields["clipped"] = was_clipped
        if by_stat.get("weight_norm_local"):
            wsq, wok = plan.full_squares(by_stat["weight_norm_local"])
            layers["weight_norm"] = _f32(np.sqrt(wsq), wok)
            if by_stat.get("update_norm_local"):
                usq, uok = plan.full_squares(by_stat["update_norm_local"])
                ratio = np.array(update_ratios(np.sqrt(usq).tolist(), np.sqrt(wsq).tolist()), dtype=np.float64)
                layers["update_ratio"] = _f32(ratio, wok & uok)
        if by_stat.get("ema_diff_local") and by_stat.get("ema_ref_local"):
            # ‖θ_ema − θ‖ / ‖θ‖ over the full parameters the EMA holds (each piece once, as the norms above)
            dsq, dok = plan.full_squares(by_stat["ema_diff_local"])
            rsq, rok = plan.full_squares(by_stat["ema_ref_local"])
            ok = dok & rok
            if ok.any():
                fields["ema_divergence"] = ema_divergence(math.sqrt(float(dsq[ok].sum())),
                                                          math.sqrt(float(rsq[ok].sum())))
        if by_stat.get("grad_zero_count_local") and by_stat.get("numel_local"):
            zeros, zok = plan.full_sums(by_stat["grad_zero_count_local"])
            numel, nok = plan.full_sums(by_stat["numel_local"])
            ok = zok & nok & (numel > 0)
            if ok.any():
                with np.errstate(divide="ignore", invalid="ignore"):
                    layers["grad_zero_fraction"] = _f32(zeros / numel, ok)
                fields["grad_zero_fraction"] = float(zeros[ok].sum() / numel[ok].sum())
        out.append(StepIn.model_construct(**fields))
    return out
