"""One writer per signal: who writes each name of a step record, checked when a monitor is composed.

Leaf module: standard library only.

A step record's names (the signal table's, :mod:`agent.signals`) are written by

* the collectors (:mod:`agent.collectors`), each declaring what it writes in ``emits``;
* the step builder (:mod:`agent.step_builder`): the step's clocks and throughputs, the skip guard's decision;
* the sealer (:mod:`agent.sealer`): the step's ``loss``, out of the two sums the record carries
  (:meth:`~agent.record.StepRecord.take_loss` chooses);

each declares its names in ``emits``, and a name has one writer. :func:`check_owners` refuses a second
one when the monitor composes its writers, at attach (as a Prometheus registry refuses a second
collector of a metric name it has): two writers of ``grad_norm`` would leave the step's value to
whichever wrote last.

The values a loop reports through ``monitor.log`` are a source of their own. Its custom scalars are
names of the user's (``custom:<key>``), never the table's. Four names (:data:`LOOP_REPORTS`) are the
loop's report of a step signal it may know where the agent measured nothing (DeepSpeed's global grad
norm, clip threshold and fp16 loss scaler, docs/agent.md "monitor.log"): the report does not write the
signal; it is handed to the signal's owner, the one collector that declares it takes it (``reports``,
:meth:`~agent.collectors.base.Collector.report`), which decides whether it becomes the step's value (its
own measurement wins) or stays a custom scalar.

>>> class Norms: emits, reports = ("grad_norm", "clip_max_norm"), ("grad_norm",)
>>> class Twin: emits = ("grad_norm",)
>>> sorted(check_owners([Norms]).items())
[('clip_max_norm', 'Norms'), ('grad_norm', 'Norms')]
>>> check_owners([Norms, Twin])
Traceback (most recent call last):
ValueError: 'grad_norm' has two writers, Norms and Twin: one writer per signal (gradwatch.agent.owners)
"""
from __future__ import annotations

from typing import Any, Iterable

# monitor.log's names that report a step signal (handed to its owner; every other name is a custom scalar)
LOOP_REPORTS: tuple[str, ...] = ("grad_norm", "clip_max_norm", "overflow", "loss_scale")


def _name(writer: Any) -> str:
    return getattr(writer, "__name__", None) or type(writer).__name__


def check_owners(writers: Iterable[Any]) -> dict[str, str]:
    """Each name the ``writers`` (classes or objects with ``emits``, and ``reports`` for a collector) declare,
    with the one that writes it; ``ValueError`` naming both when two declare a name, and when a ``reports``
    name is not one of :data:`LOOP_REPORTS`, not the collector's own (``emits``), or taken by two."""
    owner: dict[str, str] = {}
    taker: dict[str, str] = {}
    for writer in writers:
        name = _name(writer)
        emits = getattr(writer, "emits", ())
        for n in emits:
            if n in owner:
                raise ValueError(f"{n!r} has two writers, {owner[n]} and {name}: one writer per signal "
                                 "(gradwatch.agent.owners)")
            owner[n] = name
        for n in getattr(writer, "reports", ()):
            if n not in LOOP_REPORTS:
                raise ValueError(f"{name} takes reports of {n!r}, which monitor.log does not report: one of "
                                 f"{', '.join(LOOP_REPORTS)}")
            if n not in emits:
                raise ValueError(f"{name} takes reports of {n!r} but does not write it: a report goes to the "
                                 "signal's owner")
            if n in taker:
                raise ValueError(f"reports of {n!r} have two takers, {taker[n]} and {name}")
            taker[n] = name
    return owner


def report_takers(collectors: Iterable[Any]) -> dict[str, Any]:
    """The composed collector that takes each reported name (a name without one stays a custom scalar)."""
    return {n: c for c in collectors for n in getattr(c, "reports", ())}


def owner_of(collectors: Iterable[Any], name: str) -> Any:
    """The composed collector that writes ``name``, or None."""
    return next((c for c in collectors if name in c.emits), None)
