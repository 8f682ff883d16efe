"""Prometheus text-format metrics: per-process ingest counters plus database-wide gauges.

Counters live in the process (each replica is scraped on its own); open
alerts and webhook deliveries are read from the database at scrape time, so
they agree across replicas.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Iterable

from sqlalchemy import case, func, select
from sqlalchemy.orm import Session

from gradwatch.server.storage.models import Alert, WebhookDelivery

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.5, 1.0, 2.5, 5.0, 10.0)


class IngestMetrics:
    """Thread-safe counters and a latency histogram for the ingest route."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.batches = {"accepted": 0, "duplicate": 0, "rejected": 0}
        self.steps = 0
        self.values = 0
        self.rows = 0
        self.latency_counts = [0] * len(LATENCY_BUCKETS)
        self.latency_sum = 0.0
        self.latency_count = 0

    def observe_batch(self, *, seconds: float, steps: int = 0, values: int = 0, rows: int = 0,
                      duplicate: bool = False, rejected: bool = False) -> None:
        with self._lock:
            self.batches["rejected" if rejected else "duplicate" if duplicate else "accepted"] += 1
            if not (rejected or duplicate):
                self.steps += steps
                self.values += values
                self.rows += rows
            for i, bound in enumerate(LATENCY_BUCKETS):
                if seconds <= bound:
                    self.latency_counts[i] += 1
            self.latency_sum += seconds
            self.latency_count += 1

    def lines(self) -> Iterable[str]:
        with self._lock:
            yield "# HELP gradwatch_ingest_batches_total Ingest requests by outcome."
            yield "# TYPE gradwatch_ingest_batches_total counter"
            for k, v in self.batches.items():
                yield f'gradwatch_ingest_batches_total{{result="{k}"}} {v}'
            for name, value, doc in (
                ("gradwatch_ingest_steps_total", self.steps, "Steps stored by this process."),
                ("gradwatch_ingest_values_total", self.values, "Metric values stored (scalars + per-layer values)."),
                ("gradwatch_ingest_rows_written_total", self.rows, "Database rows inserted by ingest."),
            ):
                yield f"# HELP {name} {doc}"
                yield f"# TYPE {name} counter"
                yield f"{name} {value}"
            yield "# HELP gradwatch_ingest_batch_seconds Ingest request latency (read, validate, write, commit)."
            yield "# TYPE gradwatch_ingest_batch_seconds histogram"
            for bound, n in zip(LATENCY_BUCKETS, self.latency_counts):
                yield f'gradwatch_ingest_batch_seconds_bucket{{le="{bound}"}} {n}'
            yield f'gradwatch_ingest_batch_seconds_bucket{{le="+Inf"}} {self.latency_count}'
            yield f"gradwatch_ingest_batch_seconds_sum {self.latency_sum:.6f}"
            yield f"gradwatch_ingest_batch_seconds_count {self.latency_count}"


@dataclass
class RetentionCounters:
    """The retention job's totals in this process (server/lifecycle/retention.py), for /metrics."""

    rows: dict[str, int] = field(default_factory=dict)     # by table
    bytes_freed: int = 0
    runs: int = 0            # runs compacted (something deleted)
    runs_checked: int = 0
    passes: int = 0
    errors: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def count(self, **n: int) -> None:
        with self._lock:
            for k, v in n.items():
                setattr(self, k, getattr(self, k) + v)

    def add(self, table: str, rows: int, nbytes: int) -> None:
        with self._lock:
            self.rows[table] = self.rows.get(table, 0) + rows
            self.bytes_freed += nbytes

    def lines(self) -> Iterable[str]:
        with self._lock:
            yield "# HELP gradwatch_retention_rows_compacted_total Raw rows and fine rollups deleted by retention."
            yield "# TYPE gradwatch_retention_rows_compacted_total counter"
            for table in sorted({"steps", "layer_stats", "layer_rollups", "step_rollups", *self.rows}):
                yield f'gradwatch_retention_rows_compacted_total{{table="{table}"}} {self.rows.get(table, 0)}'
            for name, value, doc in (
                ("gradwatch_retention_bytes_freed_estimate_total", self.bytes_freed,
                 "Bytes retention freed, estimated: blob lengths plus a per-row overhead."),
                ("gradwatch_retention_runs_processed_total", self.runs, "Runs retention compacted rows of."),
                ("gradwatch_retention_runs_checked_total", self.runs_checked, "Runs retention looked at."),
                ("gradwatch_retention_passes_total", self.passes, "Passes of the retention job."),
                ("gradwatch_retention_errors_total", self.errors, "Retention passes that failed (logged)."),
            ):
                yield f"# HELP {name} {doc}"
                yield f"# TYPE {name} counter"
                yield f"{name} {value}"


def lock_hold_lines(average: float, paced: float) -> Iterable[str]:
    """How long ingest transactions hold their run's lock (server/ingest/pacing.py): the moving average, and the
    figure the ranks' pace is computed from now (``rank_pace`` of it is what the replies ask), in full
    precision."""
    yield ("# HELP gradwatch_ingest_lock_hold_seconds How long an ingest transaction holds its run's lock: "
           "the moving average, and the rounded figure a many-rank run's pace follows.")
    yield "# TYPE gradwatch_ingest_lock_hold_seconds gauge"
    yield f'gradwatch_ingest_lock_hold_seconds{{figure="average"}} {average!r}'
    yield f'gradwatch_ingest_lock_hold_seconds{{figure="paced"}} {paced!r}'


def database_lines(session: Session) -> Iterable[str]:
    yield "# HELP gradwatch_alerts_open Firing alerts, by severity."
    yield "# TYPE gradwatch_alerts_open gauge"
    counts = dict(session.execute(
        select(Alert.severity, func.count()).where(Alert.status == "firing").group_by(Alert.severity)).all())
    for sev in sorted({"info", "warning", "critical", *counts}):
        yield f'gradwatch_alerts_open{{severity="{sev}"}} {counts.get(sev, 0)}'
    yield "# HELP gradwatch_webhook_deliveries Webhook outbox rows, by status."
    yield "# TYPE gradwatch_webhook_deliveries gauge"
    by_status = dict(session.execute(
        select(WebhookDelivery.status, func.count()).group_by(WebhookDelivery.status)).all())
    for st in sorted({"pending", "delivered", "expired", *by_status}):
        yield f'gradwatch_webhook_deliveries{{status="{st}"}} {by_status.get(st, 0)}'
    # every attempt of an undelivered row failed; a delivered row failed all but its last attempt
    failed_attempts = session.scalar(select(func.coalesce(func.sum(case(
        (WebhookDelivery.status == "delivered", WebhookDelivery.attempts - 1), else_=WebhookDelivery.attempts)), 0)))
    yield "# HELP gradwatch_webhook_delivery_failures_total Failed webhook delivery attempts (all replicas)."
    yield "# TYPE gradwatch_webhook_delivery_failures_total counter"
    yield f"gradwatch_webhook_delivery_failures_total {int(failed_attempts or 0)}"
