"""How numbers are stored: NaN, ±Inf and "not measured" on both databases.

The wire spelling of non-finite floats (``"NaN"``, ``"Infinity"``,
``"-Infinity"``) has one encoder and one decoder, in ``agent/nonfinite.py``;
this module re-exports them for the server's read and write paths and adds
the storage encodings. SQLite stores a float NaN as NULL, so:

- scalar columns (``steps``): NaN is stored as NULL **and** bit ``id`` of the
  row's ``nan_mask`` (the signal's permanent id, agent/signals.py); ±Inf are
  stored as themselves (both SQLite REAL and PostgreSQL double precision keep
  them); NULL with the bit clear is "not measured".
- ``steps.extra``: the signals without a column, little-endian float64 at
  slot ``id - EXTRA_BASE``; NaN is the canonical quiet NaN, "not measured" the
  NaN with payload ``NULL_F64_BITS``, trailing unmeasured slots left out.
- custom scalars: NULL + ``is_nan``.
- per-layer arrays (``layer_stats.values``): little-endian float32; NaN is the
  canonical quiet NaN, "not measured" is a NaN with the payload
  ``NULL_F32_BITS`` so the two stay distinct inside one blob.
"""
from __future__ import annotations

import base64
import binascii
import math
from typing import Any, Optional, Sequence

import numpy as np

from gradwatch.agent.nonfinite import (F32_PREFIX, NULL_F32_BITS, decode_float, encode_float,  # noqa: F401 (re-exported)
                             encode_json)

# Free-form JSON (event data, run config) goes through encode_json before it is stored: PostgreSQL's
# json type rejects NaN / Infinity tokens.

# float64 bit pattern of "not measured" in steps.extra (float32's, NULL_F32_BITS, is the wire's)
NULL_F64_BITS = 0x7FF800000000DEAD
_NUMBER_TYPES = {float, int}
_NULL_F32 = np.array([NULL_F32_BITS], dtype="<u4").view("<f4")[0]
_NULL_F64 = np.array([NULL_F64_BITS], dtype="<u8").view("<f8")[0]

def pack_extra(values: Sequence[Optional[float]]) -> Optional[bytes]:
    """The ``steps.extra`` blob of one step: ``values`` by slot, None for "not measured".

    >>> pack_extra([None, None]) is None, len(pack_extra([1.0, None])), unpack_extra(pack_extra([None, 2.0])).tolist()[1]
    (True, 8, 2.0)
    """
    n = len(values)
    while n and values[n - 1] is None:
        n -= 1
    if not n:
        return None
    return np.array([_NULL_F64 if v is None else v for v in values[:n]], dtype="<f8").tobytes()


def unpack_extra(blob: Optional[bytes]) -> np.ndarray:
    """A ``steps.extra`` blob -> float64 by slot (the "not measured" NaN kept; see ``extra_measured``)."""
    return np.frombuffer(blob or b"", dtype="<f8")


def extra_measured(arr_f64: np.ndarray) -> np.ndarray:
    return arr_f64.view("<u8") != NULL_F64_BITS


# Reading a stored step row back: every reader (query layer, rule engine, resume, ingest's rollups) goes
# through these three, so the NaN / "not measured" encodings above are decoded in one place.

def column_value(value: Optional[float], nan: bool) -> Optional[float]:
    """A column signal of a stored step: NaN when its NaN flag (its ``nan_mask`` bit) is set, None when
    not measured, else the value as a float.

    >>> column_value(None, True), column_value(None, False), column_value(True, False)
    (nan, None, 1.0)
    """
    if nan:
        return math.nan
    return None if value is None else float(value)


def extra_value(blob: Optional[bytes], slot: int) -> Optional[float]:
    """The signal at ``slot`` of a stored step's ``extra`` blob: None when not measured (a shorter blob,
    or none, did not measure it).

    >>> extra_value(pack_extra([None, 2.0]), 1), extra_value(pack_extra([None, 2.0]), 0), extra_value(None, 3)
    (2.0, None, None)
    """
    arr = unpack_extra(blob)
    if slot < len(arr) and extra_measured(arr[slot:slot + 1])[0]:
        return float(arr[slot])
    return None


def extra_values(blob: Optional[bytes]) -> tuple[np.ndarray, np.ndarray]:
    """A stored step's whole ``extra`` blob -> (float64 by slot with NaN where not measured, measured by
    slot), as long as the blob (trailing unmeasured slots are not stored)."""
    arr = unpack_extra(blob)
    ok = extra_measured(arr)
    return np.where(ok, arr, np.nan), ok


def pack_layer_values(values: list[Any]) -> bytes:
    """Wire layer array -> float32 blob (raises ValueError naming the index)."""
    if set(map(type, values)) <= _NUMBER_TYPES:  # fast path: plain numbers only
        return np.array(values, dtype="<f4").tobytes()
    out = np.empty(len(values), dtype="<f4")
    for i, v in enumerate(values):
        try:
            f = decode_float(v)
        except ValueError as e:
            raise ValueError(f"[{i}]: {e}") from None
        out[i] = _NULL_F32 if f is None else f
    return out.tobytes()


def unpack_f32_b64(text: str, *, max_values: int) -> bytes:
    """Compact wire layer array ``"f32:" + base64(little-endian float32)`` -> the stored blob.

    The bytes are the storage format itself (NaN, ±Inf, and ``NULL_F32_BITS`` for "not measured"), so
    nothing is walked value by value: an agent saves building a JSON list and the server saves parsing one.
    """
    if not text.startswith(F32_PREFIX):
        raise ValueError(f'expected an array of numbers or an "{F32_PREFIX}…" base64 string, got {text[:40]!r}')
    if len(text) > len(F32_PREFIX) + 4 * (max_values * 4 + 2) // 3 + 4:
        raise ValueError(f"at most {max_values} layer values")
    try:
        blob = base64.b64decode(text[len(F32_PREFIX):], validate=True)
    except (binascii.Error, ValueError):
        raise ValueError(f'"{F32_PREFIX}" array is not valid base64') from None
    if len(blob) % 4:
        raise ValueError(f'"{F32_PREFIX}" array holds {len(blob)} bytes, not a whole number of float32 values')
    if len(blob) > 4 * max_values:   # the text bound above leaves room for padding: the decoded count decides
        raise ValueError(f"at most {max_values} layer values")
    return blob


def pack_f32_b64(arr) -> str:
    """float32 values (numpy / anything ``np.asarray`` takes) -> the compact wire string."""
    return F32_PREFIX + base64.b64encode(np.asarray(arr, dtype="<f4").tobytes()).decode("ascii")


def unpack_layer_values(blob: bytes) -> np.ndarray:
    """float32 blob -> float64 array with NaN for NaN and for "not measured"; see ``null_mask``."""
    return np.frombuffer(blob, dtype="<f4")


def null_mask(arr_f32: np.ndarray) -> np.ndarray:
    """Where a float32 array (or its raw ``<u4`` bits) holds the wire's "not measured" pattern. The one test
    of it on the server: a NaN that was measured is a value (``np.isnan`` alone cannot tell them apart)."""
    return arr_f32.view("<u4") == NULL_F32_BITS


def measured_mask(arr_f32: np.ndarray) -> np.ndarray:
    """Where a float32 array (or its raw ``<u4`` bits) holds a measured value, NaN included: ``~null_mask``."""
    return arr_f32.view("<u4") != NULL_F32_BITS
