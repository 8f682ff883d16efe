"""The write path: every INSERT/UPDATE the server makes for ingest.

``ingest_batch`` runs inside the caller's transaction: it writes the steps,
per-layer statistics, custom scalars and events of one batch, updates the
run, then calls the rule engine and the webhook outbox, exactly as
docs/architecture.md describes. The caller commits (or rolls back) once.

Idempotency: the batch id is inserted first; a batch id already present for
the same run means a retry, and nothing else is written (ids are scoped to
their run: another run's batch with the same id is a different batch). Rows are inserted with
``ON CONFLICT DO NOTHING`` so two replicas racing on the same steps (a retry
sent to another replica with a new connection) can neither double nor fail.
"""
from __future__ import annotations


import operator
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import numpy as np
from sqlalchemy import bindparam, select
from sqlalchemy.orm import Session

from gradwatch.agent.signals import COLUMN_SIGNALS, EXTRA_BASE, EXTRA_SIGNALS, ROLLUP_WIDTH, STEP_SIGNAL_NAMES

from gradwatch.server.forensics.rollback import advise_rollback
from gradwatch.server.forensics.rewinds import record_rewinds
from gradwatch.server.lifecycle.delete import next_run_id, refuse_if_deleted, run_deleted_error
from gradwatch.server.storage.compaction import raw_floor
from gradwatch.server.storage.db import dialect_insert
from gradwatch.server.storage.models import STEP_COLUMNS, IngestBatch, Project, Run, RunEvent, Step
from gradwatch.server.wire.numbers import NULL_F32_BITS, encode_json, extra_values, null_mask, pack_extra
from gradwatch.server.storage.projects import get_or_create_project
from gradwatch.server.storage.ranks import COMBINED_RANK, RANK_META_KEYS, combine_steps, count_sent, record_layout
from gradwatch.server.storage.rollups import layer_partials_by_stat, step_partials
from gradwatch.server.forensics.precursors import attach_precursors
from gradwatch.server.ingest.resume import add_history, apply_shift, session_shift
from gradwatch.server.rules.engine import evaluate_batch
from gradwatch.server.wire.schemas import EventIn, IngestBatchIn
from gradwatch.server.operations.settings import Settings
from gradwatch.server.routing.dispatch import route_alerts


@dataclass(frozen=True)
class IngestOutcome:
    run_id: int
    accepted: int
    duplicate: bool
    alerts_enqueued: int = 0
    # alerts handed to routing (raised, escalated, lead changed): their groups may now be due later
    # (group_wait), and the delivery worker is woken to look at the new due time rather than poll for it
    alerts_routed: int = 0
    values_written: int = 0
    rows_written: int = 0
    step_shift: int = 0
    already_stored: int = 0
    # perf_counter() when the run's row lock was granted: the caller times the hold up to its commit
    # (server/ingest/pacing.py: the ranks' pace follows it)
    locked_at: float = 0.0
    # the run's first batch (wall clock): a young run's ranks are paced as for their dearest batches
    run_started_at: float = 0.0


# Statements built once: constructing a SQLAlchemy expression costs more than running it on a small
# table, and these run on every batch.
_RUN_FOR_UPDATE = (select(Run).where(Run.project_id == bindparam("project_id"), Run.name == bindparam("name"))
                   .with_for_update())
# the usual batch: run and project both exist; one statement finds and locks the run
_RUN_OF_PROJECT_FOR_UPDATE = (select(Run, Project).join(Project, Project.id == Run.project_id)
                              .where(Project.name == bindparam("project"), Run.name == bindparam("name"))
                              .with_for_update(of=Run))
_STORED_STEPS = select(Step.step).where(Step.run_id == bindparam("run_id"), Step.rank == bindparam("rank"),
                                        Step.step >= bindparam("lo"), Step.step <= bindparam("hi"))


_BATCH_ID_INSERTS: dict[str, Any] = {}


def _batch_id_insert(session: Session):
    """INSERT … ON CONFLICT DO NOTHING RETURNING for the batch id, built once per dialect."""
    dialect = session.bind.dialect.name
    stmt = _BATCH_ID_INSERTS.get(dialect)
    if stmt is None:
        stmt = _BATCH_ID_INSERTS[dialect] = (
            dialect_insert(session, IngestBatch)
            .values(batch_id=bindparam("batch_id"), run_id=bindparam("run_id"), received_at=bindparam("received_at"),
                    step_count=bindparam("step_count"))
            .on_conflict_do_nothing(index_elements=["run_id", "batch_id"]).returning(IngestBatch.batch_id))
    return stmt


def _get_or_create_run(session: Session, *, project: Project, name: str, world_size: int, now: float) -> Run:
    # FOR UPDATE serialises batches of one run across replicas (PostgreSQL);
    # rule state is read-modify-write and needs it. SQLite has one writer anyway.
    run = session.scalars(_RUN_FOR_UPDATE, {"project_id": project.id, "name": name}).one_or_none()
    if run is not None:
        return run
    values = dict(project_id=project.id, name=name, status="running", started_at=now, last_seen=now,
                  world_size=world_size, param_names=[], module_names=[], bn_names=[], config={})
    if session.bind.dialect.name == "sqlite":
        # SQLite gives a new row the largest id + 1: a deleted run's id would be handed out again (a bookmark
        # of /runs/<id> showing another run). Ids continue after the deleted ones (PostgreSQL's sequence does).
        values["id"] = next_run_id(session)
    session.execute(dialect_insert(session, Run).values(**values).on_conflict_do_nothing(index_elements=["project_id", "name"]))
    return session.scalars(_RUN_FOR_UPDATE, {"project_id": project.id, "name": name}).one()


_STEP_COLUMNS = ("run_id", "rank", "step", "time", *STEP_COLUMNS, "nan_mask", "extra")
_SIGNALS_AT = slice(4, 4 + len(STEP_COLUMNS))          # the column signals' place in a step row
_BITS = tuple(1 << s.id for s in COLUMN_SIGNALS)           # each column signal's nan_mask bit
_NAN_BITS = np.array(_BITS, dtype=np.int64)
_EXTRA_NAMES = tuple(s.name for s in EXTRA_SIGNALS)
_EXTRA_SLOTS = tuple(s.id - EXTRA_BASE for s in EXTRA_SIGNALS)
_EXTRA_WIDTH = ROLLUP_WIDTH - EXTRA_BASE


# Every signal read off a step in one C-level call each (a step is one of thousands per batch). The
# extras' getter gives the value itself for one extra signal, a tuple for several, None for none.
_COLUMNS_OF = operator.attrgetter(*STEP_COLUMNS)
_EXTRAS_OF = operator.attrgetter(*_EXTRA_NAMES) if _EXTRA_NAMES else (lambda s: None)
_MANY_EXTRAS = len(_EXTRA_NAMES) > 1
_NO_EXTRAS = (None,) * len(_EXTRA_NAMES)


def _step_row(run_id: int, rank: int, s) -> tuple:
    values = _COLUMNS_OF(s)
    mask = 0
    for v, bit in zip(values, _BITS):
        if v is not None and v != v:            # NaN: stored as NULL + its bit
            mask |= bit
    if mask:
        values = tuple(None if v != v else v for v in values)
    x = _EXTRAS_OF(s)
    extra = None if x is None or x == _NO_EXTRAS else _extra_blob(x if _MANY_EXTRAS else (x,))
    return (run_id, rank, s.step, s.time, *values, mask, extra)


def _extra_blob(values: tuple) -> Optional[bytes]:
    """The signals without a column (declared after the first 14), packed by slot."""
    by_slot: list[Optional[float]] = [None] * _EXTRA_WIDTH
    for v, slot in zip(values, _EXTRA_SLOTS):
        if v is not None:
            by_slot[slot] = float(v)
    return pack_extra(by_slot)


def bulk_insert(session: Session, table: str, columns: Sequence[str], rows: list[tuple]) -> int:
    """Plain multi-row insert through the driver, inside the session's transaction.

    Only for rows known to be new (the caller holds the run's lock and has
    filtered out stored steps): PostgreSQL gets a binary ``COPY`` (an order of
    magnitude faster than INSERT, and the binary format another 2-6x cheaper
    than text for both sides: no float formatting or bytea hex), SQLite an
    ``executemany``.
    """
    if not rows:
        return 0
    conn = session.connection()
    cols = ", ".join(f'"{c}"' for c in columns)
    if conn.dialect.name == "postgresql":
        raw = conn.connection.driver_connection
        types = _copy_types(conn.connection.info, raw, table, cols)
        with raw.cursor() as cur, cur.copy(f"COPY {table} ({cols}) FROM STDIN (FORMAT BINARY)") as copy:
            copy.set_types(types)
            for r in rows:
                copy.write_row(r)
    else:
        marks = ", ".join("?" * len(columns))
        conn.exec_driver_sql(f"INSERT INTO {table} ({cols}) VALUES ({marks})", rows)
    return len(rows)


def _copy_types(info: dict, raw, table: str, cols: str) -> list[int]:
    """The columns' type oids, which a binary COPY must send exactly: read from the table itself once
    per pooled connection, so they follow the migrations rather than a list kept here by hand."""
    cache = info.setdefault("gradwatch_copy_types", {})
    key = (table, cols)
    if key not in cache:
        with raw.cursor() as cur:
            cur.execute(f"SELECT {cols} FROM {table} LIMIT 0")
            cache[key] = [d.type_code for d in cur.description]
    return cache[key]


_NULL_BYTES = np.array([NULL_F32_BITS], dtype="<u4").tobytes()


def _layers_for_rules(blob: bytes) -> list[Optional[float]]:
    arr = np.frombuffer(blob, dtype="<f4")
    values = arr.astype(np.float64).tolist()
    if _NULL_BYTES not in blob:  # fast path: every layer measured
        return values
    nulls = null_mask(arr)
    if nulls.any():
        for i in np.flatnonzero(nulls).tolist():
            values[i] = None
    return values


class _LayerView(Mapping):
    """A step's per-layer statistics for the rules, decoded from the packed float32 blobs only when a
    rule asks: ``view[stat]`` / ``view.get(stat)`` -> list (None for a layer not measured),
    ``view.array(stat)`` -> float64 array (NaN for a layer not measured)."""

    __slots__ = ("_blobs", "_lists", "_arrays")

    def __init__(self, blobs: dict[str, bytes]):
        self._blobs = blobs
        self._lists: dict[str, list] = {}
        self._arrays: dict[str, np.ndarray] = {}

    def __getitem__(self, stat: str) -> list[Optional[float]]:
        values = self._lists.get(stat)
        if values is None:
            values = self._lists[stat] = _layers_for_rules(self._blobs[stat])
        return values

    def __iter__(self):
        return iter(self._blobs)

    def __len__(self) -> int:
        return len(self._blobs)

    def __contains__(self, stat) -> bool:
        return stat in self._blobs

    def present(self, stat: str) -> bool:
        return bool(self._blobs.get(stat))

    def array(self, stat: str) -> Optional[np.ndarray]:
        arr = self._arrays.get(stat)
        if arr is None:
            blob = self._blobs.get(stat)
            if not blob:
                return None
            arr = np.frombuffer(blob, dtype="<f4").astype(np.float64)
            if _NULL_BYTES in blob:
                nulls = null_mask(np.frombuffer(blob, dtype="<f4"))
                if nulls.any():
                    arr[nulls] = np.nan
            self._arrays[stat] = arr
        return arr


def _keys_present(steps: list) -> frozenset:
    """``rules.batch.keys_present`` of the steps' wire dicts, read off the validated models: a column
    is almost always set on the first step, so ``any`` stops there."""
    if not steps:
        return frozenset()
    keys = {"step", "time", "custom"}          # required, or a dict (never None)
    keys.update(name for name in STEP_SIGNAL_NAMES if any(getattr(s, name) is not None for s in steps))
    for s in steps:
        for stat, blob in s.layers.items():
            if blob:
                keys.add("layers." + stat)
    return frozenset(keys)


_WIRE_KEYS = ("step", "time", *STEP_SIGNAL_NAMES, "custom", "layers")


def _wire_step(s) -> dict[str, Any]:
    """A step as the rules read it: the model's fields (its ``__dict__`` copied in C, not read one
    ``getattr`` at a time), ``custom`` a copy, ``layers`` decoded on demand."""
    d = s.__dict__.copy()      # exactly _WIRE_KEYS (tests/server/test_ingest_write_path.py holds StepIn to it)
    d["custom"] = dict(s.custom)
    d["layers"] = _LayerView(s.layers)
    return d


def ingest_batch(session: Session, *, batch: IngestBatchIn, settings: Settings, now: float,
                 evaluate_rules: bool = True) -> IngestOutcome:
    """Write one batch. The caller owns the transaction and commits once.

    ``evaluate_rules=False`` only for bulk loads (bench/query.py builds a
    million-step run): no alerts, no webhook outbox rows.
    """
    found = session.execute(_RUN_OF_PROJECT_FOR_UPDATE, {"project": batch.project, "name": batch.run}).one_or_none()
    if found is not None:
        run, project = found
        if run.deleted_at is not None:      # being deleted (server/lifecycle/delete.py): 410
            raise run_deleted_error(project=batch.project, run=run)
    else:
        # a late batch of a deleted run must not start a partial run of its name (or recreate its project)
        refuse_if_deleted(session, project=batch.project, run=batch.run, batch_session=batch.session)
        project = get_or_create_project(session, name=batch.project, now=now)
        run = _get_or_create_run(session, project=project, name=batch.run, world_size=batch.world_size, now=now)
    locked_at = time.perf_counter()

    inserted = session.execute(_batch_id_insert(session), {
        "batch_id": batch.batch_id, "run_id": run.id, "received_at": now, "step_count": len(batch.steps)
    }).scalar_one_or_none()
    if inserted is None:
        return IngestOutcome(run_id=run.id, accepted=len(batch.steps), duplicate=True, locked_at=locked_at,
                             run_started_at=run.started_at)

    rank = batch.rank
    # a resumed process continues the run's step axis; its snapshot gets the stored state before it
    shift = session_shift(session, run=run, batch=batch, rank=rank)
    apply_shift(batch, shift)
    add_history(session, run=run, rank=rank, events=batch.events)
    steps = sorted(batch.steps, key=lambda s: s.step)
    # steps a retention policy compacted are stored (in the rollups): a re-sent one is skipped like any
    # stored step, not rolled up twice (server/lifecycle/retention.py)
    floor = raw_floor(run.config)
    fresh, values, rows = write_steps(session, run_id=run.id, rank=rank,
                                      steps=[s for s in steps if s.step >= floor] if floor else steps)
    rows += 1  # the ingest_batches row
    already = _already_stored(batch, steps, fresh)

    if batch.events:
        session.execute(
            dialect_insert(session, RunEvent),
            [{"run_id": run.id, "rank": rank, "step": e.step, "kind": e.kind, "data": encode_json(e.data), "time": now}
             for e in batch.events],
        )

    _update_run(run, batch=batch, steps=steps, now=now)
    if batch.meta is not None and batch.meta.param_shards is not None:
        record_layout(session, run=run, rank=rank, world_size=batch.world_size,
                      shards=batch.meta.param_shards, now=now)
    session.flush()
    # a run of several ranks: how many ranks have stored each step this batch stored, counted and read
    # in one statement, for the combined rows (sharded runs) and the cross-rank rules: both act only on
    # the steps this batch completed (their last rank arrived)
    stored = [s.step for s in fresh]
    sent = (count_sent(session, run_id=run.id, steps=stored) if (run.world_size or 1) > 1
            and rank < run.world_size else None)
    combined = combine_steps(session, run=run, steps=stored, sent=sent) if batch.world_size > 1 else []
    if combined:
        _, c_values, c_rows = write_steps(session, run_id=run.id, rank=COMBINED_RANK, steps=combined)
        values, rows = values + c_values, rows + c_rows
        session.flush()

    if not evaluate_rules:
        return IngestOutcome(run_id=run.id, accepted=len(steps), duplicate=False, values_written=values,
                             rows_written=rows, step_shift=shift, already_stored=already,
                             locked_at=locked_at, run_started_at=run.started_at)
    wire_steps = [_wire_step(s) for s in steps]
    wire_events = [e.model_dump() for e in batch.events]
    alerts = evaluate_batch(session, run=run, rank=rank, steps=wire_steps, events=wire_events,
                            settings=settings, now=now, present=_keys_present(steps), sent=sent) or []
    if combined:   # the rules on the full parameters' and the global grad norm (A2, B1, E2, E3, ...)
        alerts += evaluate_batch(session, run=run, rank=COMBINED_RANK, steps=[_wire_step(s) for s in combined],
                                 events=[], settings=settings, now=now, present=_keys_present(combined)) or []
    # the forensics go into the critical alerts before routing, so notifications carry them: first what
    # deviated first (precursors), then the rollback advice, whose restart point comes before a precursor
    enqueued = 0
    if alerts:
        session.flush()
        attach_precursors(session, alerts, run=run)
    advise_rollback(session, run_id=run.id, alerts=alerts, events=wire_events)
    if alerts:
        enqueued = route_alerts(session, alerts, run=run, project=project, settings=settings, now=now) or 0
    # the agent's Rewind policy acted on an alert: the alert says so, and a notification goes out
    enqueued += record_rewinds(session, run=run, project=project, rank=rank, events=wire_events,
                               settings=settings, now=now)
    return IngestOutcome(run_id=run.id, accepted=len(steps), duplicate=False,
                         alerts_enqueued=enqueued, alerts_routed=len(alerts), values_written=values,
                         rows_written=rows + len(batch.events), step_shift=shift, already_stored=already,
                         locked_at=locked_at, run_started_at=run.started_at)


def _already_stored(batch: IngestBatchIn, steps: list, fresh: list) -> int:
    """Steps of the batch not written because stored ones have their numbers: never overwritten, but
    never silently either (an event on the run, and the count in the reply the agent warns with)."""
    if len(fresh) == len(steps):
        return 0
    written = {s.step for s in fresh}
    skipped = sorted({s.step for s in steps} - written)
    if not skipped:       # repeats within the batch itself (the first of each was written)
        return 0
    batch.events.append(EventIn(step=skipped[0], kind="steps_already_stored",
                                data={"count": len(skipped), "first": skipped[0], "last": skipped[-1],
                                      "step_origin": batch.step_origin}))
    return len(skipped)


def write_steps(session: Session, *, run_id: int, rank: int, steps: list) -> tuple[list, int, int]:
    """Write one rank's steps (``StepIn``, sorted by step) with their custom scalars, layer statistics and
    rollups; steps already stored are skipped. Returns (the steps written, values, rows)."""
    if not steps:
        return [], 0, 0
    # Batches of one run are serialised (the run row is locked), so the
    # steps already stored can be read and skipped: a step sent again under
    # another batch id is neither doubled nor rolled up twice.
    stored = set(session.scalars(
        _STORED_STEPS, {"run_id": run_id, "rank": rank, "lo": steps[0].step, "hi": steps[-1].step}).all())
    fresh = [s for s in steps if s.step not in stored] if stored else _dedupe(steps)
    if stored:
        fresh = _dedupe(fresh)
    step_rows = [_step_row(run_id, rank, s) for s in fresh]
    rows = bulk_insert(session, "steps", _STEP_COLUMNS, step_rows)
    values = len(fresh) * len(STEP_SIGNAL_NAMES)
    custom_rows = []
    layer_rows = []
    by_stat: dict[str, tuple[list[int], list[bytes]]] = {}
    for s in fresh:
        for key, v in s.custom.items():
            nan = v is not None and v != v
            custom_rows.append((run_id, key, rank, s.step, None if nan else v, nan))
        for stat, blob in s.layers.items():
            layer_rows.append((run_id, stat, rank, s.step, blob))
            st, bl = by_stat.setdefault(stat, ([], []))
            st.append(s.step)
            bl.append(blob)
            values += len(blob) // 4
    rows += bulk_insert(session, "custom_scalars", ("run_id", "key", "rank", "step", "value", "is_nan"), custom_rows)
    values += len(custom_rows)
    rows += bulk_insert(session, "layer_stats", ("run_id", "stat", "rank", "step", "values"), layer_rows)
    rows += _write_rollups(session, run_id=run_id, rank=rank, step_rows=step_rows, by_stat=by_stat)
    return fresh, values, rows


def _write_rollups(session: Session, *, run_id: int, rank: int, step_rows: list[tuple], by_stat: dict) -> int:
    if not step_rows:
        return 0
    # the steps' rows as written (NaN stored as None plus its nan_mask bit) give the rollups' input
    # in two array conversions instead of a Python loop over every signal of every step; columns are
    # signal ids, the extra signals' decoded from their blobs
    step_arr = np.fromiter((r[2] for r in step_rows), dtype=np.int64, count=len(step_rows))
    cols = np.array([r[_SIGNALS_AT] for r in step_rows], dtype=np.float64)   # None -> NaN
    masks = np.fromiter((r[-2] for r in step_rows), dtype=np.int64, count=len(step_rows))
    col_measured = ~np.isnan(cols)
    if masks.any():
        col_measured |= (masks[:, None] & _NAN_BITS[None, :]) != 0   # stored as None, so already NaN in cols
    extras = [(i, r[-1]) for i, r in enumerate(step_rows) if r[-1] is not None]
    if extras:
        vals = np.full((len(step_rows), ROLLUP_WIDTH), np.nan)
        measured = np.zeros(vals.shape, dtype=bool)
        vals[:, :EXTRA_BASE], measured[:, :EXTRA_BASE] = cols, col_measured
        for i, blob in extras:
            extra, ok = extra_values(blob)
            vals[i, EXTRA_BASE:EXTRA_BASE + len(extra)] = extra
            measured[i, EXTRA_BASE:EXTRA_BASE + len(extra)] = ok
    else:   # no step of the batch measured a signal without a column: the partials need no column for them
        vals, measured = cols, col_measured
    n = bulk_insert(session, "step_rollups", ("run_id", "rank", "level", "bucket", "data"),
                [(run_id, rank, lvl, b, blob) for lvl, b, blob in step_partials(step_arr, vals, measured)])
    layer_rollups = [(run_id, stat, rank, lvl, b, blob) for stat, lvl, b, blob in layer_partials_by_stat(by_stat)]
    return n + bulk_insert(session, "layer_rollups", ("run_id", "stat", "rank", "level", "bucket", "data"),
                           layer_rollups)


def _dedupe(steps: list) -> list:
    """Steps are sorted; keep the first of any repeated step index within one batch."""
    out, last = [], None
    for s in steps:
        if s.step != last:
            out.append(s)
            last = s.step
    return out


def _update_run(run: Run, *, batch: IngestBatchIn, steps: list, now: float) -> None:
    run.last_seen = max(run.last_seen or now, now)
    run.world_size = max(run.world_size or 1, batch.world_size)
    if steps and batch.rank == 0:
        top = steps[-1]
        if run.last_step is None or top.step >= run.last_step:
            run.last_step = top.step
            nan = top.loss is not None and top.loss != top.loss
            run.last_loss = None if nan else top.loss
            run.last_loss_nan = nan
            if run.status in ("finished", "crashed") and batch.status is None:
                run.status = "running"  # a re-used run name resumes the run
    if batch.status is not None:
        run.status = batch.status
    meta = batch.meta
    if meta is not None:
        for field in ("param_names", "module_names", "bn_names"):
            names = getattr(meta, field)
            if names is not None:
                setattr(run, field, list(names))
        extra = {k: v for k, v in meta.model_dump(exclude={"param_names", "module_names", "bn_names", "config",
                                                       "param_shards"}).items()
                 if v is not None}
        if meta.config is not None or extra:
            merged = dict(run.config or {})
            merged.update(meta.config or {})
            if extra:
                merged.setdefault("_meta", {})
                merged["_meta"] = {**merged["_meta"], **extra}
                # "_meta" is the last rank's word; where each rank runs is kept per rank (the run
                # header's hosts and devices; queries.rank_meta). Batches of a run are serialised.
                mine = {k: extra[k] for k in RANK_META_KEYS if k in extra}
                if mine:
                    merged["_ranks"] = {**(merged.get("_ranks") or {}), str(batch.rank): mine}
            run.config = encode_json(merged)
