"""Request and response models (the wire format: docs/wire-format.md).

Separate from the ORM models. Floats on the wire may be numbers, the strings
``"NaN"`` / ``"Infinity"`` / ``"-Infinity"`` or null (server/wire/numbers.py).
Per-layer arrays are validated and packed to float32 blobs here, so the
ingest path never walks them again.
"""
from __future__ import annotations

import json
import unicodedata
from dataclasses import dataclass
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import (AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, PlainSerializer, StringConstraints,
                      ValidationError, WithJsonSchema, create_model, model_validator)

from gradwatch.agent.signals import STEP_SIGNALS

from gradwatch.server.wire.numbers import F32_PREFIX, pack_layer_values, decode_float, encode_float, unpack_f32_b64

_WIRE_FLOAT_SCHEMA = {
    "anyOf": [{"type": "number"}, {"type": "string", "enum": ["NaN", "Infinity", "-Infinity"]}, {"type": "null"}]
}
WireFloat = Annotated[Optional[float], BeforeValidator(decode_float), WithJsonSchema(_WIRE_FLOAT_SCHEMA)]
# A float of a response: a Python float in the model (``nan`` / ``inf`` kept: the dashboard reads the model as it
# is), its wire string in JSON (server/wire/numbers.py). An already encoded string passes as it is.
OutFloat = Annotated[Union[float, str, None], PlainSerializer(encode_float, when_used="json"),
                     WithJsonSchema(_WIRE_FLOAT_SCHEMA)]

def _no_nul(text: str) -> str:
    # PostgreSQL's text types cannot hold a NUL (it was a 500 there), SQLite's can: refused on both
    if "\x00" in text:
        raise ValueError("must not contain a NUL character (\\x00)")
    return text


def _no_control(text: str) -> str:
    # Project and run names reach email Subject lines, Slack/Discord messages, the dashboard, file names
    # of exports and backups: a CR/LF in one broke the email header (the outbox retried it for a day).
    # Refused at the door (422 naming the character) rather than stored and escaped in every sink
    # (docs/deployment.md, "Hostile input"): no control character (C0, DEL, C1) and no Unicode line/paragraph separator.
    for i, c in enumerate(text):
        if unicodedata.category(c) in ("Cc", "Zl", "Zp"):
            raise ValueError(f"must not contain control characters or line breaks: {c!r} at position {i}")
    return text


NoNul = AfterValidator(_no_nul)
NoControl = AfterValidator(_no_control)
Name = Annotated[str, StringConstraints(min_length=1, max_length=200, strip_whitespace=False), NoNul, NoControl]
StatName = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_.:/-]{1,32}$")]
CustomKey = Annotated[str, StringConstraints(min_length=1, max_length=200), NoNul]
LayerName = Annotated[str, StringConstraints(max_length=1000), NoNul]
MAX_LAYERS = 100_000


def _pack(values: Any) -> bytes:
    if isinstance(values, str):
        return unpack_f32_b64(values, max_values=MAX_LAYERS)
    if not isinstance(values, list):
        raise ValueError(f'expected an array of numbers or an "{F32_PREFIX}…" string, '
                         f"got {type(values).__name__}")
    if len(values) > MAX_LAYERS:
        raise ValueError(f"at most {MAX_LAYERS} layer values")
    return pack_layer_values(values)


LayerArray = Annotated[
    Any,
    AfterValidator(_pack),
    WithJsonSchema({"anyOf": [
        {"type": "array", "maxItems": MAX_LAYERS, "items": _WIRE_FLOAT_SCHEMA},
        {"type": "string", "pattern": "^f32:[A-Za-z0-9+/]*={0,2}$", "maxLength": 4 + 4 * MAX_LAYERS * 4 // 3 + 4},
    ]}),
]
StrictBool = Annotated[Optional[bool], Field(strict=True)]
Count = Annotated[Optional[int], Field(ge=0, le=2**62, strict=True)]


_SIGNAL_TYPES = {"float": WireFloat, "count": Count, "bool": StrictBool}

# One optimizer step of one rank. Its signal fields come from the signal table (agent/signals.py), in id
# order between ``time`` and ``custom``: a newly declared signal is accepted with no edit here.
StepIn = create_model(
    "StepIn",
    __config__=ConfigDict(extra="ignore"),
    __doc__="One optimizer step of one rank.",
    step=(int, Field(ge=0, le=2**62, strict=True)),
    time=(Annotated[float, BeforeValidator(decode_float), WithJsonSchema({"type": "number"})],
          Field(allow_inf_nan=False)),
    **{sig.name: (_SIGNAL_TYPES[sig.kind], None) for sig in STEP_SIGNALS},
    custom=(dict[CustomKey, WireFloat], Field(default_factory=dict, max_length=1000)),
    layers=(dict[StatName, LayerArray], Field(default_factory=dict, max_length=64)),
)


MAX_EVENT_DATA_BYTES = 64 * 1024    # an event's data as stored JSON; the agent's largest (top grad norms) is ~1 KB


def _bounded_event_data(data: dict[str, Any]) -> dict[str, Any]:
    size = len(json.dumps(data, separators=(",", ":"), default=str, allow_nan=True))
    if size > MAX_EVENT_DATA_BYTES:
        raise ValueError(f"event data is {size:,} bytes of JSON; at most {MAX_EVENT_DATA_BYTES:,}")
    return data


StepNumber = Annotated[int, Field(ge=0, le=2**62, strict=True)]
Count = Annotated[int, Field(ge=0, le=1_000_000_000, strict=True)]
ShortText = Annotated[str, StringConstraints(min_length=1, max_length=64), NoNul, NoControl]


class RewindTrigger(BaseModel):
    """The alert a rewind acted on, as the agent heard of it (``trigger`` of a ``rewind`` event)."""
    model_config = ConfigDict(extra="ignore")

    rule: Optional[ShortText] = None             # "A1"
    alert_id: Optional[StepNumber] = None        # the server's alert id (the loop's LoopAlert.id)
    step: Optional[StepNumber] = None            # where its episode started
    name: Optional[ShortText] = None             # "loss_nonfinite"


class RewindData(BaseModel):
    """The data of a ``rewind`` event (docs/wire-format.md, "The rewind event"): one remediation the agent's
    Rewind policy took. ``action``: ``rewind`` (weights restored to ``to_step``), ``cool`` (LR multiplied by
    ``lr_factor`` for ``cool_steps``, no rewind) or ``gave_up`` (``max_rewinds`` reached: ``then``)."""
    model_config = ConfigDict(extra="ignore")

    action: Literal["rewind", "cool", "gave_up"]
    from_step: StepNumber
    to_step: Optional[StepNumber] = None         # required for a rewind
    batches_skipped: Optional[Count] = None
    lr_factor: float = Field(default=1.0, gt=0, le=1e6, allow_inf_nan=False)
    cool_steps: Count = 0
    trigger: Optional[RewindTrigger] = None
    snapshot_age_steps: Optional[Count] = None
    rewind_number: Optional[Count] = None
    max_rewinds: Optional[Count] = None
    then: Optional[Literal["stop", "continue"]] = None

    @model_validator(mode="after")
    def _a_rewind_goes_back(self) -> "RewindData":
        if self.action == "rewind":
            if self.to_step is None:
                raise ValueError("to_step: a rewind names the step it went back to")
            if self.to_step > self.from_step:
                raise ValueError(f"to_step={self.to_step} is after from_step={self.from_step}: a rewind goes back")
        return self


EVENT_DATA_MODELS: dict[str, type[BaseModel]] = {"rewind": RewindData}   # kinds whose data has a fixed shape


class EventIn(BaseModel):
    model_config = ConfigDict(extra="ignore")

    step: Optional[int] = Field(default=None, ge=0, le=2**62, strict=True)
    kind: Annotated[str, StringConstraints(min_length=1, max_length=64), NoNul]
    data: Annotated[dict[str, Any], AfterValidator(_bounded_event_data)] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _data_of_its_kind(self) -> "EventIn":
        """A kind with a declared shape (``EVENT_DATA_MODELS``) is checked here, so a malformed one is a 422
        naming the field (``events[0]: rewind data.to_step: …``); the data is stored as sent."""
        model = EVENT_DATA_MODELS.get(self.kind)
        if model is not None:
            try:
                model.model_validate(self.data)
            except ValidationError as e:
                problems = "; ".join(
                    f"{'.'.join(str(p) for p in err['loc']) or 'data'}: {err['msg'].removeprefix('Value error, ')}"
                    for err in e.errors()[:5])
                raise ValueError(f"{self.kind} data: {problems}") from None
        return self


class MetaIn(BaseModel):
    model_config = ConfigDict(extra="allow")

    param_names: Optional[list[LayerName]] = Field(default=None, max_length=MAX_LAYERS)
    module_names: Optional[list[LayerName]] = Field(default=None, max_length=MAX_LAYERS)
    bn_names: Optional[list[LayerName]] = Field(default=None, max_length=MAX_LAYERS)
    config: Optional[dict[str, Any]] = None
    host: Optional[str] = None
    pid: Optional[int] = None
    torch: Optional[str] = None
    started_at: Optional[float] = Field(default=None, allow_inf_nan=False)
    # sharded runs (FSDP / DTensor): [index, count] per param_names entry, the piece of it this rank holds
    param_shards: Optional[list[tuple[Annotated[int, Field(ge=0, le=1_000_000)],
                                      Annotated[int, Field(ge=0, le=1_000_000)]]]] = Field(
        default=None, max_length=MAX_LAYERS)


class IngestBatchIn(BaseModel):
    """``POST /api/v1/ingest`` body."""

    model_config = ConfigDict(extra="ignore")

    batch_id: Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_.:-]{1,64}$")]
    project: Name
    run: Name
    rank: int = Field(default=0, ge=0, le=1_000_000, strict=True)
    world_size: int = Field(default=1, ge=1, le=1_000_000, strict=True)
    meta: Optional[MetaIn] = None
    steps: list[StepIn] = Field(max_length=100_000)
    events: list[EventIn] = Field(default_factory=list, max_length=10_000)
    status: Optional[Literal["running", "finished", "crashed"]] = None
    # the sending process's step numbering (docs/resume.md): a guessed one ("optimizer", "process") is
    # continued after the run's stored steps when it would collide with them; "given" is stored as is
    session: Optional[Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_.:-]{1,64}$")]] = None
    step_origin: Optional[Literal["given", "optimizer", "process"]] = None
    step_start: Optional[int] = Field(default=None, ge=0, le=2**62, strict=True)
    # Alerts in the loop (docs/alerts-in-the-loop.md): the ``alerts_cursor`` of the previous reply, 0 in a
    # process's first batch; absent: the reply carries no alerts (spool replays by `gradwatch sync`, old agents).
    alerts_after: Optional[float] = Field(default=None, ge=0, allow_inf_nan=False)


class IngestResult(BaseModel):
    run_id: int
    accepted: int
    duplicate: bool
    # how far this batch's steps were moved to continue the run's stored ones (its session's shift)
    step_shift: int = 0
    # steps of the batch not written: steps of those numbers were stored already (never overwritten)
    already_stored: int = 0
    # an open run page is watching the run: the agent sends every live_flush_interval meanwhile
    # (server/ingest/live_news.py)
    live: bool = False
    # the least seconds this rank's agent should leave between batches (0: its own flush_interval): a
    # run of many ranks is paced so that its batches together hold the run's lock a bounded share of the
    # time (server/ingest/pacing.py, rank_pace)
    pace: float = 0.0
    # Only when the batch asked (``alerts_after``): the run's alerts created or changed since then, newest
    # first, and the cursor to send next (docs/alerts-in-the-loop.md, "On the wire").
    alerts: Optional[list["AlertOut"]] = None
    alerts_cursor: Optional[float] = None


# --------------------------------------------------------------------------- responses

class HealthOut(BaseModel):
    status: str
    database: str


# A run as the query layer returns it (``queries.list_runs``) and the API answers it; ``bytes`` is the API's
# (the route fills it from server/lifecycle/sizes.py).
class RunOut(BaseModel):
    id: int
    project: str
    name: str
    status: str
    last_step: Optional[int]
    last_loss: OutFloat
    started_at: float
    last_seen: float
    open_alerts: int
    health: str
    world_size: int = 1
    # estimated bytes the run takes in the database (server/lifecycle/sizes.py says how)
    bytes: Optional[int] = None


# One run (``queries.get_run``); ``signals`` and ``attention_modules`` are filled by the route.
class RunDetailOut(RunOut):
    param_names: list[Any]
    module_names: list[Any]
    bn_names: list[Any]
    config: dict[str, Any]
    signals: list[str] = []       # every series the run can be read as: step signals, then custom:<key>
    # the modules whose attention logits the agent measures (its latest attention_coverage event); None: the agent
    # has not said (logits off, or an agent before issue 33); [] with the model a Transformer: rule H11's note
    attention_modules: Optional[list[str]] = None


class RunListOut(BaseModel):
    runs: list[RunOut]


# A series: what ``queries.get_series`` returns, and the schema of ``/api/v1/runs/{id}/series``. Dataclasses, not
# pydantic models: a series holds up to MAX_SERIES_POINTS buckets and a dataclass bucket is built about 4 times
# faster than a validated model (timeit on this project's 2-core machine at load ~10: 2.4 vs 9.2 us). The route
# writes the JSON itself (server/api/runs.py, _series_out); pydantic reads these classes only for the OpenAPI
# schema, which is the same as the models' was. Floats are Python floats (nan / inf kept), None "not measured".
@dataclass
class SeriesPointOut:
    step: int               # first step of the bucket (the step itself when bucket_size == 1)
    min: OutFloat           # over non-NaN values; NaN when every measured value was NaN
    max: OutFloat
    last: OutFloat          # value at the bucket's last measured step (may be NaN / ±inf)
    count: int              # measured steps (NaN included)
    nonfinite: int          # NaN and ±inf among them


@dataclass(kw_only=True)
class SeriesOut:
    run_id: int
    signal: str
    rank: int = 0
    bucket_size: int
    points: Annotated[list[SeriesPointOut], Field(serialization_alias="steps")]   # "steps" on the wire


class SeriesMultiOut(BaseModel):
    series: list[SeriesOut]


class LayerMatrixOut(BaseModel):
    run_id: int
    stat: str
    rank: int = 0
    agg: str
    bucket_size: int
    layer_group_size: int
    steps: list[int]
    layers: list[str]
    values: list[list[OutFloat]]


# An alert: its one shape outside the database. The query layer builds it (``queries.alert_out``) and every
# reader takes it as built: /api/v1/alerts, the ack's answer, the ingest reply's ``alerts``, the dashboard, the
# incident page, the CLI (docs/architecture.md, "One read model per resource"). A comment, not a docstring: a
# docstring would become the OpenAPI schema's description.
class AlertOut(BaseModel):
    id: int
    run_id: int
    rule: str
    name: str
    severity: str
    status: str
    step: int
    first_step: int
    last_step: int
    rank: int
    message: str
    diagnosis: str
    actions: list[Any]
    evidence: dict[str, Any]
    acknowledged: bool
    created_at: float
    updated_at: float
    resolved_at: Optional[float] = None
    suppressed_by: Optional[int] = None          # the alert inhibiting this one (not notified)
    suppressed_by_rule: Optional[str] = None     # e.g. "A1 loss_nonfinite rank 2"
    silenced_by: Optional[int] = None            # the silence covering it (not notified)
    muted: Optional[str] = None                  # "warm-up": started in the project's warm-up window


class AlertListOut(BaseModel):
    alerts: list[AlertOut]


# An event as the query layer returns it (``queries.list_events``) and the API answers it.
class EventOut(BaseModel):
    id: int
    run_id: int
    rank: int
    step: Optional[int]
    kind: str
    data: dict[str, Any]
    time: float


class EventListOut(BaseModel):
    events: list[EventOut]


# A checkpoint as the query layer returns it (``queries.list_checkpoints``) and the API answers it.
class CheckpointOut(BaseModel):
    step: int                     # optimizer steps taken when it was saved: the step a resume continues with
    path: Optional[str]           # None: saved where gradwatch was not told (Lightning's trainer.save_checkpoint)
    rank: int                     # the lowest rank that recorded it
    saved_at: Optional[float]     # the agent's wall clock when it was recorded
    source: Optional[str]         # "transformers", "lightning", or None (monitor.checkpoint)


class CheckpointListOut(BaseModel):
    run_id: int
    checkpoints: list[CheckpointOut]


# One remediation of the agent's Rewind policy (a ``rewind`` event; docs/wire-format.md): at ``step``
# (= ``from_step``) it went back to ``to_step`` (``action`` ``rewind``), only cooled the LR (``cool``), or gave up
# (``gave_up``). ``trigger``: the alert it acted on, with the stored alert's rule, name and first step when the
# server has that alert (``alert_id``), else as the agent sent it. ``ranks``: the ranks that reported it (under
# DDP every rank rewinds at the same step); ``time``: when the server stored the first report; ``text``: the
# sentence every view shows (server/queries/rewind_text.py).
class RewindOut(BaseModel):
    """One rewind as ``GET /api/v1/runs/{id}/rewinds`` lists it (server/queries/events.py, ``list_rewinds``)."""
    step: int
    action: str
    from_step: int
    to_step: Optional[int]
    batches_skipped: Optional[int]
    lr_factor: float
    cool_steps: int
    snapshot_age_steps: Optional[int]
    rewind_number: Optional[int]
    max_rewinds: Optional[int]
    then: Optional[str]
    trigger: Optional[dict[str, Any]]
    ranks: list[int]
    time: float
    text: str


class RewindListOut(BaseModel):
    run_id: int
    rewinds: list[RewindOut]


# --------------------------------------------------------------------------- data lifecycle

class DeletedRunOut(BaseModel):
    id: int
    project: str
    name: str
    status: str
    last_seen: float
    bytes: int          # estimated, taken before the delete


class DeleteOut(BaseModel):
    """What a delete removed, or (``dry_run``) would remove."""

    dry_run: bool
    runs: list[DeletedRunOut]
    bytes: int          # the runs' estimated bytes together
    rows: int           # rows removed (0 on a dry run)
    seconds: float
    project: Optional[str] = None


class StorageOut(BaseModel):
    dialect: str
    bytes: int                      # SQLite: page_count x page_size; PostgreSQL: pg_database_size
    free_bytes: Optional[int]       # SQLite: free pages, reused by new data before the file grows
