"""Incident page (``/incidents/<alert_id>``): one alert's incident on one page.

What deviated first (the precursor timeline of server/forensics/precursors.py, in the alert's
evidence), the charts around it (loss, grad norm, loss scale and the per-layer grad norms over the
incident's window, with the precursor onset, the rollback checkpoint and the alerts marked), the
alerts of the incident (the run's alerts on every rank overlapping that window), the
actions, and the checkpoint to roll back to (the last ``checkpoint`` run event before the first
anomalous step; "no checkpoint recorded" otherwise). Linked from every alert card, from the webhook
payload's ``incident_url`` and from the Slack / Discord / email messages.

The page is drawn once when it is opened (an incident is history); the acknowledge buttons work as on
the run page. Ids start with ``incident-``.
"""
from __future__ import annotations

from typing import Optional

import dash
from dash import ALL, Input, Output, callback, ctx, dcc, html, no_update

from gradwatch.dashboard import figures, gateway, theme
from gradwatch.dashboard.alert_cards import alert_list, severity_badge, status_badge
from gradwatch.dashboard.figures import HEADLINE, PANELS_BY_KEY
from gradwatch.dashboard.rewind_cards import rewind_list

GRAPH_CONFIG = {"displayModeBar": False, "responsive": True}
MAX_POINTS = 400
KIND_LABELS = {"precursor": "precursor", "loss_scale": "loss scale", "checkpoint": "checkpoint",
               "nan_origin": "NaN origin", "alert": "alert", "rewind": "rewind"}


def _parse(alert_id) -> Optional[int]:
    try:
        return int(str(alert_id))
    except (TypeError, ValueError):
        return None


def _marks(incident: dict) -> list[dict]:
    """Vertical lines for the charts: where the first precursor began and the rollback checkpoint."""
    out = []
    first, failure = incident["first_anomalous_step"], incident["alert"]["first_step"]
    if first < failure:
        out.append((first, "first deviation", theme.FLAG_COLOUR))
    rb = incident.get("rollback")
    if rb and rb.get("step") is not None:
        out.append((rb["step"], "checkpoint", theme.MUTED))
    return [{"type": "line", "xref": "x", "yref": "paper", "x0": s, "x1": s, "y0": 0, "y1": 1,
             "line": {"color": c, "width": 1.5, "dash": "dash"}, "layer": "above",
             "label": {"text": t, "textposition": "start", "yanchor": "bottom", "font": {"size": 9, "color": c}}}
            for s, t, c in out]


def _charts(incident: dict) -> list:
    alert = incident["alert"]
    lo, hi = incident["window"]
    rank = max(0, alert.get("rank") or 0)
    alerts = [alert, *incident["alerts"]]
    panels = [PANELS_BY_KEY[k] for k in HEADLINE]
    series = gateway.get_series(alert["run_id"], figures.panel_signals(panels), start=lo, end=hi,
                                max_points=MAX_POINTS, rank=rank)
    marks = _marks(incident)
    graphs = []
    for panel in panels:
        fig, _ = figures.series_figure(panel, series, alerts=alerts, x_range=[lo, hi],
                                       rewinds=incident.get("rewinds") or ())
        fig["layout"]["shapes"] = list(fig["layout"].get("shapes") or []) + marks
        graphs.append(html.Div(dcc.Graph(id=f"incident-graph-{panel.key}", figure=fig, config=GRAPH_CONFIG),
                               className="gw-chart"))
    matrix = gateway.get_layer_matrix(alert["run_id"], "grad_norm", start=lo, end=hi, max_steps=200, rank=rank)
    if matrix.get("steps"):
        layer = next((p.get("layer") for p in (alert.get("evidence") or {}).get("precursors") or ()
                      if isinstance(p, dict) and p.get("layer")), None)
        fig = figures.heatmap_figure("Per-parameter grad norm", matrix, alerts=alerts, x_range=[lo, hi],
                                     highlight=layer, rewinds=incident.get("rewinds") or ())
        fig["layout"]["shapes"] = list(fig["layout"].get("shapes") or []) + marks
        graphs.append(html.Div(dcc.Graph(id="incident-heatmap-grad_norm", figure=fig, config=GRAPH_CONFIG),
                               className="gw-chart gw-chart-wide"))
    return graphs


def _rollback(incident: dict) -> html.Div:
    rb = incident.get("rollback")
    first = incident["first_anomalous_step"]
    if not rb:
        body = [html.Span(f"no checkpoint recorded before step {first:,}", id="incident-rollback-none"),
                html.Div("record checkpoints with monitor.checkpoint(path, step=...) (the HF and Lightning "
                         "callbacks record theirs) and the page names the one to restart from",
                         className="gw-muted")]
    else:
        body = [html.Span("Roll back to "), html.Code(str(rb.get("path") or "(no path)"), id="incident-rollback-path"),
                html.Span(f" at step {rb['step']:,}", id="incident-rollback-step"),
                html.Span(f", {first - rb['step']:,} steps before the first deviation (step {first:,})",
                          className="gw-muted")]
        skip = rb.get("skip") if isinstance(rb.get("skip"), (list, tuple)) else None
        if skip and len(skip) == 2:
            body.append(html.Div(f"and skip the data of steps {skip[0]:,}–{skip[1]:,}", id="incident-rollback-skip"))
    return html.Div([html.H2("Checkpoint to roll back to", className="gw-subtitle"), *body],
                    className="gw-card", id="incident-rollback")


def _timeline(incident: dict) -> html.Div:
    failure = incident["alert"]["first_step"]
    items = []
    for t in incident["timeline"]:
        lead = t["step"] - failure
        when = "at the failure" if lead == 0 else (f"{-lead:,} steps before" if lead < 0 else f"{lead:,} steps after")
        items.append(html.Li([html.Span(f"step {t['step']:,}", className="gw-timeline-step"),
                              html.Span(KIND_LABELS.get(t["kind"], t["kind"]),
                                        className=f"gw-badge gw-timeline-kind-{t['kind']}"),
                              html.Span(t["text"], className="gw-timeline-text"),
                              html.Span(f"({when})", className="gw-muted")],
                             className=f"gw-timeline-item gw-timeline-{t['kind']}",
                             **{"data-kind": t["kind"], "data-step": str(t["step"])}))
    summary = (incident["alert"].get("evidence") or {}).get("precursor_summary")
    return html.Div([html.H2("Timeline", className="gw-subtitle"),
                     html.Div(["What deviated first: ", html.Strong(summary)], id="incident-summary",
                              className="gw-notice") if summary else
                     html.Div("no precursor search for this alert (only critical alerts get one)",
                              id="incident-summary", className="gw-muted"),
                     html.Ol(items, id="incident-timeline", className="gw-timeline")], className="gw-card")


def layout(alert_id=None, **_query):
    aid = _parse(alert_id)
    incident = gateway.get_incident(aid) if aid is not None else None
    if incident is None:
        return html.Div([html.H1("Incident not found", className="gw-title"), dcc.Link("back to alerts", href="/alerts")],
                        className="gw-card")
    alert, run = incident["alert"], incident["run"] or {}
    steps = (f"step {alert['first_step']:,}" if alert["last_step"] == alert["first_step"]
             else f"steps {alert['first_step']:,}–{alert['last_step']:,}")
    # an alert of several ranks (A1, the F family) lists the ranks that joined it in its evidence
    ranks = sorted({int(r) for a in [alert, *incident["alerts"]]
                    for r in [a["rank"], *((a.get("evidence") or {}).get("ranks") or ())]})
    return html.Div([
        dcc.Store(id="incident-ack-done", data=0),
        html.Div([
            html.H1(f"Incident: {alert['rule']} {alert['name']}", className="gw-title", id="incident-title"),
            severity_badge(alert["severity"]), status_badge(alert["status"]),
            dcc.Link(f"{run.get('project', '')} / {run.get('name', '')}", href=f"/runs/{alert['run_id']}",
                     id="incident-run-link", className="gw-alert-run"),
            html.Span(f"{steps} · rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}",
                      className="gw-muted"),
        ], className="gw-run-title"),
        html.Div(alert["message"], className="gw-alert-message", id="incident-message"),
        _rollback(incident),
        _timeline(incident),
        html.Div(rewind_list(incident.get("rewinds") or (), id_prefix="incident-rewind",
                             title="What the Rewind policy did", link_incident=False), id="incident-rewinds"),
        html.H2("Around the incident", className="gw-subtitle"),
        html.Div(_charts(incident), className="gw-chart-grid", id="incident-charts"),
        html.H2(f"Alerts of this incident ({1 + len(incident['alerts'])})", className="gw-subtitle"),
        html.Div(alert_list([alert, *incident["alerts"]], ack_type="incident-ack"), id="incident-alerts"),
        html.Div(id="incident-ack-message", className="gw-muted"),
    ])


@callback(
    Output("incident-ack-message", "children"),
    Input({"type": "incident-ack", "index": ALL}, "n_clicks"),
    prevent_initial_call=True,
)
def acknowledge(_clicks):
    trig = ctx.triggered_id
    if not trig or not ctx.triggered or not ctx.triggered[0].get("value"):
        return no_update
    gateway.acknowledge_alert(int(trig["index"]))
    return f"alert {trig['index']} acknowledged"


dash.register_page(__name__, path_template="/incidents/<alert_id>", name="Incident", title="gradwatch · incident",
                   order=2, layout=layout)
