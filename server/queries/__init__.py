"""The read path: every SELECT the API and the dashboard use, one module per concern.

Keyword-only functions that take a Session and return the API's read models (server/wire/schemas.py: an alert
is ``AlertOut``, a run ``RunOut``, a series ``SeriesOut``; docs/architecture.md, "The read path"); a heatmap
is a ``LayerMatrix`` of numpy cells; the by-rank reads return dataclasses that have no response model (their
routes write the JSON). Floats are Python floats and may be ``nan`` / ``inf`` / ``-inf``; ``None`` means "not
measured". The JSON answers turn them into wire strings (server/wire/numbers.py); the dashboard uses them as
they are.

- ``runs.py``: the runs list, one run, a run's project;
- ``series.py``: one signal over steps, downsampled (and several runs on one axis);
- ``layers.py``: a per-layer statistic as a layer × step matrix;
- ``by_rank.py``: a run's ranks side by side (coverage, layout, rank × step matrices);
- ``alerts.py``: alerts in their one shape, firing counts, the early-warning badge;
- ``events.py``: events, checkpoints and rewinds;
- ``_shared.py``: the errors and cost bounds every read checks, the blob readers.

Callers import this package and use the names below (``queries.get_series``), not the modules.

Example::

    from gradwatch.server import queries
    with sessionmaker() as session:
        runs = queries.list_runs(session, project="default")
        s = queries.get_series(session, run_id=runs[0].id, signal="loss", max_points=500)
        for p in s.points:
            print(p.step, p.min, p.max, p.last, p.nonfinite)
"""
from __future__ import annotations

from gradwatch.server.queries._shared import MAX_MATRIX_CELLS, MAX_MATRIX_READ, MAX_SERIES_POINTS, RequestTooLarge, UnknownSignal
from gradwatch.server.queries.alerts import alert_out, early_warnings, get_alert, list_alerts
from gradwatch.server.queries.by_rank import MAX_RANK_READ, RankCoverage, RankInfo, RankMatrix, get_rank_matrix, rank_coverage, rank_meta
from gradwatch.server.queries.events import list_checkpoints, list_events, list_rewinds
from gradwatch.server.queries.layers import COARSER_LEVEL_KEEPS, LayerMatrix, get_layer_matrix, layer_names_for, list_layer_stats
from gradwatch.server.queries.runs import get_run, list_runs, run_project
from gradwatch.server.queries.series import get_series, get_series_multi, list_signals, raw_steps_from

__all__ = [
    "MAX_MATRIX_CELLS", "MAX_MATRIX_READ", "MAX_RANK_READ", "MAX_SERIES_POINTS", "COARSER_LEVEL_KEEPS",
    "RequestTooLarge", "UnknownSignal",
    "list_runs", "get_run", "run_project",
    "get_series", "get_series_multi", "list_signals", "raw_steps_from",
    "LayerMatrix", "layer_names_for", "list_layer_stats", "get_layer_matrix",
    "RankInfo", "RankCoverage", "RankMatrix", "rank_coverage", "rank_meta", "get_rank_matrix",
    "alert_out", "list_alerts", "get_alert", "early_warnings",
    "list_events", "list_checkpoints", "list_rewinds",
]
