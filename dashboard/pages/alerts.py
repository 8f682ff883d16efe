"""Alerts page (``/alerts``): alerts across runs, filtered by severity, rule and status; live."""
from __future__ import annotations

import dash
from dash import ALL, Input, Output, State, callback, ctx, dcc, html, no_update

from dashboard import figures, gateway
from dashboard.alert_cards import alert_list
from dashboard.ticks import pause_while_running

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


dash.register_page(__name__, path="/alerts", name="Alerts", title="gradwatch · alerts", order=3, layout=layout)
