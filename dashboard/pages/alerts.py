"""Alerts page (``/alerts``): alerts across runs, filtered by severity, rule and status; live.
Below them, the silences (server/routing/silences.py): add one by matchers and duration, expire one."""
from __future__ import annotations

import shlex

import dash
from dash import ALL, Input, Output, State, callback, ctx, dcc, html, no_update

from gradwatch.dashboard import figures, gateway
from gradwatch.dashboard.alert_cards import alert_list, format_time
from gradwatch.dashboard.ticks import pause_while_running

REFRESH_MS = 1000
SEVERITIES = ("critical", "warning", "info")


def layout(**_query):
    return html.Div([
        html.Div([
            html.H1("Alerts", className="gw-title"),
            html.Div([
                dcc.Dropdown(id="alerts-filter-severity", options=list(SEVERITIES), placeholder="any severity",
                             clearable=True, className="gw-dropdown"),
                dcc.Dropdown(id="alerts-filter-rule", placeholder="any rule", clearable=True, className="gw-dropdown"),
                dcc.Dropdown(id="alerts-filter-status", options=["firing", "resolved"], placeholder="any status",
                             clearable=True, className="gw-dropdown"),
            ], className="gw-filters"),
            html.Span(id="alerts-count", className="gw-muted"),
        ], className="gw-page-head"),
        html.Div(id="alerts-list", className="gw-alerts-grid"),
        html.Div([
            html.H2("Silences", className="gw-subtitle"),
            html.Div([
                dcc.Input(id="alerts-silence-matchers", type="text", className="gw-input", debounce=False,
                          placeholder='matchers, e.g. run=exp-42 rule=~"C.*"'),
                dcc.Input(id="alerts-silence-project", type="text", className="gw-input",
                          placeholder="project (empty: every project)"),
                dcc.Input(id="alerts-silence-duration", type="text", value="2h", className="gw-input"),
                dcc.Input(id="alerts-silence-comment", type="text", className="gw-input", placeholder="comment"),
                html.Button("Add silence", id="alerts-silence-add", n_clicks=0, className="gw-button"),
            ], className="gw-filters"),
            html.Div(id="alerts-silence-message", className="gw-muted"),
            html.Div(id="alerts-silence-list"),
            dcc.Store(id="alerts-silence-sig"),
        ], className="gw-silences"),
        dcc.Store(id="alerts-sig"),
        dcc.Store(id="alerts-ack-done", data=0),
        dcc.Interval(id="alerts-interval", interval=REFRESH_MS),
    ])


@callback(
    Output("alerts-list", "children"),
    Output("alerts-filter-rule", "options"),
    Output("alerts-count", "children"),
    Output("alerts-sig", "data"),
    Input("alerts-interval", "n_intervals"),
    Input("alerts-filter-severity", "value"),
    Input("alerts-filter-rule", "value"),
    Input("alerts-filter-status", "value"),
    Input("alerts-ack-done", "data"),
    State("alerts-sig", "data"),
    running=pause_while_running("alerts-interval"),
)
def refresh_alerts(_tick, severity, rule, status, _acked, previous_sig):
    every = gateway.list_alerts()
    rules = sorted({(a.get("rule"), a.get("name")) for a in every if a.get("rule")})
    shown = [a for a in every if (not severity or a.get("severity") == severity)
             and (not rule or a.get("rule") == rule) and (not status or a.get("status") == status)]
    sig = [figures.alerts_signature(shown), rules, [severity, rule, status]]
    if sig == previous_sig:
        return no_update, no_update, no_update, no_update
    labels = {r["id"]: f"{r.get('project', '')} / {r.get('name', '')}" for r in gateway.list_runs()}
    firing = sum(1 for a in shown if a.get("status") == "firing")
    return (alert_list(shown, ack_type="alerts-ack", run_labels=labels, empty="No alerts match."),
            [{"label": f"{r} {n}", "value": r} for r, n in rules],
            f"{len(shown)} alert(s), {firing} firing", sig)


@callback(
    Output("alerts-ack-done", "data"),
    Input({"type": "alerts-ack", "index": ALL}, "n_clicks"),
    State("alerts-ack-done", "data"),
    prevent_initial_call=True,
)
def acknowledge(_clicks, done):
    if not ctx.triggered_id or not ctx.triggered or not ctx.triggered[0].get("value"):
        return no_update
    gateway.acknowledge_alert(int(ctx.triggered_id["index"]))
    return (done or 0) + 1


def silence_rows(silences: list[dict]) -> list:
    """One line per silence not yet ended, with its expire button."""
    if not silences:
        return [html.Div("No active silences.", className="gw-empty")]
    rows = []
    for s in silences:
        rows.append(html.Div([
            html.Span(f"silence {s['id']}", className="gw-alert-rule"),
            html.Span(s["state"], className="gw-badge"),
            html.Span(s.get("project") or "every project", className="gw-muted"),
            html.Code(" ".join(s["matchers"])),
            html.Span(f"until {format_time(s['ends_at'])}", className="gw-muted"),
            html.Span(f"by {s['created_by']}" if s.get("created_by") else "", className="gw-muted"),
            html.Span(s.get("comment") or "", className="gw-muted"),
            html.Button("Expire", id={"type": "alerts-silence-expire", "index": s["id"]}, n_clicks=0,
                        className="gw-button"),
        ], className="gw-silence", id=f"alerts-silence-{s['id']}"))
    return rows


@callback(
    Output("alerts-silence-list", "children"),
    Output("alerts-silence-message", "children"),
    Output("alerts-silence-sig", "data"),
    Input("alerts-interval", "n_intervals"),
    Input("alerts-silence-add", "n_clicks"),
    Input({"type": "alerts-silence-expire", "index": ALL}, "n_clicks"),
    State("alerts-silence-matchers", "value"),
    State("alerts-silence-project", "value"),
    State("alerts-silence-duration", "value"),
    State("alerts-silence-comment", "value"),
    State("alerts-silence-sig", "data"),
)
def silences(_tick, _add, _expire, matchers, project, duration, comment, previous_sig):
    message = no_update
    trigger = ctx.triggered_id
    try:
        if trigger == "alerts-silence-add" and _add:
            made = gateway.create_silence(project=(project or "").strip() or None,
                                          matchers=shlex.split(matchers or ""), duration=duration or "2h",
                                          comment=comment or "")
            message = f"silence {made['id']} added: {' '.join(made['matchers'])}"
        elif isinstance(trigger, dict) and ctx.triggered and ctx.triggered[0].get("value"):
            gateway.expire_silence(int(trigger["index"]))
            message = f"silence {trigger['index']} expired"
    except (ValueError, LookupError) as e:
        message = str(e)
    shown = gateway.list_silences()
    # re-render only on a change: new expire buttons would otherwise trigger this callback again
    sig = [[s["id"], s["state"], s["ends_at"]] for s in shown]
    if sig == previous_sig:
        return no_update, message, no_update
    return silence_rows(shown), message, sig


dash.register_page(__name__, path="/alerts", name="Alerts", title="gradwatch · alerts", order=3, layout=layout)
