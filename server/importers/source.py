"""What a reader hands the importer: one source run's scalars, and how they become wire steps.

Standard library only (plus the torch-free signal table and wire float encoder):
the same steps go to a database through the server's ingest function or to a
server over HTTP, and the HTTP path needs no server extra installed.
"""
from __future__ import annotations

import hashlib
import math
import os
from dataclasses import dataclass, field
from typing import Any, Optional

# Steps per ingest batch: well under the server's bound (schemas.IngestBatchIn: 100,000 steps, and the
# body limits), large enough that a million-step run is a thousand batches.
BATCH_STEPS = 1000


class ImportProblem(Exception):
    """A problem the user can fix; the message says how (one line)."""


@dataclass
class SourceRun:
    kind: str                   # "tensorboard" | "wandb"
    path: str                   # the run's directory (tensorboard) or .wandb file
    name: str                   # default gradwatch run name
    # tag -> [(step, wall time, value)] in the order the logger wrote them
    scalars: dict[str, list[tuple[int, float, float]]] = field(default_factory=dict)
    project: Optional[str] = None       # the source's own project, when it has one (wandb)
    finished: bool = True
    skipped_points: int = 0             # values not importable (non-scalar, bad step)

    @property
    def source_id(self) -> str:
        """Names the source file(s) in batch ids: the same source imported again sends the same ids."""
        return hashlib.sha1(f"{self.kind}:{os.path.realpath(self.path)}".encode()).hexdigest()[:16]


@dataclass
class Prepared:
    """A source run turned into wire steps under a tag map."""
    run: SourceRun
    mapped: dict[str, str]              # tag -> signal
    left_out: list[str]                 # tags not imported
    steps: list[dict[str, Any]]         # wire-format steps, sorted by step
    dropped: dict[str, int]             # signal -> values that its kind cannot hold (a NaN count …)


def prepare(run: SourceRun, tagmap) -> Prepared:
    """Group the mapped tags' values by step into wire-format steps (docs/wire-format.md).

    A tag logged twice at one step keeps its last value (what TensorBoard and W&B draw). A step's
    ``time`` is the latest wall time of its values. Float signals keep NaN / ±Inf (as the wire's
    strings); counts and bools have no non-finite value, so a non-finite one is left out and counted.
    """
    from gradwatch.agent.nonfinite import encode_float
    from gradwatch.agent.signals import step_signal

    mapped, left_out = tagmap.resolve(sorted(run.scalars))
    by_step: dict[int, dict[str, Any]] = {}
    dropped: dict[str, int] = {}
    for tag, signal in mapped.items():
        kind = step_signal(signal).kind
        for step, wall, value in run.scalars[tag]:
            if kind == "float":
                v: Any = encode_float(float(value))
            elif not math.isfinite(value) or (kind == "count" and value < 0):
                dropped[signal] = dropped.get(signal, 0) + 1
                continue
            else:
                v = int(value) if kind == "count" else bool(value)
            slot = by_step.setdefault(step, {"step": step, "time": wall})
            slot[signal] = v
            if wall > slot["time"]:
                slot["time"] = wall
    steps = [by_step[s] for s in sorted(by_step)]
    return Prepared(run=run, mapped=mapped, left_out=left_out, steps=steps, dropped=dropped)


def batches(prepared: Prepared, *, project: str, run_name: str, after: Optional[int] = None,
            batch_steps: int = BATCH_STEPS) -> list[dict]:
    """The ingest bodies (``POST /api/v1/ingest``) of a prepared run, for its steps after ``after`` (the
    run's last stored step, None for a new run).

    Steps the run already holds are not sent again: the rule engine reads every step of a batch, and
    would read them twice. Batch ids come from the source file and the batch's place in it (first step,
    step count), so two imports of the same source at once, or a retried one, send the same ids and
    the server writes each batch once.
    """
    src = prepared.run
    out = []
    steps = prepared.steps if after is None else [s for s in prepared.steps if s["step"] > after]
    for i in range(0, len(steps), batch_steps):
        chunk = steps[i:i + batch_steps]
        body: dict[str, Any] = {
            "batch_id": f"imp-{src.kind[:2]}-{src.source_id}-{chunk[0]['step']}-{len(chunk)}",
            "project": project, "run": run_name, "steps": chunk,
        }
        if i == 0 and after is None:
            body["meta"] = {"config": {"imported_from": {"kind": src.kind, "path": os.path.realpath(src.path),
                                                         "tags": prepared.mapped}},
                            "started_at": chunk[0]["time"]}
        out.append(body)
    if out:
        # an import is history: a run left "running" would read as stalled (F2) minutes later. A W&B log
        # without its exit record is a job that died (or one still writing: importing again updates it)
        out[-1]["status"] = "finished" if src.finished else "crashed"
    return out
