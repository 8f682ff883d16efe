"""Pure figure builders: query results in, Plotly figure dicts (or appends) out; one module per panel family.

No Dash, no database: every function here takes plain data and returns plain
data, so the page callbacks stay thin and the builders are testable alone.

Series arrive as the read API's buckets ``{"step", "min", "max", "last",
"count", "nonfinite"}`` (docs/wire-format.md); values may be floats, ``None``
or the strings ``"NaN"`` / ``"Infinity"`` / ``"-Infinity"`` depending on the
layer they came through, and :func:`to_float` accepts all of them.
A downsampled bucket is drawn as two points, its max then its min, so a spike
inside a bucket of 500 steps is still drawn at its full height; buckets that
hold a non-finite value put a marker on the chart's NaN rug.

- ``points.py``: values and buckets as plot points, smoothing, table-cell numbers;
- ``panels.py``: the run page's panels, heatmaps and compare charts, from the signal table;
- ``marks.py``: alert, checkpoint and rewind lines, the shared x axis;
- ``series.py``: a panel's step chart and its live appends;
- ``heatmaps.py``: per-layer heatmaps, the update-ratio chart;
- ``ranks.py``: a run's ranks side by side (overlays, rank × step heatmaps, the rank that stands out);
- ``compare.py``: several runs overlaid.

Pages import this package (``figures.series_figure``), not the modules.
"""
from __future__ import annotations

from .points import (NAN_RUG_Y, bucket_points, finite, flag_steps, format_number, is_nonfinite, nonfinite_steps,
                     plot_text, smooth, to_float)
from .panels import (COMPARE_PANELS, HEADLINE, HEATMAPS, PANELS, PANELS_BY_KEY, SERIES_SIGNALS, ZERO_BASED, Flag,
                     Line, Panel, panel_signals)
from .marks import (MAX_ALERT_MARKS, MAX_CHECKPOINT_MARKS, MAX_REWIND_MARKS, alert_shapes, alerts_signature,
                    checkpoint_shapes, checkpoints_signature, rewind_label, rewind_shapes, rewinds_signature,
                    step_marks)
from .series import last_step, series_append, series_figure
from .heatmaps import HEATMAP_MAX_LABEL_PX, heatmap_figure, update_ratio_figure
from .ranks import (ALL_RANKS, COMBINED_SIGNALS, COMBINED_STATS, HIGHLIGHT_COLOUR, MANY_RANKS, OTHER_RANKS_COLOUR,
                    OVERLAY_POINTS, RANK_CHARTS, SHARDED_PER_RANK, alert_rank, layer_rank, odd_rank,
                    rank_heatmap_figure, rank_overlay_figure, rank_sources)
from .compare import compare_figure

__all__ = [
    "NAN_RUG_Y", "to_float", "finite", "plot_text", "is_nonfinite", "bucket_points", "nonfinite_steps",
    "flag_steps", "smooth", "format_number", "Line", "Flag", "Panel", "PANELS", "PANELS_BY_KEY", "HEADLINE",
    "panel_signals", "SERIES_SIGNALS", "HEATMAPS", "COMPARE_PANELS", "ZERO_BASED", "MAX_ALERT_MARKS",
    "MAX_CHECKPOINT_MARKS", "alert_shapes", "checkpoint_shapes", "checkpoints_signature", "alerts_signature",
    "MAX_REWIND_MARKS", "rewind_label", "rewind_shapes", "rewinds_signature", "step_marks",
    "series_figure", "series_append", "last_step", "HEATMAP_MAX_LABEL_PX", "heatmap_figure",
    "update_ratio_figure", "COMBINED_SIGNALS", "COMBINED_STATS", "RANK_CHARTS", "SHARDED_PER_RANK", "ALL_RANKS",
    "MANY_RANKS", "OVERLAY_POINTS", "HIGHLIGHT_COLOUR", "OTHER_RANKS_COLOUR", "rank_sources", "layer_rank",
    "odd_rank", "alert_rank", "rank_overlay_figure", "rank_heatmap_figure", "compare_figure",
]
