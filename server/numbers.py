"""Non-finite float encoding shared by the ingest and read paths.

JSON has no NaN/Infinity, and SQLite stores a float NaN as NULL, so NaN,
+Inf, -Inf and "not measured" (null) need an explicit scheme to survive a
round trip on both databases:

- scalar columns (``steps``): NaN is stored as NULL **and** a bit in the row's
  ``nan_mask`` (bit i = ``STEP_SIGNALS[i]``); ±Inf are stored as themselves
  (both SQLite REAL and PostgreSQL double precision keep them); NULL with the
  bit clear is "not measured".
- custom scalars: NULL + ``is_nan``.
- per-layer arrays (``layer_stats.values``): little-endian float32; NaN is the
  canonical quiet NaN, "not measured" is a NaN with the payload
  ``NULL_F32_BITS`` so the two stay distinct inside one blob.

On the wire (read responses) non-finite values are the strings ``"NaN"``,
``"Infinity"`` and ``"-Infinity"``; ``None`` is JSON ``null``.
"""
from __future__ import annotations

import base64
import binascii
import math
from typing import Any, Iterable, Optional

import numpy as np

NAN_STR, INF_STR, NINF_STR = "NaN", "Infinity", "-Infinity"
_FROM_STR = {NAN_STR: math.nan, INF_STR: math.inf, NINF_STR: -math.inf,
             "nan": math.nan, "inf": math.inf, "-inf": -math.inf}

# float32 bit patterns: canonical NaN and the "not measured" marker.
NAN_F32_BITS = 0x7FC00000
NULL_F32_BITS = 0x7FC0DEAD
_NUMBER_TYPES = {float, int}
_NULL_F32 = np.array([NULL_F32_BITS], dtype="<u4").view("<f4")[0]


def parse_wire_float(value: Any) -> Optional[float]:
    """A wire float: number, ``"NaN"``/``"Infinity"``/``"-Infinity"`` or null.

    Raises ``ValueError`` for anything else (booleans included).
    """
    if value is None:
        return None
    if isinstance(value, bool):
        raise ValueError("expected a number, got a boolean")
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        try:
            return _FROM_STR[value]
        except KeyError:
            raise ValueError(f'expected a number, "NaN", "Infinity" or "-Infinity", got {value[:40]!r}') from None
    raise ValueError(f"expected a number, got {type(value).__name__}")


def to_wire(value: Optional[float]) -> Any:
    """A float for a JSON response: non-finite values become strings."""
    if value is None:
        return None
    if value != value:
        return NAN_STR
    if value == math.inf:
        return INF_STR
    if value == -math.inf:
        return NINF_STR
    return value


def pack_layer_values(values: list[Any]) -> bytes:
    """Wire layer array -> float32 blob (raises ValueError naming the index)."""
    if set(map(type, values)) <= _NUMBER_TYPES:  # fast path: plain numbers only
        return np.array(values, dtype="<f4").tobytes()
    out = np.empty(len(values), dtype="<f4")
    for i, v in enumerate(values):
        try:
            f = parse_wire_float(v)
        except ValueError as e:
            raise ValueError(f"[{i}]: {e}") from None
        out[i] = _NULL_F32 if f is None else f
    return out.tobytes()


F32_B64_PREFIX = "f32:"


def unpack_f32_b64(text: str, *, max_values: int) -> bytes:
    """Compact wire layer array ``"f32:" + base64(little-endian float32)`` -> the stored blob.

    The bytes are the storage format itself (NaN, ±Inf, and ``NULL_F32_BITS`` for "not measured"), so
    nothing is walked value by value: an agent saves building a JSON list and the server saves parsing one.
    """
    if not text.startswith(F32_B64_PREFIX):
        raise ValueError(f'expected an array of numbers or an "{F32_B64_PREFIX}…" base64 string, got {text[:40]!r}')
    if len(text) > len(F32_B64_PREFIX) + 4 * (max_values * 4 + 2) // 3 + 4:
        raise ValueError(f"at most {max_values} layer values")
    try:
        blob = base64.b64decode(text[len(F32_B64_PREFIX):], validate=True)
    except (binascii.Error, ValueError):
        raise ValueError(f'"{F32_B64_PREFIX}" array is not valid base64') from None
    if len(blob) % 4:
        raise ValueError(f'"{F32_B64_PREFIX}" array holds {len(blob)} bytes, not a whole number of float32 values')
    return blob


def pack_f32_b64(arr) -> str:
    """float32 values (numpy / anything ``np.asarray`` takes) -> the compact wire string."""
    return F32_B64_PREFIX + base64.b64encode(np.asarray(arr, dtype="<f4").tobytes()).decode("ascii")


def unpack_layer_values(blob: bytes) -> np.ndarray:
    """float32 blob -> float64 array with NaN for NaN and for "not measured"; see ``null_mask``."""
    return np.frombuffer(blob, dtype="<f4")


def null_mask(arr_f32: np.ndarray) -> np.ndarray:
    return arr_f32.view("<u4") == NULL_F32_BITS


def layer_values_to_wire(arr_f32: np.ndarray) -> list[Any]:
    nulls = null_mask(arr_f32)
    return [None if n else to_wire(float(v)) for v, n in zip(arr_f32.tolist(), nulls.tolist())]


def floats_to_wire(values: Iterable[Optional[float]]) -> list[Any]:
    return [to_wire(v) for v in values]


def json_safe(obj: Any) -> Any:
    """Deep copy of a JSON-like value with non-finite floats as wire strings.

    PostgreSQL's json type rejects NaN/Infinity tokens; free-form JSON
    (events' data, run config) goes through this before it is stored.
    """
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else to_wire(obj)
    if isinstance(obj, dict):
        return {str(k): json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj
