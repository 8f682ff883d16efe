"""Run page (``/runs/<id>``): every signal of one run, live, with its alerts.

Data flow (all ids start with ``run-``):

- ``run-range`` holds the visible step range. Zooming any chart sets it (a
  clientside callback, which also moves every other chart to the same range
  at once); the charts are then refetched at full resolution for that range.
  ``None`` means the whole run, downsampled by the server.
- Loading is staged so that the headline charts are usable first:
  :func:`load_headline` draws loss, grad norm and loss scale and fixes the
  shared step range (``run-head``) and the heatmaps' (``run-layers-range``);
  :func:`load_charts` then draws the other charts while :func:`load_layers`
  reads the heatmaps. Each stage's response is drawn while the next one is on
  the server.
- ``run-interval`` ticks; :func:`wait_news` waits on the server until the
  run has steps after ``run-live.cursor`` (a long poll, server/ingest/live_news.py)
  and sets ``run-news``; :func:`append_live` then asks for the steps after the
  cursor only and appends them with ``Patch`` (the
  history is never fetched again). After many appended points it redraws once
  from a downsampled query so the browser never holds an unbounded tail.
- :func:`refresh_summary` keeps the header, the NaN origin, the rewind cards
  (the agent's Rewind policy) and the alerts panel current; :func:`load_layers` redraws the per-layer heatmaps every few
  seconds while the run is live.
"""
from __future__ import annotations

import time
from typing import Optional, Sequence

import dash
from dash import ALL, ClientsideFunction, Input, Output, Patch, State, callback, clientside_callback, ctx, dcc, html, \
    no_update

from gradwatch.dashboard import figures, gateway
from gradwatch.dashboard.alert_cards import (alert_list, format_ago, format_time, health_badge, recovery,
                                             severity_badge, status_badge)
from gradwatch.dashboard.figures import ALL_RANKS, HEADLINE, HEATMAPS, PANELS, RANK_CHARTS, SERIES_SIGNALS, \
    format_number
from gradwatch.dashboard.rewind_cards import rewind_list
from gradwatch.dashboard.ticks import pause_while_running

# The live tick: wait_news parks up to about a second on the server while nothing is new
# (server/ingest/live_news.py), so a short tick costs no queries; it is only the gap after the charts are
# patched before the next wait. A page the server cannot park (too many pages waiting) polls every
# POLL_MS instead, as every page did before the long poll.
LIVE_MS = 20
POLL_MS = 500
SUMMARY_MS = 1000
LAYERS_MS = 5000
MAX_POINTS = 600           # buckets per chart (drawn as max + min: ~2 points per pixel column of a half-width chart)
MAX_APPENDED = 4000        # raw points appended before a chart is redrawn downsampled
HEATMAP_STEPS = 300
HEATMAP_LAYERS = 48

# Drawn first (docs/dashboard.md, "Big runs": the page is usable once these are drawn).
HEAD_PANELS = tuple(p for p in PANELS if p.key in HEADLINE)
REST_PANELS = tuple(p for p in PANELS if p.key not in HEADLINE)
HEAD_IDS = [f"run-graph-{p.key}" for p in HEAD_PANELS]
HEAD_SIGNALS = figures.panel_signals(HEAD_PANELS)
REST_EVERY_S = 1.0         # live: the charts below the headline are patched at most this often
REST_IDS = [f"run-graph-{p.key}" for p in REST_PANELS]
PANEL_IDS = [f"run-graph-{p.key}" for p in PANELS]
HEATMAP_IDS = [f"run-heatmap-{stat}" for stat, _ in HEATMAPS]
RANK_GRAPH_IDS = [f"run-rank-graph-{sig}" for sig, _, _ in RANK_CHARTS]
RANK_HEATMAP_IDS = [f"run-rank-heatmap-{sig}" for sig, _, _ in RANK_CHARTS]
ALL_GRAPH_IDS = PANEL_IDS + ["run-graph-update_ratio"] + HEATMAP_IDS + RANK_GRAPH_IDS + RANK_HEATMAP_IDS
RANK_STEPS = 300           # columns of the rank × step heatmaps (the overlays are drawn from the same read)
# Drag to zoom, double-click to reset: the mode bar would only cover the legends.
GRAPH_CONFIG = {"displayModeBar": False, "responsive": True}


def _parse_run_id(run_id) -> Optional[int]:
    try:
        return int(str(run_id))
    except (TypeError, ValueError):
        return None


def _graph(graph_id: str, *, wide: bool = False) -> html.Div:
    return html.Div(dcc.Graph(id=graph_id, config=GRAPH_CONFIG, figure={"data": [], "layout": {
        "paper_bgcolor": "rgba(0,0,0,0)", "plot_bgcolor": "rgba(0,0,0,0)", "height": 230, "meta": "gw-placeholder",
        "xaxis": {"visible": False}, "yaxis": {"visible": False}}}),
        className="gw-chart gw-chart-wide" if wide else "gw-chart")


def layout(run_id=None, **_query):
    rid = _parse_run_id(run_id)
    if rid is None or gateway.get_run(rid) is None:
        return html.Div([html.H1("Run not found", className="gw-title"),
                         dcc.Link("back to runs", href="/")], className="gw-card")
    ranks = gateway.get_rank_meta(rid) or {"world_size": 1, "combined": False, "ranks": []}
    multi = ranks["world_size"] > 1
    return html.Div([
        dcc.Store(id="run-id", data=rid),
        dcc.Store(id="run-rank-info", data={"world_size": ranks["world_size"], "combined": ranks["combined"]}),
        dcc.Store(id="run-range", data=None),
        dcc.Store(id="run-head", data=None),
        dcc.Store(id="run-live", data=None),
        dcc.Store(id="run-news", data=None),
        dcc.Store(id="run-summary-sig", data=None),
        dcc.Store(id="run-layers-sig", data=None),
        dcc.Store(id="run-layers-range", data=None),
        dcc.Store(id="run-ack-done", data=0),
        dcc.Interval(id="run-interval", interval=POLL_MS),
        dcc.Interval(id="run-summary-interval", interval=SUMMARY_MS),
        dcc.Interval(id="run-layers-interval", interval=LAYERS_MS),
        # max_intervals=0: a one-rank run's never ticks (pause_while_running re-enables it after each call)
        dcc.Interval(id="run-ranks-interval", interval=LAYERS_MS, max_intervals=-1 if multi else 0),
        dcc.Store(id="run-ranks-sig", data=None),
        html.Div(id="run-header", className="gw-run-header"),
        html.Div(id="run-notices"),
        html.Div([
            html.Div([
                html.Div([
                    html.Span("Loss smoothing", className="gw-muted"),
                    html.Div(dcc.Slider(id="run-smoothing", min=0, max=0.99, step=0.01, value=0.6,
                                        marks={0: "off", 0.5: "0.5", 0.9: "0.9"},
                                        tooltip={"placement": "bottom"}), className="gw-slider"),
                    html.Div(dcc.Dropdown(id="run-rank", options=_rank_options(ranks), value=ALL_RANKS,
                                          clearable=False, searchable=len(ranks["ranks"]) > 8),
                             className="gw-rank-picker", style={"minWidth": "13rem"} if multi else {"display": "none"}),
                    html.Button("Whole run", id="run-reset", n_clicks=0, className="gw-button"),
                    html.Span("drag on any chart to zoom every chart; double-click to reset",
                              className="gw-muted gw-hint"),
                ], className="gw-toolbar"),
                html.Div([_graph(gid) for gid in PANEL_IDS] + [_graph("run-graph-update_ratio")],
                         className="gw-chart-grid"),
                html.Div([
                    html.H2("Ranks", className="gw-subtitle"),
                    html.Div([_graph(gid) for gid in RANK_GRAPH_IDS], className="gw-chart-grid"),
                    html.Div([_graph(gid, wide=True) for gid in RANK_HEATMAP_IDS], className="gw-chart-grid"),
                ], id="run-ranks-section", style={} if multi else {"display": "none"}),
                html.H2("Per-layer statistics", className="gw-subtitle"),
                html.Div([_graph(gid, wide=True) for gid in HEATMAP_IDS], className="gw-chart-grid"),
            ], className="gw-run-charts"),
            html.Aside([html.Div(id="run-rewinds"), html.H2("Alerts", className="gw-subtitle"),
                        html.Div(id="run-alerts")],
                       className="gw-run-alerts"),
        ], className="gw-run-body"),
    ])


def _rank_options(ranks: dict) -> list[dict]:
    """The rank picker: all ranks (rank 0, a sharded run's grad norms from its combined row), each rank with
    where it runs, and a sharded run's combined row itself."""
    opts = [{"label": "All ranks", "value": ALL_RANKS}]
    for r in ranks.get("ranks") or []:
        where = " ".join(str(x) for x in (r.get("host"), r.get("device")) if x)
        opts.append({"label": f"rank {r['rank']}" + (f" · {where}" if where else ""), "value": str(r["rank"])})
    if ranks.get("combined"):
        opts.append({"label": "combined (rank -1)", "value": "-1"})
    return opts


# --------------------------------------------------------------------------- charts

def _first_step(series: dict) -> Optional[int]:
    firsts = [s["steps"][0]["step"] for s in series.values() if s and s.get("steps")]
    return min(firsts) if firsts else None


def _panel_figures(panels, series: dict, alerts: list, smoothing: float, shown,
                   checkpoints: list = (), rewinds: list = ()) -> tuple[list, dict]:
    figs, smooth_states = [], {}
    for panel in panels:
        fig, state = figures.series_figure(panel, series, alerts=alerts, smoothing=smoothing or 0.0, x_range=shown,
                                           checkpoints=checkpoints, rewinds=rewinds)
        figs.append(fig)
        smooth_states[panel.key] = state
    return figs, smooth_states


def _chart_figures(run_id: int, x_range, smoothing: float, alerts: list, panels=PANELS,
                   source: Optional[dict] = None) -> tuple[list, dict]:
    start, end = (x_range or (None, None))
    # The run's last step, read before the series: a downsampled series ends with a
    # bucket's first step, and live appends must continue after the bucket's end.
    last = (gateway.get_run(run_id) or {}).get("last_step")
    source = source or {"sources": {}, "rank": 0, "layer_rank": 0, "picked": ALL_RANKS}
    series = gateway.get_series(run_id, figures.panel_signals(panels), start=start, end=end, max_points=MAX_POINTS,
                                rank=source["rank"], sources=source["sources"])
    cursor = figures.last_step(series)
    if cursor is not None and last is not None:
        cursor = max(cursor, last)
    first = _first_step(series)
    checkpoints = gateway.list_checkpoints(run_id)
    rewinds = gateway.list_rewinds(run_id)
    # The whole run: every chart gets the same explicit step range (autorange
    # would pad charts with markers differently and break the shared axis).
    shown = x_range if x_range is not None else ([first, max(cursor, first + 1)] if cursor is not None else None)
    figs, smooth_states = _panel_figures(panels, series, alerts, smoothing, shown, checkpoints, rewinds)
    if x_range is not None and last is not None:
        cursor = last  # a zoomed view ends inside the run; live appends continue from the run's end
    live = {"cursor": cursor, "first": first, "states": smooth_states, "appended": 0,
            "alerts": figures.alerts_signature(alerts), "range": x_range, "shown": shown, "source": source,
            "checkpoints": figures.checkpoints_signature(checkpoints), "rewinds": figures.rewinds_signature(rewinds)}
    return figs, live


def _source(picked, info: Optional[dict]) -> dict:
    """Which rank each chart reads, from the picker (``figures.rank_sources``); kept in the live state."""
    sources, rank, layer_rank = figures.rank_sources(picked, bool((info or {}).get("combined")))
    return {"sources": sources, "rank": rank, "layer_rank": layer_rank, "picked": picked or ALL_RANKS}


@callback(
    [Output(gid, "figure") for gid in HEAD_IDS],
    Output("run-head", "data"),
    # No live appends until every chart is redrawn: the old cursor and range no longer match.
    Output("run-live", "data"),
    Output("run-layers-range", "data"),
    Input("run-range", "data"),
    Input("run-smoothing", "value"),
    Input("run-rank", "value"),
    State("run-id", "data"),
    State("run-rank-info", "data"),
    running=pause_while_running("run-interval"),
)
def load_headline(x_range, smoothing, picked, run_id, rank_info):
    """The headline charts; then the other charts (run-head) and the heatmaps (run-layers-range) are asked
    for together: the heatmaps' request (the page's dearest, ~0.4 s on the server for a 1,000,000-step
    run) runs while the browser draws, instead of after every other chart is drawn."""
    alerts = gateway.list_alerts(run_id=run_id)
    source = _source(picked, rank_info)
    figs, head = _chart_figures(run_id, x_range, smoothing, alerts, HEAD_PANELS, source)
    return *figs, head, None, {"range": x_range, "source": source}


@callback(
    [Output(gid, "figure") for gid in REST_IDS],
    Output("run-live", "data", allow_duplicate=True),
    Input("run-head", "data"),
    State("run-id", "data"),
    State("run-smoothing", "value"),
    prevent_initial_call=True,
    running=pause_while_running("run-interval"),
)
def load_charts(head, run_id, smoothing):
    """The charts after the headline, on the same step range."""
    if not head:
        return [no_update] * (len(REST_IDS) + 1)
    alerts = gateway.list_alerts(run_id=run_id)
    x_range = head.get("range")
    # The whole run: read up to the headline's cursor, where live appends will continue from.
    start, end = x_range if x_range is not None else (None, head.get("cursor"))
    source = head.get("source") or _source(None, None)
    series = gateway.get_series(run_id, figures.panel_signals(REST_PANELS), start=start, end=end, max_points=MAX_POINTS,
                                rank=source["rank"], sources=source["sources"])
    figs, states = _panel_figures(REST_PANELS, series, alerts, smoothing, head.get("shown"),
                                  gateway.list_checkpoints(run_id), gateway.list_rewinds(run_id))
    live = dict(head, states={**(head.get("states") or {}), **states})
    return *figs, live


@callback(
    Output("run-news", "data"),
    Output("run-interval", "interval"),
    Input("run-interval", "n_intervals"),
    State("run-id", "data"),
    State("run-live", "data"),
    prevent_initial_call=True,
    running=pause_while_running("run-interval"),
)
def wait_news(tick, run_id, live):
    """Park on the server until the run holds steps after the page's cursor (a long poll, about a
    second; server/ingest/live_news.py), then tell :func:`append_live` to fetch them; it also answers after
    the wait without news, so the alert marks stay current. Only a counter comes back: the chart
    state this callback read may be stale by then (a zoom meanwhile), append_live reads it fresh.
    The tick after it: LIVE_MS while the server parks this page, POLL_MS when it could not."""
    if not live:
        return no_update, POLL_MS
    parked = gateway.wait_for_steps(run_id, live.get("cursor")) is not None
    return tick, LIVE_MS if parked else POLL_MS


@callback(
    [Output(gid, "figure", allow_duplicate=True) for gid in PANEL_IDS],
    Output("run-live", "data", allow_duplicate=True),
    Input("run-news", "data"),
    State("run-id", "data"),
    State("run-live", "data"),
    State("run-smoothing", "value"),
    prevent_initial_call=True,
    # no news waits while the charts are patched: a second answer would be dropped by the page (ticks.py)
    running=pause_while_running("run-interval"),
)
def append_live(_news, run_id, live, smoothing):
    nothing = [no_update] * (len(PANEL_IDS) + 1)
    if not live:
        return nothing
    cursor = live.get("cursor")
    # One cheap query says whether there is anything new; most idle answers of wait_news stop here.
    last = (gateway.get_run(run_id) or {}).get("last_step")
    fresh_steps = gateway.steps_after(last, cursor)
    alerts = gateway.list_alerts(run_id=run_id)
    sig = figures.alerts_signature(alerts)
    checkpoints = gateway.list_checkpoints(run_id)
    ckpt_sig = figures.checkpoints_signature(checkpoints)
    rewinds = gateway.list_rewinds(run_id)
    rewind_sig = figures.rewinds_signature(rewinds)
    # a new checkpoint or rewind redraws the step-axis marks as a new or changed alert does
    alerts_changed = sig != live.get("alerts") or ckpt_sig != live.get("checkpoints") or \
        rewind_sig != live.get("rewinds", [])
    # The headline charts are patched with every batch; the others at most every REST_EVERY_S (and at
    # once when the alert / checkpoint marks change): patching a dozen charts made each live round
    # in the browser ~2x longer, and a round in progress is what a new step waits for
    # (bench/live_latency.py, docs/performance.md "Live latency").
    now = time.time()
    rest_cursor = live.get("rest_cursor", cursor)
    rest_fresh = gateway.steps_after(last, rest_cursor)
    everything = alerts_changed or (rest_fresh and now - live.get("rest_at", 0.0) >= REST_EVERY_S)
    if not fresh_steps and not everything:
        return nothing
    behind = 0 if not fresh_steps else last - (cursor if cursor is not None else -1)
    if live.get("range") is None and live.get("appended", 0) + behind > MAX_APPENDED:
        # Far behind (a fast run, a tab left in the background): redraw downsampled instead.
        figs, fresh = _chart_figures(run_id, None, smoothing, alerts, source=live.get("source"))
        return *figs, fresh
    source = live.get("source") or _source(None, None)
    panels, signals = (PANELS, SERIES_SIGNALS) if everything else (HEAD_PANELS, HEAD_SIGNALS)
    # Each signal continues from the last step it has drawn: the tails are read one query per signal,
    # not in one snapshot, so a batch committed between two of them would be past the cursor of the
    # signals read before it -- one cursor for all lost those steps from the live charts (seen with
    # batches every 0.1 s). A signal read from another rank (a sharded run's combined row, which waits
    # for every rank) may lag the others for the same reason. A signal without a cursor of its own
    # continues from where the charts were drawn (``base``).
    cursors = dict(live.get("cursors") or {})
    base = live.get("base", cursor)
    new = (gateway.get_series(run_id, signals, since=-1 if base is None else base, since_by=cursors,
                              max_points=MAX_APPENDED, rank=source["rank"], sources=source["sources"])
           if fresh_steps or (everything and rest_fresh) else {})
    for signal, one in new.items():
        if one and one.get("steps"):
            cursors[signal] = one["steps"][-1]["step"]
    new_cursor = figures.last_step(new)
    appended = live.get("appended", 0) + max((len(s.get("steps", [])) for s in new.values() if s), default=0)
    live = dict(live, states=dict(live.get("states") or {}), alerts=sig, appended=appended, checkpoints=ckpt_sig,
                rewinds=rewind_sig, cursors=cursors, base=base)
    if everything:
        live["rest_at"] = now
        live["rest_cursor"] = last if last is not None else rest_cursor   # read before the tails: all stored
    if new_cursor is not None:
        live["cursor"] = new_cursor if cursor is None else max(new_cursor, cursor)
        if live.get("first") is None:
            live["first"] = _first_step(new)
    shapes = figures.step_marks(alerts, checkpoints, rewinds) if alerts_changed else None
    # Viewing the whole run: the shared step range grows with the run.
    grow = ([live["first"], max(live["cursor"], live["first"] + 1)]
            if live.get("range") is None and new_cursor is not None and live.get("first") is not None else None)
    out = []
    for panel in PANELS:
        if panel not in panels:
            out.append(no_update)
            continue
        ext, state = figures.series_append(panel, new, smoothing=smoothing or 0.0,
                                           state=live["states"].get(panel.key))
        live["states"][panel.key] = state
        if not ext and shapes is None and grow is None:
            out.append(no_update)
            continue
        patch = Patch()
        if grow is not None:
            patch["layout"]["xaxis"]["range"] = grow
        for idx, (xs, ys) in ext.items():
            patch["data"][idx]["x"].extend(xs)
            patch["data"][idx]["y"].extend(ys)
        if ext:
            patch["layout"]["annotations"] = []  # drop a "no data" note once data arrives
        if shapes is not None:
            patch["layout"]["shapes"] = shapes
        out.append(patch)
    return *out, live


# Zoom one chart, all follow: runs in the browser, no round trip for the follow.
clientside_callback(
    ClientsideFunction(namespace="gradwatch", function_name="syncX"),
    Output("run-range", "data"),
    [Input(gid, "relayoutData") for gid in ALL_GRAPH_IDS],
    Input("run-reset", "n_clicks"),
    State("run-range", "data"),
    prevent_initial_call=True,
)


# --------------------------------------------------------------------------- per-layer heatmaps

def _nan_origin(run_id: int) -> Optional[dict]:
    events = gateway.list_events(run_id, kind="nan_origin")
    events = [e for e in events if e.get("step") is not None] or events
    return min(events, key=lambda e: e.get("step") or 0) if events else None


@callback(
    [Output(gid, "figure") for gid in HEATMAP_IDS],
    Output("run-graph-update_ratio", "figure"),
    Output("run-layers-sig", "data"),
    Input("run-layers-range", "data"),
    Input("run-layers-interval", "n_intervals"),
    State("run-id", "data"),
    State("run-layers-sig", "data"),
    prevent_initial_call=True,
    running=pause_while_running("run-layers-interval"),
)
def load_layers(layers_range, _tick, run_id, previous_sig):
    if layers_range is None:
        return [no_update] * (len(HEATMAP_IDS) + 2)
    x_range = layers_range.get("range")
    start, end = (x_range or (None, None))
    source = layers_range.get("source") or _source(None, None)
    matrices = {stat: gateway.get_layer_matrix(run_id, stat, start=start, end=end, max_steps=HEATMAP_STEPS,
                                               max_layers=HEATMAP_LAYERS,
                                               rank=figures.layer_rank(stat, source["layer_rank"], source["picked"]))
                for stat in [s for s, _ in HEATMAPS] + ["update_ratio"]}
    alerts = gateway.list_alerts(run_id=run_id)
    rewinds = gateway.list_rewinds(run_id)
    origin = _nan_origin(run_id)
    shown = x_range
    if x_range is None:
        # Same step range as the scalar charts: first sample to the run's last step.
        firsts = [m["steps"][0] for m in matrices.values() if m.get("steps")]
        last = (gateway.get_run(run_id) or {}).get("last_step")
        if firsts and last is not None:
            shown = [min(firsts), max(last, min(firsts) + 1)]
    sig = [x_range, shown, source["picked"], figures.alerts_signature(alerts), origin and origin.get("step"),
           figures.rewinds_signature(rewinds),
           {k: [len(m.get("steps") or []), (m.get("steps") or [None])[-1]] for k, m in matrices.items()}]
    if ctx.triggered_id == "run-layers-interval" and sig == previous_sig:
        return [no_update] * (len(HEATMAP_IDS) + 2)
    highlight = (origin or {}).get("data", {}).get("module") or (origin or {}).get("data", {}).get("param")
    heatmaps = [figures.heatmap_figure(title, matrices[stat], alerts=alerts, x_range=shown, highlight=highlight,
                                       highlight_step=(origin or {}).get("step"), rewinds=rewinds)
                for stat, title in HEATMAPS]
    ratio = figures.update_ratio_figure(matrices["update_ratio"], alerts=alerts, x_range=shown, rewinds=rewinds)
    return *heatmaps, ratio, sig


# --------------------------------------------------------------------------- ranks side by side

@callback(
    [Output(gid, "figure") for gid in RANK_GRAPH_IDS + RANK_HEATMAP_IDS],
    Output("run-ranks-sig", "data"),
    Input("run-layers-range", "data"),
    Input("run-ranks-interval", "n_intervals"),
    State("run-id", "data"),
    State("run-rank-info", "data"),
    State("run-ranks-sig", "data"),
    prevent_initial_call=True,
    running=pause_while_running("run-ranks-interval"),
)
def load_ranks(layers_range, _tick, run_id, rank_info, previous_sig):
    """Every rank overlaid on loss / grad norm / step time, and their rank × step heatmaps: one read of
    every rank's series (queries.get_rank_matrix), after the charts above are drawn."""
    nothing = [no_update] * (len(RANK_GRAPH_IDS) + len(RANK_HEATMAP_IDS) + 1)
    if layers_range is None or (rank_info or {}).get("world_size", 1) <= 1:
        return nothing
    x_range = layers_range.get("range")
    source = layers_range.get("source") or _source(None, None)
    start, end = (x_range or (None, None))
    sharded = bool((rank_info or {}).get("combined"))
    read = {sig: figures.SHARDED_PER_RANK.get(sig, sig) if sharded else sig for sig, _, _ in RANK_CHARTS}
    got = gateway.get_rank_matrix(run_id, list(read.values()), start=start, end=end, max_steps=RANK_STEPS)
    matrices = {sig: got.get(src) or {} for sig, src in read.items()}
    alerts = gateway.list_alerts(run_id=run_id)
    rewinds = gateway.list_rewinds(run_id)
    shown = x_range
    if x_range is None:
        firsts = [m["steps"][0] for m in matrices.values() if m.get("steps")]
        last = (gateway.get_run(run_id) or {}).get("last_step")
        if firsts and last is not None:
            shown = [min(firsts), max(last, min(firsts) + 1)]
    sig = [x_range, shown, source["picked"], figures.alerts_signature(alerts), figures.rewinds_signature(rewinds),
           {k: [len(m.get("steps") or []), (m.get("steps") or [None])[-1]] for k, m in matrices.items()}]
    if ctx.triggered_id == "run-ranks-interval" and sig == previous_sig:
        return nothing
    picked = source["picked"]
    named = figures.alert_rank(alerts, gateway.cross_rank_rule_ids())
    overlays, heatmaps = [], []
    for signal, title, log_y in RANK_CHARTS:
        m = matrices.get(signal)
        if read[signal] != signal:
            title = f"{title} (each rank's shard)"
        # the rank picked, else the one a cross-rank alert names, else the one furthest from the median
        if picked not in (None, ALL_RANKS) and int(picked) >= 0:
            highlight, why = int(picked), "picked"
        elif named is not None:
            highlight, why = named, "named by an alert"
        else:
            highlight, why = figures.odd_rank(m), "furthest from the median"
        overlays.append(figures.rank_overlay_figure(title, m, highlight=highlight, why=why, log_y=log_y,
                                                    alerts=alerts, x_range=shown, rewinds=rewinds))
        heatmaps.append(figures.rank_heatmap_figure(title, m, log=log_y, highlight=highlight, x_range=shown,
                                                    rewinds=rewinds))
    return *overlays, *heatmaps, sig


# --------------------------------------------------------------------------- header, notices, alerts

def _rank_hosts(ranks: list[dict]) -> Optional[html.Details]:
    """Where each rank runs (host, local rank, device), from its agent's meta: open for a few ranks."""
    rows = [r for r in ranks if r.get("host") or r.get("device") or r.get("local_rank") is not None]
    if not rows:
        return None
    hosts = sorted({r.get("host") for r in rows if r.get("host")})
    cell = html.Td
    table = html.Table([html.Thead(html.Tr([html.Th(h) for h in ("rank", "host", "local rank", "device")]))] + [
        html.Tbody([html.Tr([cell(str(r["rank"])), cell(r.get("host") or "—"),
                             cell("—" if r.get("local_rank") is None else str(r["local_rank"])),
                             cell(r.get("device") or "—")]) for r in rows])], className="gw-rank-table")
    summary = f"{len(rows)} ranks on {len(hosts)} host{'s' if len(hosts) != 1 else ''}: " + ", ".join(hosts[:6]) + \
        (f" … (+{len(hosts) - 6})" if len(hosts) > 6 else "")
    return html.Details([html.Summary(summary), table], open=len(rows) <= 8, id="run-rank-hosts",
                        className="gw-rank-hosts")



def _header(run: dict, alerts: list, ranks: Sequence[dict] = ()) -> list:
    now = time.time()
    cfg = run.get("config") or {}
    open_alerts = [a for a in alerts if a.get("status") == "firing"]
    worst = min((a.get("severity") for a in open_alerts), default=None,
                key=lambda s: {"critical": 0, "warning": 1, "info": 2}.get(s, 3))
    facts = [("last step", "—" if run.get("last_step") is None else f"{run['last_step']:,}"),
             ("last loss", format_number(run.get("last_loss"))),
             ("started", format_time(run.get("started_at"))),
             ("last data", format_ago(run.get("last_seen"), now))]
    if run.get("world_size", 1) and run.get("world_size", 1) > 1:
        facts.append(("world size", str(run["world_size"])))
    for key in ("amp_dtype", "max_norm", "host", "torch"):
        if cfg.get(key) is not None:
            facts.append((key.replace("_", " "), str(cfg[key])))
    return [
        html.Div([
            html.H1(run.get("name", ""), className="gw-title", id="run-title"),
            html.Span(run.get("project", ""), className="gw-project"),
            status_badge(run.get("status", "running")),
            health_badge(run.get("health") or worst or "ok", len(open_alerts), *recovery(alerts)),
        ], className="gw-run-title"),
        html.Div([html.Div([html.Span(k, className="gw-fact-key"), html.Span(v, className="gw-fact-value")],
                           className="gw-fact") for k, v in facts], className="gw-facts"),
        *([hosts] if (hosts := _rank_hosts(ranks)) is not None else []),
    ]


def setup_notes(alerts: Sequence[dict]) -> list[dict]:
    """The run's firing configuration-advice notes, warnings first, then by rule id."""
    ids = gateway.setup_rule_ids()
    notes = [a for a in alerts if a.get("rule") in ids and a.get("status") == "firing"]
    return sorted(notes, key=lambda a: (a.get("severity") == "info", a.get("rule") or "", a.get("rank") or 0))


def _setup_advice(notes: list[dict]) -> Optional[html.Div]:
    """The setup advice at the top of the run page: each note's rule, message and first fix (the full card,
    with its diagnosis and evidence, is in the Alerts column)."""
    if not notes:
        return None
    items = []
    for a in notes:
        actions = a.get("actions") or []
        fix = actions[0] if actions and isinstance(actions[0], str) else None
        items.append(html.Li([severity_badge(a.get("severity", "info")),
                              html.Span(f"{a.get('rule', '')} {a.get('name', '')}", className="gw-advice-rule"),
                              html.Span(a.get("message", ""), className="gw-advice-message"),
                              *([html.Span("Fix: " + fix, className="gw-advice-fix")] if fix else [])],
                             id=f"run-advice-{a.get('rule')}", **{"data-severity": a.get("severity", "info")}))
    return html.Div([html.Strong("Setup advice at step 0 (stability checklist): "),
                     html.Span(f"{len(notes)} note{'s' if len(notes) != 1 else ''} on this run's configuration",
                               className="gw-muted"),
                     html.Ul(items)], className="gw-notice gw-notice-advice", id="run-setup-advice")


def _notices(run_id: int, origin: Optional[dict], alerts: Sequence[dict] = ()) -> list:
    out = []
    advice = _setup_advice(setup_notes(alerts))
    if advice is not None:
        out.append(advice)
    if origin:
        data = origin.get("data") or {}
        where = data.get("module") or data.get("param") or "unknown module"
        out.append(html.Div([html.Strong("NaN origin: "),
                             html.Code(where), f" ({data.get('where', 'activation')}) first went non-finite at step ",
                             html.Strong(str(origin.get("step")))], className="gw-notice gw-notice-nan",
                            id="run-nan-origin"))
    top = gateway.list_events(run_id, kind="top_grad_norms")
    if top:
        latest = max(top, key=lambda e: e.get("step") or 0)
        params = (latest.get("data") or {}).get("params") or []
        out.append(html.Div([html.Strong(f"Largest grad norms at step {latest.get('step')}: "),
                             html.Span(", ".join(f"{p[0]} = {format_number(p[1], 3)}" for p in params[:5]))],
                            className="gw-notice"))
    dropped = gateway.list_events(run_id, kind="dropped")
    if dropped:
        n = sum(int((e.get("data") or {}).get("steps") or 0) for e in dropped)
        out.append(html.Div(f"The agent dropped {n} step(s) of telemetry "
                            f"({(dropped[-1].get('data') or {}).get('reason', 'unknown reason')}).",
                            className="gw-notice gw-notice-warn"))
    return out


@callback(
    Output("run-header", "children"),
    Output("run-notices", "children"),
    Output("run-alerts", "children"),
    Output("run-rewinds", "children"),
    Output("run-summary-sig", "data"),
    Input("run-summary-interval", "n_intervals"),
    Input("run-ack-done", "data"),
    State("run-id", "data"),
    State("run-summary-sig", "data"),
    running=pause_while_running("run-summary-interval"),
)
def refresh_summary(_tick, _acked, run_id, previous):
    run = gateway.get_run(run_id)
    if run is None:
        return no_update, no_update, no_update, no_update, no_update
    alerts = gateway.list_alerts(run_id=run_id)
    rewinds = gateway.list_rewinds(run_id)
    origin = _nan_origin(run_id)
    # Each part is redrawn only when what it shows changed, so an open "evidence"
    # or a button under the pointer is not replaced every tick.
    sig = {"header": [run.get("status"), run.get("last_step"), str(run.get("last_loss")), run.get("health"),
                      int(time.time() // 5), figures.alerts_signature(alerts)],
           "notices": [origin and origin.get("step"), run.get("last_step") if run.get("status") == "running" else 0,
                       [[a.get("id"), a.get("status"), a.get("severity")] for a in setup_notes(alerts)]],
           "alerts": figures.alerts_signature(alerts), "rewinds": figures.rewinds_signature(rewinds)}
    previous = previous or {}
    ranks = (gateway.get_rank_meta(run_id) or {}).get("ranks") or [] if (run.get("world_size") or 1) > 1 else []
    sig["header"].append([[r.get("host"), r.get("device"), r.get("local_rank")] for r in ranks])
    header = _header(run, alerts, ranks) if sig["header"] != previous.get("header") else no_update
    notices = _notices(run_id, origin, alerts) if sig["notices"] != previous.get("notices") else no_update
    panel = (alert_list(alerts, ack_type="run-ack", empty="No alerts for this run.")
             if sig["alerts"] != previous.get("alerts") else no_update)
    cards = (rewind_list(rewinds, id_prefix="run-rewind")
             if sig["rewinds"] != previous.get("rewinds", []) else no_update)
    if header is no_update and notices is no_update and panel is no_update and cards is no_update:
        return no_update, no_update, no_update, no_update, no_update
    return header, notices, panel, cards, sig


@callback(
    Output("run-ack-done", "data"),
    Input({"type": "run-ack", "index": ALL}, "n_clicks"),
    State("run-ack-done", "data"),
    prevent_initial_call=True,
)
def acknowledge(_clicks, done):
    trig = ctx.triggered_id
    if not trig or not ctx.triggered or not ctx.triggered[0].get("value"):
        return no_update
    gateway.acknowledge_alert(int(trig["index"]))
    return (done or 0) + 1


dash.register_page(__name__, path_template="/runs/<run_id>", name="Run", title="gradwatch · run", order=1, layout=layout)
