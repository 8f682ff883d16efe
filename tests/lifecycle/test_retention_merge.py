"""Retention's merge of a bucket's partials (server/lifecycle/retention.py) against a brute force.

A run's steps are cut into batches as ingest receives them, each batch makes its partials
(server/storage/rollups.py), and the partials of each (level, bucket) are merged into one; the merged partial
must hold what walking every raw value of the bucket gives (tests/server/test_rollup_partials.py's
references): min, max, sum (float32), counts, NaN counts, the last value and its step.
"""
from __future__ import annotations

import math

import numpy as np
import pytest

from gradwatch.server.lifecycle.retention import merge_layer_blobs, merge_step_blobs
from gradwatch.server.storage.models import ROLLUP_LEVELS
from gradwatch.server.wire.numbers import NULL_F32_BITS
from gradwatch.server.storage.rollups import layer_partial_arrays, layer_partials, step_partials
from tests.server.test_rollup_partials import NAN_BITS, S, _f32, _reference_layer, _reference_steps, _same


def _batches(rng, n: int) -> list[tuple[int, int]]:
    """Consecutive index ranges [lo, hi) of random sizes, as an agent's flushes cut a run."""
    cuts = sorted(set(rng.integers(1, n, size=int(rng.integers(1, max(2, n // 5)))).tolist()))
    edges = [0, *cuts, n]
    return [(a, b) for a, b in zip(edges, edges[1:]) if b > a]


def _steps(rng, n: int, spread: int) -> np.ndarray:
    start = int(rng.integers(0, 5000))
    return np.sort(rng.choice(np.arange(start, start + n * spread), size=n, replace=False)).astype(np.int64)


@pytest.mark.parametrize("spread", [1, 3, 100], ids=["every-step", "gappy", "sampled-every-100"])
def test_merged_step_partials_match_brute_force(spread):
    rng = np.random.default_rng(7 + spread)
    for trial in range(15):
        n = int(rng.integers(2, 400))
        steps = _steps(rng, n, spread)
        values = rng.normal(size=(n, S))
        measured = rng.random((n, S)) > 0.2
        m = rng.random((n, S))
        values[m < 0.05] = np.nan
        values[m > 0.97] = np.inf
        values[(m > 0.95) & (m <= 0.97)] = -np.inf
        values[~measured] = np.nan
        parts: dict[tuple[int, int], list[bytes]] = {}
        for lo, hi in _batches(rng, n):
            for level, b, blob in step_partials(steps[lo:hi], values[lo:hi], measured[lo:hi]):
                parts.setdefault((level, b), []).append(blob)
        for level in ROLLUP_LEVELS:
            ref = _reference_steps(steps, values, measured, level)
            for b, rows in ref.items():
                blobs = parts[(level, b)]
                arr = np.frombuffer(merge_step_blobs(blobs), dtype="<f8").reshape(6, S)
                for row in range(6):
                    for j in range(S):
                        assert _same(float(arr[row, j]), rows[row][j]), (trial, level, b, row, j, len(blobs))


@pytest.mark.parametrize("spread", [1, 3, 100], ids=["every-step", "gappy", "sampled-every-100"])
def test_merged_layer_partials_match_brute_force(spread):
    rng = np.random.default_rng(70 + spread)
    merged_some = kept_compact = 0
    for trial in range(15):
        n = int(rng.integers(2, 400))
        steps = _steps(rng, n, spread)
        width = int(rng.integers(1, 10))
        blobs = []
        for _ in range(n):
            w = width if rng.random() < 0.85 else int(rng.integers(1, width + 1))   # a layer list that grew
            bits = rng.normal(scale=3.0, size=w).astype("<f4").view("<u4").copy()
            r = rng.random(w)
            bits[r < 0.06] = NULL_F32_BITS
            bits[(r >= 0.06) & (r < 0.1)] = NAN_BITS
            vals = bits.view("<f4")
            vals[(r >= 0.1) & (r < 0.12)] = np.inf
            vals[(r >= 0.12) & (r < 0.13)] = -np.inf
            blobs.append(bits.tobytes())
        parts: dict[tuple[int, int], list[bytes]] = {}
        for lo, hi in _batches(rng, n):
            for level, b, blob in layer_partials(steps[lo:hi], blobs[lo:hi]):
                parts.setdefault((level, b), []).append(blob)
        for level in ROLLUP_LEVELS:
            ref = _reference_layer(steps, blobs, level)
            for b, (last_step, rows) in ref.items():
                merged = merge_layer_blobs(parts[(level, b)])
                if merged is None:      # one-step partials that are smaller kept as they are
                    kept_compact += 1
                    assert all(np.frombuffer(p[:8], dtype="<f8")[0] < 0 for p in parts[(level, b)])
                    continue
                merged_some += 1
                _, got_last, arr = layer_partial_arrays([(b, merged)], width)
                assert got_last[0] == last_step, (trial, level, b)
                arr = arr[0]
                for k in range(width):
                    assert _same(float(arr[0, k]), _f32(rows[0][k])), (trial, level, b, k, "min")
                    assert _same(float(arr[1, k]), _f32(rows[1][k])), (trial, level, b, k, "max")
                    if math.isfinite(rows[2][k]):
                        assert float(arr[2, k]) == pytest.approx(rows[2][k], rel=1e-5, abs=1e-4)
                    else:
                        assert _same(float(arr[2, k]), rows[2][k])
                    assert (arr[3, k], arr[4, k]) == (rows[3][k], rows[4][k])
                    last = arr[5:6, k].view("<u4")[0]
                    assert last == (NULL_F32_BITS if rows[5][k] is None else rows[5][k]), (trial, level, b, k)
    assert merged_some > 0
    if spread == 100:
        assert kept_compact > 0
