"""Compare page (``/compare``): chosen runs overlaid on the same panels.

``/compare?runs=3,7`` preselects runs. Zooming one chart moves all of them
and refetches the visible range at full resolution, as on the run page.
"""
from __future__ import annotations

import dash
from dash import ClientsideFunction, Input, Output, State, callback, clientside_callback, dcc, html, no_update

from gradwatch.dashboard import figures, gateway
from gradwatch.dashboard.figures import COMPARE_PANELS
from gradwatch.dashboard.ticks import pause_while_running

GRAPH_IDS = [f"compare-graph-{signal}" for signal, _, _ in COMPARE_PANELS]
MAX_POINTS = 1000
REFRESH_MS = 3000
# the page with no run picked: what to do, instead of six empty charts on a -1…6 axis (issue 42)
EMPTY_HINT = ("No runs picked yet: pick two or more in the box above to overlay their charts on one step axis "
              "(or open /compare?runs=3,7).")


def _preselected(runs) -> list[int]:
    out = []
    for part in str(runs or "").split(","):
        try:
            out.append(int(part))
        except ValueError:
            pass
    return out


def _options() -> list[dict]:
    return [{"label": _label(r), "value": r["id"]}
            for r in sorted(gateway.list_runs(), key=lambda r: -(r.get("started_at") or 0))]


def layout(runs=None, **_query):
    # Options come with the layout: a dropdown drops preselected values it has no option for.
    options = _options()
    known = {o["value"] for o in options}
    return html.Div([
        html.Div([
            html.H1("Compare runs", className="gw-title"),
            dcc.Dropdown(id="compare-runs", multi=True, options=options,
                         value=[i for i in _preselected(runs) if i in known], placeholder="choose runs to overlay…",
                         className="gw-dropdown gw-dropdown-wide"),
            html.Button("Whole runs", id="compare-reset", n_clicks=0, className="gw-button"),
        ], className="gw-page-head"),
        dcc.Store(id="compare-range", data=None),
        dcc.Store(id="compare-sig", data=None),
        dcc.Interval(id="compare-interval", interval=REFRESH_MS),
        dcc.Interval(id="compare-options-interval", interval=REFRESH_MS),
        html.Div(EMPTY_HINT, id="compare-hint", className="gw-empty"),
        html.Div([html.Div(dcc.Graph(id=gid, config={"displayModeBar": False, "responsive": True}), className="gw-chart")
                  for gid in GRAPH_IDS], className="gw-chart-grid", id="compare-grid", style={"display": "none"}),
    ])


def _label(run: dict) -> str:
    return f"{run.get('project', '')} / {run.get('name', '')} (#{run['id']})"


@callback(
    Output("compare-runs", "options"),
    Input("compare-options-interval", "n_intervals"),
    State("compare-runs", "options"),
    running=pause_while_running("compare-options-interval"),
)
def run_options(_tick, current):
    options = _options()
    return no_update if options == current else options


@callback(
    [Output(gid, "figure") for gid in GRAPH_IDS],
    Output("compare-sig", "data"),
    Output("compare-hint", "children"),
    Output("compare-grid", "style"),
    Input("compare-runs", "value"),
    Input("compare-range", "data"),
    Input("compare-interval", "n_intervals"),
    State("compare-sig", "data"),
    running=pause_while_running("compare-interval"),
)
def draw(run_ids, x_range, _tick, previous_sig):
    run_ids = list(run_ids or [])
    runs = {r["id"]: r for r in gateway.list_runs() if r["id"] in run_ids}
    sig = [run_ids, x_range, [[i, (runs.get(i) or {}).get("last_step")] for i in run_ids]]
    if sig == previous_sig:
        return *([no_update] * len(GRAPH_IDS)), no_update, no_update, no_update
    if not any(i in runs for i in run_ids):
        return *([no_update] * len(GRAPH_IDS)), sig, EMPTY_HINT, {"display": "none"}
    start, end = (x_range or (None, None))
    signals = [signal for signal, _, _ in COMPARE_PANELS]
    series = {i: gateway.get_series(i, signals, start=start, end=end, max_points=MAX_POINTS)
              for i in run_ids if i in runs}
    shown = x_range
    if shown is None:
        # Every chart spans the same steps (autorange would differ per chart and break the shared axis).
        steps = [p["step"] for by_signal in series.values() for s in by_signal.values() if s
                 for p in (s["steps"][:1] + s["steps"][-1:])]
        shown = [min(steps), max(max(steps), min(steps) + 1)] if steps else None
    figs = []
    for signal, title, log_y in COMPARE_PANELS:
        fig = figures.compare_figure(signal, title, [(_label(runs[i]), series[i].get(signal)) for i in series],
                                     log_y=log_y)
        fig["layout"]["xaxis"].update({"range": list(shown), "autorange": False} if shown else {"autorange": True})
        figs.append(fig)
    return *figs, sig, None, {}


clientside_callback(
    ClientsideFunction(namespace="gradwatch", function_name="syncX"),
    Output("compare-range", "data"),
    [Input(gid, "relayoutData") for gid in GRAPH_IDS],
    Input("compare-reset", "n_clicks"),
    State("compare-range", "data"),
    prevent_initial_call=True,
)


dash.register_page(__name__, path="/compare", name="Compare", title="gradwatch · compare", order=2, layout=layout)
