"""Colours and the Plotly layout shared by every chart (dark theme).

Leaf module. Figures are plain dicts (no ``plotly.graph_objects``): they are
built on every callback, and dicts are cheap to build and easy to ``Patch``.
"""
from __future__ import annotations

BG = "#0d1117"
PANEL = "#161b22"
BORDER = "#30363d"
TEXT = "#c9d1d9"
MUTED = "#8b949e"
CHECKPOINT_COLOUR = "#3fb950"   # checkpoint markers on the step axis: green, apart from the alerts' colours
REWIND_COLOUR = "#db61a2"       # rewinds of the agent's Rewind policy: magenta, apart from alerts and checkpoints
GRID = "#21262d"

SEVERITY_COLOURS = {"critical": "#f85149", "warning": "#d29922", "info": "#58a6ff"}
NAN_COLOUR = "#ff4d4f"
FLAG_COLOUR = "#f0883e"

# One colour per run on the compare page, one per line on a run page.
PALETTE = ["#58a6ff", "#3fb950", "#d2a8ff", "#f0883e", "#ff7b72", "#79c0ff", "#e3b341", "#56d4dd",
           "#bc8cff", "#ffa657"]

CHART_HEIGHT = 230
HEATMAP_HEIGHT = 260


def base_layout(title: str, *, height: int = CHART_HEIGHT, log_y: bool = False, y_title: str = "") -> dict:
    """The layout every run / compare chart starts from."""
    # ticklabeloverflow "allow": a tick label never reaches past the chart's div here (automargin), and
    # plotly's default ("hide past div") measures every label's box to find out, a forced layout each:
    # ~90 ms of a cold run page's ~30 charts (docs/performance.md, "Dashboard page load").
    axis = {"gridcolor": GRID, "zerolinecolor": BORDER, "linecolor": BORDER, "color": MUTED,
            "ticklabeloverflow": "allow"}
    return {
        "title": {"text": title, "x": 0.01, "xanchor": "left", "y": 0.97, "font": {"size": 13, "color": TEXT}},
        "height": height,
        # l: room for the y tick labels of most charts (e.g. "0.0003", "1.2k"). The y axis keeps
        # automargin for longer ones, but a margin it has to widen costs the chart a second draw
        # (~10 ms; with 56 px a third of a run page's charts were drawn twice).
        "margin": {"l": 70, "r": 12, "t": 30, "b": 28},
        "paper_bgcolor": PANEL,
        "plot_bgcolor": PANEL,
        "font": {"color": TEXT, "size": 11, "family": "system-ui, -apple-system, Segoe UI, sans-serif"},
        "showlegend": True,
        "legend": {"orientation": "h", "x": 1, "xanchor": "right", "y": 1.02, "yanchor": "bottom",
                   "bgcolor": "rgba(0,0,0,0)", "font": {"size": 10}},
        "hovermode": "x unified",
        "hoverlabel": {"bgcolor": BG, "bordercolor": BORDER},
        "xaxis": {**axis, "title": {"text": ""}, "showspikes": True, "spikecolor": MUTED, "spikethickness": 1},
        "yaxis": {**axis, "automargin": True, "type": "log" if log_y else "linear", "title": {"text": y_title}, "exponentformat": "power"
                  if log_y else "none"},
        # Hidden 0..1 axis for markers that must sit on the chart whatever the
        # main axis is (log axes cannot show a NaN, a rug can).
        "yaxis2": {"overlaying": "y", "range": [0, 1], "visible": False, "fixedrange": True},
        "uirevision": "keep",
    }
