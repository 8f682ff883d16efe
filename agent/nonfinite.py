"""Non-finite floats on the wire: the one encoder and the one decoder (and the "not measured" marker
of compact layer arrays).

JSON has no NaN or Infinity, so every body gradwatch sends or serves (ingest,
read API, webhooks, alert evidence, rule state) spells them as the strings
``"NaN"``, ``"Infinity"`` and ``"-Infinity"``; ``None`` stays JSON ``null``
("not measured"). The agent encodes, the server decodes ingest bodies and
encodes responses, the dashboard decodes responses: all through here.

Leaf module: standard library only (the agent, the server and the dashboard
import it; a monitoring host has no torch).

>>> encode_float(float("nan")), encode_float(float("-inf")), encode_float(1.5), encode_float(None)
('NaN', '-Infinity', 1.5, None)
>>> decode_float("Infinity"), decode_float(2), decode_float(None)
(inf, 2.0, None)
"""
from __future__ import annotations

import math
from typing import Any, Optional

NAN_STR, INF_STR, NINF_STR = "NaN", "Infinity", "-Infinity"
WIRE_STRINGS = (NAN_STR, INF_STR, NINF_STR)
# Compact per-layer arrays (docs/wire-format.md): "f32:" + base64 of little-endian float32, where "not
# measured" is the quiet NaN with this bit pattern (a real NaN is the canonical one, 0x7FC00000). The
# agent encodes them, the server stores those bytes as they are.
F32_PREFIX = "f32:"
NULL_F32_BITS = 0x7FC0DEAD
# Python's own spellings are accepted too: `float("nan")` round-tripped through str() or a CSV.
_FROM_STR = {NAN_STR: math.nan, INF_STR: math.inf, NINF_STR: -math.inf,
             "nan": math.nan, "inf": math.inf, "-inf": -math.inf}


def encode_float(value: Optional[float]) -> Any:
    """A float for a JSON body: finite values as they are, non-finite ones as the wire strings."""
    if value is None:
        return None
    if value != value:
        return NAN_STR
    if value == math.inf:
        return INF_STR
    if value == -math.inf:
        return NINF_STR
    return value


def decode_float(value: Any) -> Optional[float]:
    """A wire float: a number, ``"NaN"`` / ``"Infinity"`` / ``"-Infinity"`` or null.

    Raises ``ValueError`` for anything else (booleans included), with a message that names the value.
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


def decode_float_or_none(value: Any) -> Optional[float]:
    """:func:`decode_float` for display code: anything undecodable is ``None`` instead of an error."""
    try:
        return decode_float(value)
    except ValueError:
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                return None
        return None


def encode_json(obj: Any) -> Any:
    """A deep copy of a JSON-like value with every non-finite float as a wire string (dict keys as str).

    >>> encode_json({"a": [float("inf"), 1.0], 2: (None,)})
    {'a': ['Infinity', 1.0], '2': [None]}
    """
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else encode_float(obj)
    if isinstance(obj, dict):
        return {str(k): encode_json(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [encode_json(v) for v in obj]
    return obj
