"""Checkpoint records: the ``checkpoint`` event that ``monitor.checkpoint(path)`` sends.

Leaf module (standard library only). A checkpoint's *step* is the number of
optimizer steps taken when it was written, i.e. the step number the run
continues with after loading it (``monitor.step`` at save time, HF's
``state.global_step``, Lightning's ``trainer.global_step``). Its weights are
those from before that step was applied, so a checkpoint at step ``s`` is a
clean restart point for an incident whose first anomalous step is ``s`` or
later (server/forensics/rollback.py).

The event goes with the next batch like every other event and is stored in
``run_events`` (kind ``checkpoint``); ``GET /api/v1/runs/{id}/checkpoints``
lists them. Example::

    >>> checkpoint_event("ckpt/step-300.pt", 300, wall_time=1.0)
    {'step': 300, 'kind': 'checkpoint', 'data': {'path': 'ckpt/step-300.pt', 'saved_at': 1.0}}
"""
from __future__ import annotations

import os
from typing import Any, Optional

KIND = "checkpoint"
MAX_PATH_CHARS = 4096   # the server bounds an event's data; a longer "path" is no path anyone can load


def checkpoint_event(path: Any, step: int, *, wall_time: float, source: Optional[str] = None) -> dict:
    """The wire event of one checkpoint; raises ``ValueError`` for a path or step that cannot be one.

    ``path`` is anything ``os.fspath`` takes (``str``, ``pathlib.Path``) or any other object whose
    ``str`` names it (an object-store URL); ``None`` records a checkpoint whose path is not known
    (Lightning's ``trainer.save_checkpoint(path)`` called by user code: no callback is told the
    path); ``source`` names the framework callback that saw it."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step={step!r}: give the optimizer steps taken when it was saved (an int >= 0)")
    data: dict = {"path": None, "saved_at": float(wall_time)}
    if source is not None:
        data["source"] = source
    if path is None:
        return {"step": step, "kind": KIND, "data": data}
    try:
        text = os.fspath(path)
    except TypeError:
        text = str(path)
    if isinstance(text, bytes):
        text = text.decode("utf-8", "replace")
    if not text or len(text) > MAX_PATH_CHARS:
        raise ValueError(f"path={text[:80]!r}: give a non-empty path of at most {MAX_PATH_CHARS} characters")
    data["path"] = text
    return {"step": step, "kind": KIND, "data": data}
