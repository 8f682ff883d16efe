"""The rollup partials ingest writes agree with a per-bucket brute-force computation.

``step_partials`` / ``layer_partials`` reduce each level from the one below it,
over a dense (bucket, step, …) layout or ``reduceat`` for sparse steps; this
checks every row of every partial against plain Python over the raw values,
for consecutive, gappy and sparse step sets, ragged layer arrays, NaN, ±inf
and "not measured". Layer partials are decoded with the readers' own
``layer_partial_arrays``, whichever of the two forms (full, or compact for a
bucket holding one step) each has.
"""
from __future__ import annotations

import math

import numpy as np
import pytest

from gradwatch.agent.signals import ROLLUP_WIDTH
from gradwatch.server.storage.models import ROLLUP_LEVELS
from gradwatch.server.wire.numbers import NULL_F32_BITS
from gradwatch.server.storage.rollups import layer_partial_arrays, layer_partial_width, layer_partials, step_partials

S = ROLLUP_WIDTH
NAN_BITS = 0x7FC00000


def _steps(rng, n: int, spread: int) -> np.ndarray:
    start = int(rng.integers(0, 20_000))
    return np.sort(rng.choice(np.arange(start, start + n * spread), size=n, replace=False)).astype(np.int64)


def _f32(x: float) -> float:
    return float(np.float32(x))


def _reference_layer(steps, blobs, level):
    """{bucket: (last_step, rows[6][width])} by walking every value."""
    width = max(len(b) // 4 for b in blobs)
    out = {}
    for s, blob in zip(steps.tolist(), blobs):
        bits = np.frombuffer(blob, dtype="<u4").tolist()
        b = s // level
        last_step, rows = out.setdefault(b, [None, [[math.nan] * width, [math.nan] * width, [0.0] * width,
                                                     [0] * width, [0] * width, [None] * width]])
        out[b][0] = s
        for k in range(width):
            if k >= len(bits) or bits[k] == NULL_F32_BITS:
                continue
            x = float(np.array([bits[k]], dtype="<u4").view("<f4")[0])
            rows[5][k] = bits[k]
            if math.isnan(x):
                rows[4][k] += 1
                continue
            rows[0][k] = x if math.isnan(rows[0][k]) else min(rows[0][k], x)
            rows[1][k] = x if math.isnan(rows[1][k]) else max(rows[1][k], x)
            rows[2][k] += x
            rows[3][k] += 1
    return out


def _reference_steps(steps, values, measured, level):
    out = {}
    for i, s in enumerate(steps.tolist()):
        b = s // level
        rows = out.setdefault(b, [[math.nan] * S, [math.nan] * S, [0.0] * S, [0.0] * S, [-1.0] * S, [math.nan] * S])
        for j in range(S):
            if not measured[i, j]:
                continue
            x = float(values[i, j])
            rows[2][j] += 1
            if not math.isfinite(x):
                rows[3][j] += 1
            rows[4][j], rows[5][j] = float(s), x
            if not math.isnan(x):
                rows[0][j] = x if math.isnan(rows[0][j]) else min(rows[0][j], x)
                rows[1][j] = x if math.isnan(rows[1][j]) else max(rows[1][j], x)
    return out


def _same(a: float, b: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or a == b


@pytest.mark.parametrize("spread", [1, 3, 60], ids=["consecutive", "gappy", "sparse"])
def test_layer_partials_match_brute_force(spread):
    rng = np.random.default_rng(spread)
    for trial in range(25):
        n = int(rng.integers(1, 300))
        steps = _steps(rng, n, spread)
        width = int(rng.integers(1, 12))
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
        got = layer_partials(steps, blobs)
        for level in ROLLUP_LEVELS:
            ref = _reference_layer(steps, blobs, level)
            mine = [(b, blob) for lv, b, blob in got if lv == level]
            assert [b for b, _ in mine] == sorted(ref), (trial, level)
            # a bucket holding one step of the batch is stored compact: -1 - step, then that raw array
            in_bucket = {}
            for i, s in enumerate(steps.tolist()):
                in_bucket.setdefault(s // level, []).append(i)
            for b, blob in mine:
                only = in_bucket[b][0] if len(in_bucket[b]) == 1 else None
                head = np.frombuffer(blob[:8], dtype="<f8")[0]
                if only is None:
                    assert len(blob) == 8 + 24 * width and head == ref[b][0], (trial, level, b)
                else:
                    assert blob[8:] == blobs[only] and head == -1.0 - float(steps[only]), (trial, level, b)
            buckets, last_steps, arrs = layer_partial_arrays(mine, width)
            assert buckets.tolist() == [b for b, _ in mine]
            for b, last_step_got, arr in zip(buckets.tolist(), last_steps.tolist(), arrs):
                last_step, rows = ref[b]
                assert last_step_got == last_step
                assert arr.shape == (6, width)
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


@pytest.mark.parametrize("spread", [1, 3, 60], ids=["consecutive", "gappy", "sparse"])
def test_step_partials_match_brute_force(spread):
    rng = np.random.default_rng(100 + spread)
    for trial in range(25):
        n = int(rng.integers(1, 300))
        steps = _steps(rng, n, spread)
        values = rng.normal(size=(n, S))
        measured = rng.random((n, S)) > 0.2
        m = rng.random((n, S))
        values[(m < 0.05)] = np.nan
        values[(m > 0.97)] = np.inf
        values[(m > 0.95) & (m <= 0.97)] = -np.inf
        values[~measured] = np.nan
        got = step_partials(steps, values, measured)
        for level in ROLLUP_LEVELS:
            ref = _reference_steps(steps, values, measured, level)
            mine = [(b, blob) for lv, b, blob in got if lv == level]
            assert [b for b, _ in mine] == sorted(ref), (trial, level)
            for b, blob in mine:
                arr = np.frombuffer(blob, dtype="<f8").reshape(6, S)
                for row in range(6):
                    for j in range(S):
                        assert _same(float(arr[row, j]), ref[b][row][j]), (trial, level, b, row, j)


def test_levels_must_divide():
    with pytest.raises(ValueError, match="divide"):
        layer_partials(np.arange(40, dtype=np.int64), [b"\0" * 8] * 40, levels=(16, 24))


def test_stats_sampled_together_give_the_partials_each_would_alone():
    """``layer_partials_by_stat`` reduces stats that share their steps side by side; each stat's
    partials must be exactly what it gets on its own, whatever its width."""
    from gradwatch.server.storage.rollups import layer_partials_by_stat

    rng = np.random.default_rng(5)
    every = np.arange(1000, 1178, dtype=np.int64)
    sampled = np.array([1000, 1100], dtype=np.int64)
    by_stat = {"grad_norm": (every, [rng.normal(size=150).astype("<f4").tobytes() for _ in every])}
    for k, stat in enumerate(("act_std", "act_mean", "weight_norm", "bn_var_norm")):
        width = 150 if k < 3 else 7                               # a BatchNorm stat has fewer layers
        by_stat[stat] = (sampled, [rng.normal(size=width).astype("<f4").tobytes() for _ in sampled])
    by_stat["update_ratio"] = (sampled[:1], [rng.normal(size=150).astype("<f4").tobytes()])
    got = layer_partials_by_stat(by_stat)
    for stat, (steps, blobs) in by_stat.items():
        alone = layer_partials(steps, blobs)
        assert [(lv, b, blob) for s, lv, b, blob in got if s == stat] == alone, stat
    assert len(got) == sum(len(layer_partials(st, bl)) for st, bl in by_stat.values())


def test_full_and_compact_partials_decode_together_in_row_order():
    """A query's rows mix both forms (one run's batches cut buckets differently) and may be narrower
    than the run's layer list; each decodes to what its own form says, in the order given."""
    rng = np.random.default_rng(11)
    wide = [rng.normal(size=5).astype("<f4").tobytes() for _ in range(40)]
    narrow = rng.normal(size=3).astype("<f4").tobytes()
    full = [(b, blob) for lv, b, blob in layer_partials(np.arange(32, 72, dtype=np.int64), wide) if lv == 16]
    single = [(lv, b, blob) for lv, b, blob in layer_partials(np.array([200], dtype=np.int64), [narrow])]
    assert all(len(blob) == 8 + 12 for _, _, blob in single)        # compact at every level
    compact = (single[0][1], single[0][2])
    assert [layer_partial_width(blob) for _, blob in (*full, compact)] == [5, 5, 5, 3]
    rows = [full[0], compact, full[1], full[2]]
    buckets, last_step, arr = layer_partial_arrays(rows, 6)
    assert buckets.tolist() == [2, 12, 3, 4] and last_step.tolist() == [47.0, 200.0, 63.0, 71.0]
    alone_b, alone_ls, alone = layer_partial_arrays([full[1]], 6)
    assert np.array_equal(arr[2].view("<u4"), alone[0].view("<u4"))
    narrow_vals = np.frombuffer(narrow, dtype="<f4")
    assert np.array_equal(arr[1, 0, :3], narrow_vals) and np.array_equal(arr[1, 1, :3], narrow_vals)
    assert arr[1, 3].tolist() == [1, 1, 1, 0, 0, 0] and arr[1, 4].tolist() == [0] * 6
    assert (arr[1, 5, 3:].view("<u4") == NULL_F32_BITS).all() and np.isnan(arr[1, 0, 3:]).all()
