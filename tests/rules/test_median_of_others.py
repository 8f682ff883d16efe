"""stats.median_of_others, which the cross-rank rules use for every rank's "the others' median", equals
the median taken one rank at a time (np.nanmedian over the other counted cells) on random rows with
ties, NaNs and cells not counted."""
from __future__ import annotations

import warnings

import numpy as np

from gradwatch.server.rules.stats import median_of_others


def test_equals_the_median_of_the_other_ranks_taken_one_at_a_time():
    rng = np.random.default_rng(0)
    for trial in range(2000):
        steps, ranks = int(rng.integers(1, 5)), int(rng.integers(1, 9))
        values = (rng.integers(0, 4, size=(steps, ranks)).astype(float) if trial % 2      # ties
                  else rng.standard_normal((steps, ranks)))
        values[rng.random((steps, ranks)) < 0.15] = np.nan
        counted = rng.random((steps, ranks)) < 0.8
        got = median_of_others(values, counted)
        for c in range(ranks):
            rest = counted.copy()
            rest[:, c] = False
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)     # a row with nothing left: NaN
                want = np.nanmedian(np.where(rest & ~np.isnan(values), values, np.nan), axis=1)
            np.testing.assert_allclose(got[:, c], want, equal_nan=True, err_msg=f"trial {trial}, rank {c}")


def test_256_ranks():
    rng = np.random.default_rng(1)
    values = rng.standard_normal((3, 256))
    got = median_of_others(values, np.ones(values.shape, dtype=bool))
    for c in (0, 17, 255):
        np.testing.assert_allclose(got[:, c], np.median(np.delete(values, c, axis=1), axis=1))
