"""Request and response models (the wire format: docs/wire-format.md).

Separate from the ORM models. Floats on the wire may be numbers, the strings
``"NaN"`` / ``"Infinity"`` / ``"-Infinity"`` or null (server/numbers.py).
Per-layer arrays are validated and packed to float32 blobs here, so the
ingest path never walks them again.
"""
from __future__ import annotations

import re
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, StringConstraints, WithJsonSchema

from .numbers import F32_B64_PREFIX, pack_layer_values, parse_wire_float, unpack_f32_b64

_WIRE_FLOAT_SCHEMA = {
    "anyOf": [{"type": "number"}, {"type": "string", "enum": ["NaN", "Infinity", "-Infinity"]}, {"type": "null"}]
}
WireFloat = Annotated[Optional[float], BeforeValidator(parse_wire_float), WithJsonSchema(_WIRE_FLOAT_SCHEMA)]
OutFloat = Annotated[Union[float, str, None], WithJsonSchema(_WIRE_FLOAT_SCHEMA)]

Name = Annotated[str, StringConstraints(min_length=1, max_length=200, strip_whitespace=False)]
StatName = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_.:/-]{1,32}$")]
CustomKey = Annotated[str, StringConstraints(min_length=1, max_length=200)]
MAX_LAYERS = 100_000


def _pack(values: Any) -> bytes:
    if isinstance(values, str):
        return unpack_f32_b64(values, max_values=MAX_LAYERS)
    if not isinstance(values, list):
        raise ValueError(f'expected an array of numbers or an "{F32_B64_PREFIX}…" string, '
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


class StepIn(BaseModel):
    """One optimizer step of one rank."""

    model_config = ConfigDict(extra="ignore")

    step: int = Field(ge=0, le=2**62, strict=True)
    time: Annotated[float, BeforeValidator(parse_wire_float), WithJsonSchema({"type": "number"})] = Field(
        allow_inf_nan=False
    )
    loss: WireFloat = None
    grad_norm: WireFloat = None
    clip_max_norm: WireFloat = None
    clipped: StrictBool = None
    loss_scale: WireFloat = None
    overflow: StrictBool = None
    overflow_count: Count = None
    lr: WireFloat = None
    step_time: WireFloat = None
    samples_per_s: WireFloat = None
    tokens_per_s: WireFloat = None
    mem_peak: WireFloat = None
    ema_divergence: WireFloat = None
    input_nonfinite: Count = None
    custom: dict[CustomKey, WireFloat] = Field(default_factory=dict, max_length=1000)
    layers: dict[StatName, LayerArray] = Field(default_factory=dict, max_length=64)


class EventIn(BaseModel):
    model_config = ConfigDict(extra="ignore")

    step: Optional[int] = Field(default=None, ge=0, le=2**62, strict=True)
    kind: Annotated[str, StringConstraints(min_length=1, max_length=64)]
    data: dict[str, Any] = Field(default_factory=dict)


class MetaIn(BaseModel):
    model_config = ConfigDict(extra="allow")

    param_names: Optional[list[Annotated[str, StringConstraints(max_length=1000)]]] = Field(default=None, max_length=MAX_LAYERS)
    module_names: Optional[list[Annotated[str, StringConstraints(max_length=1000)]]] = Field(default=None, max_length=MAX_LAYERS)
    bn_names: Optional[list[Annotated[str, StringConstraints(max_length=1000)]]] = Field(default=None, max_length=MAX_LAYERS)
    config: Optional[dict[str, Any]] = None
    host: Optional[str] = None
    pid: Optional[int] = None
    torch: Optional[str] = None
    started_at: Optional[float] = Field(default=None, allow_inf_nan=False)


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


class IngestResult(BaseModel):
    run_id: int
    accepted: int
    duplicate: bool


# --------------------------------------------------------------------------- responses

class HealthOut(BaseModel):
    status: str
    database: str


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


class RunDetailOut(RunOut):
    param_names: list[Any]
    module_names: list[Any]
    bn_names: list[Any]
    config: dict[str, Any]


class RunListOut(BaseModel):
    runs: list[RunOut]


class SeriesPointOut(BaseModel):
    step: int
    min: OutFloat
    max: OutFloat
    last: OutFloat
    count: int
    nonfinite: int


class SeriesOut(BaseModel):
    run_id: int
    signal: str
    rank: int = 0
    bucket_size: int
    steps: list[SeriesPointOut]


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


class AlertListOut(BaseModel):
    alerts: list[AlertOut]


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
