"""Payload builders and a raw HTTP helper for the server tests."""
from __future__ import annotations

import gzip
import json
import math
import urllib.error
import urllib.request
import uuid
from typing import Any, Optional

N_PARAMS = 6


def step(i: int, **over) -> dict[str, Any]:
    s = {
        "step": i, "time": 1_700_000_000.0 + i, "loss": 2.0 - i * 0.001, "grad_norm": 0.5 + (i % 7) * 0.01,
        "clip_max_norm": 1.0, "clipped": False, "loss_scale": 65536.0, "overflow": False, "overflow_count": 0,
        "lr": 3e-4, "step_time": 0.05, "samples_per_s": 1000.0, "tokens_per_s": None, "mem_peak": None,
        "ema_divergence": 0.001, "input_nonfinite": 0, "custom": {"acc": 0.5},
        "layers": {"grad_norm": [0.1 * (k + 1) for k in range(N_PARAMS)]},
    }
    s.update(over)
    return s


def batch(steps: list[dict], *, run: str = "exp", project: str = "default", rank: int = 0,
          batch_id: Optional[str] = None, **over) -> dict[str, Any]:
    b = {"batch_id": batch_id or uuid.uuid4().hex, "project": project, "run": run, "rank": rank,
         "world_size": 1, "steps": steps,
         "meta": {"param_names": [f"p{k}.weight" for k in range(N_PARAMS)], "module_names": ["m0", "m1"],
                  "config": {"max_norm": 1.0}}}
    b.update(over)
    return b


def post_raw(url: str, body: bytes, headers: dict[str, str], timeout: float = 30.0) -> tuple[int, Any]:
    req = urllib.request.Request(url, data=body, method="POST")
    for k, v in headers.items():
        req.add_header(k, v)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            raw, status = resp.read(), resp.status
    except urllib.error.HTTPError as e:
        raw, status = e.read(), e.code
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode(errors="replace")


def post_json_text(url: str, text: str, *, gzip_it: bool = False, headers: Optional[dict] = None):
    """POST a body given as JSON text (so bare NaN tokens can be sent)."""
    body = text.encode()
    h = {"Content-Type": "application/json", **(headers or {})}
    if gzip_it:
        body = gzip.compress(body)
        h["Content-Encoding"] = "gzip"
    return post_raw(url, body, h)


def wire(v):
    """What a read response carries for a float."""
    if v is None:
        return None
    if isinstance(v, float) and math.isnan(v):
        return "NaN"
    if v == math.inf:
        return "Infinity"
    if v == -math.inf:
        return "-Infinity"
    return v


def expected_bucket(values: list) -> tuple:
    """Brute force of one series bucket from ``(step, value)`` pairs (None: not measured), as the read
    API answers it: min, max (NaN skipped, "NaN" when every measured value was NaN), last, count, nonfinite."""
    measured = [(s, v) for s, v in values if v is not None]
    finite_or_inf = [v for _, v in measured if not math.isnan(v)]
    last = max(measured)[1] if measured else None
    return (wire(min(finite_or_inf)) if finite_or_inf else ("NaN" if measured else None),
            wire(max(finite_or_inf)) if finite_or_inf else ("NaN" if measured else None),
            wire(last), len(measured), sum(1 for _, v in measured if not math.isfinite(v)))

