"""SQLAlchemy ORM models: the one place the schema is described.

Leaf module: imports only the signal table (agent/signals.py, itself a
leaf). Alembic migrations under
``server/migrations`` own the live schema; these classes must match them.

Times are stored as float seconds since the epoch: the same on SQLite and
PostgreSQL, no time-zone surprises, cheap to compare.
"""
from __future__ import annotations

from typing import Any, Optional

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    String,
    Text,
    UniqueConstraint,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from gradwatch.agent.signals import COLUMN_SIGNALS

# SQLite only auto-increments INTEGER PRIMARY KEY, not BIGINT.
BigIntPK = BigInteger().with_variant(Integer(), "sqlite")


class Base(DeclarativeBase):
    type_annotation_map = {dict[str, Any]: JSON, list[Any]: JSON}


class Project(Base):
    __tablename__ = "projects"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(200), unique=True)
    created_at: Mapped[float] = mapped_column(Float)


class ApiToken(Base):
    """A project's API token; only the SHA-256 of the secret is stored."""

    __tablename__ = "api_tokens"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    project_id: Mapped[int] = mapped_column(ForeignKey("projects.id", ondelete="CASCADE"), index=True)
    name: Mapped[str] = mapped_column(String(200), default="")
    token_hash: Mapped[str] = mapped_column(String(64), unique=True)
    created_at: Mapped[float] = mapped_column(Float)
    last_used_at: Mapped[Optional[float]] = mapped_column(Float, nullable=True)


class Run(Base):
    __tablename__ = "runs"
    __table_args__ = (UniqueConstraint("project_id", "name", name="uq_runs_project_name"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    project_id: Mapped[int] = mapped_column(ForeignKey("projects.id", ondelete="CASCADE"), index=True)
    name: Mapped[str] = mapped_column(String(200))
    # running | finished | crashed | stalled
    status: Mapped[str] = mapped_column(String(16), default="running")
    started_at: Mapped[float] = mapped_column(Float)
    last_seen: Mapped[float] = mapped_column(Float)
    last_step: Mapped[Optional[int]] = mapped_column(BigInteger, nullable=True)
    last_loss: Mapped[Optional[float]] = mapped_column(Float, nullable=True)
    # SQLite stores NaN as NULL: a NaN last loss is last_loss NULL + last_loss_nan.
    last_loss_nan: Mapped[bool] = mapped_column(Boolean, default=False, server_default="0")
    world_size: Mapped[int] = mapped_column(Integer, default=1)
    param_names: Mapped[list[Any]] = mapped_column(JSON, default=list)
    module_names: Mapped[list[Any]] = mapped_column(JSON, default=list)
    bn_names: Mapped[list[Any]] = mapped_column(JSON, default=list)
    config: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    # set when a delete starts (server/lifecycle/delete.py): hidden from reads, its batches refused,
    # its rows being removed; the row itself goes last (migration 0011)
    deleted_at: Mapped[Optional[float]] = mapped_column(Float, nullable=True)


class Step(Base):
    """One optimizer step of one rank: the per-step scalars, one row.

    A wide row (one column per known signal) keeps a step to one insert and a
    series query to one indexed range scan.
    """

    __tablename__ = "steps"

    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    rank: Mapped[int] = mapped_column(Integer, primary_key=True)
    step: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    time: Mapped[float] = mapped_column(Float)
    loss: Mapped[Optional[float]] = mapped_column(Float, nullable=True)
    grad_norm: Mapped[Optional[float]] = mapped_column(Float, nullable=True)
    clip_max_norm: Mapped[Optional[float]] = mapped_column(Float, nullable=True)
    clipped: Mapped[Optional[bool]] = mapped_column(Boolean, nullable=True)
    loss_scale: Mapped[Optional[float]] = mapped_column(Float, nullable=True)
    overflow: Mapped[Optional[bool]] = mapped_column(Boolean, nullable=True)
    overflow_count: Mapped[Optional[int]] = mapped_column(BigInteger, nullable=True)
    lr: Mapped[Optional[float]] = mapped_column(Float, nullable=True)
    step_time: Mapped[Optional[float]] = mapped_column(Float, nullable=True)
    samples_per_s: Mapped[Optional[float]] = mapped_column(Float, nullable=True)
    tokens_per_s: Mapped[Optional[float]] = mapped_column(Float, nullable=True)
    mem_peak: Mapped[Optional[float]] = mapped_column(Float, nullable=True)
    ema_divergence: Mapped[Optional[float]] = mapped_column(Float, nullable=True)
    input_nonfinite: Mapped[Optional[int]] = mapped_column(BigInteger, nullable=True)
    # NaN encoding (server/wire/numbers.py): bit i set = the column signal of id i was NaN (its column is NULL).
    nan_mask: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    # Every step signal declared after the columns above, by id (server/wire/numbers.py, pack_extra);
    # NULL when the step measured none of them. A new signal needs no migration (0005).
    extra: Mapped[Optional[bytes]] = mapped_column(LargeBinary, nullable=True)


# The step signals with a column of their own, in id order (agent/signals.py declares them all).
STEP_COLUMNS = tuple(s.name for s in COLUMN_SIGNALS)


class RankLayout(Base):
    """One rank of a distributed run whose parameters are sharded: which piece of each parameter it holds.

    ``shards[i] = [index, count]`` for ``runs.param_names[i]`` (``agent/capture/shards.py``): the
    parameter is cut into ``count`` disjoint pieces and this rank holds piece ``index``. The server
    combines the ranks' per-piece norms with it (``server/storage/ranks.py``). A row per (run, rank) that sent
    a layout; unsharded runs (single process, DDP) have none (migration 0008).
    """

    __tablename__ = "rank_layouts"

    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    rank: Mapped[int] = mapped_column(Integer, primary_key=True)
    world_size: Mapped[int] = mapped_column(Integer)
    shards: Mapped[list[Any]] = mapped_column(JSON, default=list)
    updated_at: Mapped[float] = mapped_column(Float)


class StepRanks(Base):
    """How many ranks of a run of several ranks have stored each step (their rows in ``steps``).

    Kept by ingest in the batch's own transaction (``server/storage/ranks.py`` ``count_sent``): each batch adds
    its rank to the steps it has just stored and reads the counts back in the same statement, so the one
    batch that completes a step (its count reaching the world size) knows it without counting the
    steps' rows, which read one index range per rank (at 256 ranks 12 % of a batch's time). The run's
    lock serialises its batches, so every count is exact. Single-process runs have none (migration 0010).
    """

    __tablename__ = "step_ranks"

    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    step: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    ranks: Mapped[int] = mapped_column(Integer)


class CustomScalar(Base):
    """Values logged with ``monitor.log(name=value)`` beyond the known signals."""

    __tablename__ = "custom_scalars"

    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    key: Mapped[str] = mapped_column(String(200), primary_key=True)
    rank: Mapped[int] = mapped_column(Integer, primary_key=True)
    step: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    value: Mapped[Optional[float]] = mapped_column(Float, nullable=True)
    # NaN is stored as value NULL + is_nan (SQLite cannot store a float NaN).
    is_nan: Mapped[bool] = mapped_column(Boolean, default=False, server_default="0")


class LayerStat(Base):
    """One per-layer statistic of one step: all layers packed in one row.

    ``values`` is a little-endian float32 array indexed like the run's
    ``param_names`` / ``module_names`` / ``bn_names`` (see docs/wire-format.md).
    """

    __tablename__ = "layer_stats"

    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    stat: Mapped[str] = mapped_column(String(32), primary_key=True)
    rank: Mapped[int] = mapped_column(Integer, primary_key=True)
    step: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    values: Mapped[bytes] = mapped_column(LargeBinary)


# Rollup levels (steps per rollup bucket). A query whose bucket is at least a
# level reads that level's partial aggregates instead of the raw rows, so a
# chart or heatmap over a million steps reads thousands of rows, not millions
# (docs/architecture.md, "Storage").
ROLLUP_LEVELS = (16, 256, 4096)


class StepRollup(Base):
    """Partial aggregates of every step signal over one rollup bucket, from one batch.

    Insert-only: each batch adds one row per (level, bucket) it touches, so
    replicas never update a shared row; a query merges the partials.
    ``data`` is float64[6, W], one column per step signal id (W is the widest id + 1
    when the partial was written, ``agent.signals.ROLLUP_WIDTH``; a partial narrower
    than a signal's id holds nothing of it): min, max (NaN skipped), count
    (measured, NaN included), nonfinite, last_step, last_value (server/storage/rollups.py).
    """

    __tablename__ = "step_rollups"
    __table_args__ = (Index("ix_step_rollups_lookup", "run_id", "rank", "level", "bucket"),)

    id: Mapped[int] = mapped_column(BigIntPK, primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    rank: Mapped[int] = mapped_column(Integer)
    level: Mapped[int] = mapped_column(Integer)
    bucket: Mapped[int] = mapped_column(BigInteger)      # step // level
    data: Mapped[bytes] = mapped_column(LargeBinary)


class LayerRollup(Base):
    """Partial per-layer aggregates of one statistic over one rollup bucket, from one batch.

    ``data`` is a float64 last_step header then float32[6, n_layers]: min, max,
    sum, count (finite or inf), nan count, last value (server/storage/rollups.py).
    """

    __tablename__ = "layer_rollups"
    __table_args__ = (Index("ix_layer_rollups_lookup", "run_id", "stat", "rank", "level", "bucket"),)

    id: Mapped[int] = mapped_column(BigIntPK, primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    stat: Mapped[str] = mapped_column(String(32))
    rank: Mapped[int] = mapped_column(Integer)
    level: Mapped[int] = mapped_column(Integer)
    bucket: Mapped[int] = mapped_column(BigInteger)
    data: Mapped[bytes] = mapped_column(LargeBinary)


class RunEvent(Base):
    """Discrete events the agent reports: NaN origin, drops, top grad norms."""

    __tablename__ = "run_events"
    __table_args__ = (Index("ix_run_events_run_kind", "run_id", "kind"),)

    id: Mapped[int] = mapped_column(BigIntPK, primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    rank: Mapped[int] = mapped_column(Integer, default=0)
    step: Mapped[Optional[int]] = mapped_column(BigInteger, nullable=True)
    kind: Mapped[str] = mapped_column(String(64))
    data: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    time: Mapped[float] = mapped_column(Float)


class IngestBatch(Base):
    """Batch ids already written, per run: a retried batch is recognised and skipped (0006: the id is
    scoped to its run, so another project's or run's batch with the same id is stored)."""

    __tablename__ = "ingest_batches"

    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    batch_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    received_at: Mapped[float] = mapped_column(Float)
    step_count: Mapped[int] = mapped_column(Integer, default=0)


class Alert(Base):
    """One episode of one rule on one run and rank (not one per step)."""

    __tablename__ = "alerts"
    __table_args__ = (Index("ix_alerts_run_rule", "run_id", "rule", "rank"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), index=True)
    rule: Mapped[str] = mapped_column(String(8))          # "A1"
    name: Mapped[str] = mapped_column(String(64))         # "loss_nonfinite"
    severity: Mapped[str] = mapped_column(String(16))     # info | warning | critical
    status: Mapped[str] = mapped_column(String(16), default="firing")  # firing | resolved
    acknowledged: Mapped[bool] = mapped_column(Boolean, default=False)
    rank: Mapped[int] = mapped_column(Integer, default=0)
    first_step: Mapped[int] = mapped_column(BigInteger)
    last_step: Mapped[int] = mapped_column(BigInteger)
    message: Mapped[str] = mapped_column(Text)
    diagnosis: Mapped[str] = mapped_column(Text)
    actions: Mapped[list[Any]] = mapped_column(JSON, default=list)
    evidence: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    created_at: Mapped[float] = mapped_column(Float)
    updated_at: Mapped[float] = mapped_column(Float)
    resolved_at: Mapped[Optional[float]] = mapped_column(Float, nullable=True)
    # Why it was not notified (server/routing/): the alert that inhibits it, the silence that covers it,
    # the warm-up window it fell in. Stored, not derived on read, so the UI shows what routing decided.
    suppressed_by: Mapped[Optional[int]] = mapped_column(ForeignKey("alerts.id", ondelete="SET NULL"), nullable=True)
    silenced_by: Mapped[Optional[int]] = mapped_column(ForeignKey("silences.id", ondelete="SET NULL"), nullable=True)
    muted: Mapped[Optional[str]] = mapped_column(String(32), nullable=True)


class Silence(Base):
    """Matchers that keep matching alerts from being notified between ``starts_at`` and ``ends_at``."""

    __tablename__ = "silences"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    # NULL project: an operator's silence over every project
    project_id: Mapped[Optional[int]] = mapped_column(ForeignKey("projects.id", ondelete="CASCADE"), nullable=True,
                                                      index=True)
    matchers: Mapped[list[Any]] = mapped_column(JSON, default=list)     # ["run=exp-1", 'rule=~"C.*"']
    starts_at: Mapped[float] = mapped_column(Float)
    ends_at: Mapped[float] = mapped_column(Float, index=True)
    created_by: Mapped[str] = mapped_column(String(200), default="")
    comment: Mapped[str] = mapped_column(Text, default="")
    created_at: Mapped[float] = mapped_column(Float)


class NotificationGroup(Base):
    """One incident as one route sees it: the alerts sharing the route's group labels (server/routing/groups.py)."""

    __tablename__ = "notification_groups"
    __table_args__ = (Index("ix_notification_groups_due", "next_flush_at"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    group_key: Mapped[str] = mapped_column(String(500), unique=True)
    route: Mapped[str] = mapped_column(String(100))
    receiver: Mapped[str] = mapped_column(String(100))
    project_id: Mapped[int] = mapped_column(ForeignKey("projects.id", ondelete="CASCADE"), index=True)
    run_id: Mapped[Optional[int]] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), nullable=True)
    labels: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    created_at: Mapped[float] = mapped_column(Float)
    next_flush_at: Mapped[Optional[float]] = mapped_column(Float, nullable=True)
    last_notified_at: Mapped[Optional[float]] = mapped_column(Float, nullable=True)
    notified: Mapped[list[Any]] = mapped_column(JSON, default=list)    # ["<alert id>:<severity>", ...] last sent
    notifications: Mapped[int] = mapped_column(Integer, default=0)


class NotificationGroupAlert(Base):
    """Membership: insert-only, so ingest adding an alert never races the worker rewriting the group."""

    __tablename__ = "notification_group_alerts"

    group_id: Mapped[int] = mapped_column(ForeignKey("notification_groups.id", ondelete="CASCADE"), primary_key=True)
    alert_id: Mapped[int] = mapped_column(ForeignKey("alerts.id", ondelete="CASCADE"), primary_key=True, index=True)


class RuleState(Base):
    """What a rule remembers about a run between batches (streaks, windows).

    Kept in the database, not in process memory, so a restarted server or a
    second replica carries on where the first left off.
    """

    __tablename__ = "rule_states"

    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    rank: Mapped[int] = mapped_column(Integer, primary_key=True)
    rule: Mapped[str] = mapped_column(String(8), primary_key=True)
    state: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)


class RuleOverride(Base):
    """Per-project rule configuration (enabled, thresholds, severity)."""

    __tablename__ = "rule_overrides"

    project_id: Mapped[int] = mapped_column(ForeignKey("projects.id", ondelete="CASCADE"), primary_key=True)
    rule: Mapped[str] = mapped_column(String(8), primary_key=True)
    config: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)


class WebhookEndpoint(Base):
    __tablename__ = "webhook_endpoints"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    # NULL project: a server-wide endpoint (GRADWATCH_WEBHOOK_URLS / --webhook)
    project_id: Mapped[Optional[int]] = mapped_column(
        ForeignKey("projects.id", ondelete="CASCADE"), nullable=True, index=True
    )
    url: Mapped[str] = mapped_column(String(2000))
    format: Mapped[str] = mapped_column(String(16), default="json")  # json | slack | discord
    min_severity: Mapped[str] = mapped_column(String(16), default="info")
    secret: Mapped[Optional[str]] = mapped_column(String(200), nullable=True)
    enabled: Mapped[bool] = mapped_column(Boolean, default=True)
    created_at: Mapped[float] = mapped_column(Float)


class WebhookDelivery(Base):
    """The outbox: one row per (alert, endpoint); survives restarts."""

    __tablename__ = "webhook_deliveries"
    __table_args__ = (Index("ix_webhook_deliveries_due", "status", "next_attempt_at"),)

    id: Mapped[int] = mapped_column(BigIntPK, primary_key=True)
    endpoint_id: Mapped[Optional[int]] = mapped_column(
        ForeignKey("webhook_endpoints.id", ondelete="SET NULL"), nullable=True
    )
    alert_id: Mapped[Optional[int]] = mapped_column(ForeignKey("alerts.id", ondelete="CASCADE"), nullable=True)
    # the notification group it tells (routing); its intervals count from the delivery (migration 0009)
    group_id: Mapped[Optional[int]] = mapped_column(Integer, nullable=True)
    url: Mapped[str] = mapped_column(String(2000))
    body: Mapped[str] = mapped_column(Text)
    status: Mapped[str] = mapped_column(String(16), default="pending")  # pending | delivered | expired
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    next_attempt_at: Mapped[float] = mapped_column(Float)
    expires_at: Mapped[float] = mapped_column(Float)
    last_error: Mapped[Optional[str]] = mapped_column(Text, nullable=True)
    last_status_code: Mapped[Optional[int]] = mapped_column(Integer, nullable=True)
    created_at: Mapped[float] = mapped_column(Float)
    delivered_at: Mapped[Optional[float]] = mapped_column(Float, nullable=True)


class DeletedRun(Base):
    """A deleted run's tombstone: its names and the agent sessions that wrote it (migration 0011).

    Not a child of ``runs`` (the run row is gone): a late batch naming the run from one of these sessions
    is refused (410) rather than starting a partial run of the same name (server/lifecycle/delete.py).
    """

    __tablename__ = "deleted_runs"
    __table_args__ = (Index("ix_deleted_runs_name", "project", "run"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    run_id: Mapped[int] = mapped_column(Integer)
    project: Mapped[str] = mapped_column(String(200))
    run: Mapped[str] = mapped_column(String(200))
    sessions: Mapped[list[Any]] = mapped_column(JSON, default=list)
    deleted_at: Mapped[float] = mapped_column(Float)
    purged_at: Mapped[Optional[float]] = mapped_column(Float, nullable=True)   # every row removed


class ServerSecret(Base):
    """Secrets every replica on this database must share (the dashboard's cookie key).

    Created once by whichever replica needs it first; the others read it, so
    a login made through one replica is honoured by all of them.
    """

    __tablename__ = "server_secrets"

    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    value: Mapped[str] = mapped_column(String(200))
    created_at: Mapped[float] = mapped_column(Float)
