"""A resumed run on the server: where a process's steps go, and the stored state a resume is checked against.

Called by ingest (``server/ingest/write.py``) inside the batch's transaction, with the run's row locked.

**Step numbers.** Each agent process sends a ``session`` id, its ``step_origin`` and ``step_start``
(``agent/resume.py``). At a session's first batch the server decides its *shift* once and keeps it
in ``runs.config["_step_shift"]`` (JSON: no migration): a guessed numbering (``"optimizer"``: from the
optimizer's step counters, which do not count the steps a GradScaler skipped; ``"process"``: counted
from 0) that would collide with the rank's stored steps is moved to continue right after the last
one; a ``"given"`` numbering is stored as given. Every later batch of the session — replayed from the
spool after an outage too — gets the same shift, so the steps of one process stay contiguous.
Steps numbered like stored ones are never written over: ingest skips them, says how many in its
reply and stores a ``steps_already_stored`` event.

**The state before a resume.** A ``resume_state`` event (the agent's snapshot at attach) gets the
rank's stored state before its step added as ``data["before"]``: the last stored step's loss scale,
LR and RNG hash, the first stored step's LR and scale, how many steps and skipped steps there were,
the largest EMA divergence measured, and the last stored BatchNorm running-stat norms. The rules
G1-G6 (``server/rules/catalog/resume.py``) compare the two; the stored event keeps both, so an
alert's evidence and the run's event list show what was compared.
"""
from __future__ import annotations

import math
from typing import Any, Optional

from sqlalchemy import case, func, select
from sqlalchemy.orm import Session

from gradwatch.agent.nonfinite import encode_float
from gradwatch.agent.signals import EXTRA_BASE, step_signal

from gradwatch.server.storage.models import LayerStat, Run, Step
from gradwatch.server.wire.numbers import extra_value, unpack_layer_values

SHIFTS_KEY = "_step_shift"
MAX_SESSIONS = 1024        # sessions remembered per run (one per process and rank); the oldest go first
GUESSED = ("optimizer", "process")
FIRST_LRS = 8              # the LRs of the run's first stored steps, which a restarted schedule repeats
_RNG_SLOT = step_signal("rng_hash").id - EXTRA_BASE


def session_shift(session: Session, *, run: Run, batch: Any, rank: int) -> int:
    """The shift of the batch's session: decided at its first batch, the same for every later one."""
    key = batch.session
    if key is None:          # an agent from before sessions: stored as numbered
        return 0
    shifts = (run.config or {}).get(SHIFTS_KEY) or {}
    if key in shifts:
        return int(shifts[key])
    shift = 0
    if batch.step_origin in GUESSED:
        start = batch.step_start
        if start is None:
            start = min((s.step for s in batch.steps), default=0)
        last = session.scalar(select(func.max(Step.step)).where(Step.run_id == run.id, Step.rank == rank))
        if last is not None and start <= last:
            shift = int(last) + 1 - int(start)
    shifts = dict(shifts)
    shifts[key] = shift
    while len(shifts) > MAX_SESSIONS:
        shifts.pop(next(iter(shifts)))
    run.config = {**(run.config or {}), SHIFTS_KEY: shifts}
    return shift


def apply_shift(batch: Any, shift: int) -> None:
    """Move the batch's steps and events by the session's shift (in place, before anything is written)."""
    if not shift:
        return
    for s in batch.steps:
        s.step += shift
    for e in batch.events:
        if e.step is not None:
            e.step += shift


def add_history(session: Session, *, run: Run, rank: int, events: list) -> None:
    """Each ``resume_state`` event gets ``data["before"]``: the rank's stored state before its step."""
    for e in events:
        if e.kind == "resume_state" and e.step is not None:
            e.data = {**e.data, "before": stored_before(session, run_id=run.id, rank=rank, step=e.step)}


def _f(x: Optional[float]) -> Any:
    return None if x is None else encode_float(float(x))


def stored_before(session: Session, *, run_id: int, rank: int, step: int) -> Optional[dict[str, Any]]:
    """The stored state of ``rank`` before ``step`` (None: nothing stored before it, a fresh run)."""
    where = (Step.run_id == run_id, Step.rank == rank, Step.step < step)
    last = session.execute(select(Step.step, Step.loss_scale, Step.lr, Step.nan_mask, Step.extra)
                           .where(*where).order_by(Step.step.desc()).limit(1)).first()
    if last is None:
        return None
    head = session.execute(select(Step.step, Step.loss_scale, Step.lr)
                           .where(*where).order_by(Step.step).limit(FIRST_LRS)).all()
    first = head[0]
    steps, skipped, ema_max = session.execute(
        select(func.count(), func.sum(case((Step.overflow.is_(True), 1), else_=0)), func.max(Step.ema_divergence))
        .where(*where)).one()
    rng = None
    stored = extra_value(last.extra, _RNG_SLOT)
    if stored is not None and math.isfinite(stored):
        rng = int(stored)
    out: dict[str, Any] = {
        "step": int(last.step), "loss_scale": _f(last.loss_scale), "lr": _f(last.lr), "rng_hash": rng,
        "first_step": int(first.step), "first_loss_scale": _f(first.loss_scale), "first_lr": _f(first.lr),
        # a schedule that restarts takes these values again (G5)
        "first_lrs": [_f(r.lr) for r in head if r.lr is not None],
        "steps": int(steps), "skipped_steps": int(skipped or 0), "ema_divergence_max": _f(ema_max),
    }
    for stat in ("bn_mean_norm", "bn_var_norm"):
        row = session.execute(select(LayerStat.step, LayerStat.values)
                              .where(LayerStat.run_id == run_id, LayerStat.rank == rank, LayerStat.stat == stat,
                                     LayerStat.step < step)
                              .order_by(LayerStat.step.desc()).limit(1)).first()
        if row is not None:
            out[stat] = [None if not math.isfinite(v) else float(v) for v in unpack_layer_values(row.values).tolist()]
            out[stat + "_step"] = int(row.step)
    return out
