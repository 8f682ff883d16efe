"""Settings page (``/settings``): webhook endpoints (add, test, delete, delivery log) and
per-project rule thresholds.

Writes go through the rules / webhooks modules (via :mod:`dashboard.gateway`);
a write that the server refuses (bad URL, a threshold out of range) shows the
server's message under the form instead of failing silently.
"""
from __future__ import annotations

import dash
from dash import ALL, Input, Output, State, callback, ctx, dcc, html, no_update

from gradwatch.dashboard import gateway
from gradwatch.dashboard.alert_cards import format_time
from gradwatch.dashboard.ticks import pause_while_running

REFRESH_MS = 1000
FORMATS = ("json", "slack", "discord")
SEVERITIES = ("info", "warning", "critical")


def _projects() -> list[str]:
    mine = gateway.signed_in_project()
    if mine is not None:
        return [mine]
    return sorted({r.get("project", "") for r in gateway.list_runs()} | {"default"})


def storage_line(size: dict) -> html.P:
    """The database's total size (server/lifecycle/sizes.py); each run's own is on the runs page."""
    kind = "SQLite" if size.get("dialect") == "sqlite" else "PostgreSQL"
    text = f"Database: {kind}, {gateway.format_bytes(size.get('bytes'))}"
    if size.get("free_bytes"):
        text += f" ({gateway.format_bytes(size['free_bytes'])} of it free, reused by new data)"
    return html.P(text + ". Each run's size is on the Runs page; deleting runs: docs/deployment.md.",
                  id="settings-storage", className="gw-muted")


def layout(**_query):
    projects = _projects()
    first = next((p for p in projects if p != "default"), "default")
    options = [{"label": p, "value": p} for p in projects]
    return html.Div([
        html.H1("Settings", className="gw-title"),
        storage_line(gateway.database_size()),
        html.Section([
            html.H2("Webhook endpoints", className="gw-subtitle"),
            html.P("Alerts of a project at or above the chosen severity are POSTed to its endpoints (HMAC-signed "
                   "when a secret is set). Server-wide endpoints (GRADWATCH_WEBHOOK_URLS) are listed too.",
                   className="gw-muted"),
            html.Div([
                dcc.Input(id="settings-webhook-url", type="url", placeholder="https://hooks.example.com/…",
                          className="gw-input gw-input-url"),
                dcc.Dropdown(id="settings-webhook-format", options=list(FORMATS), value="json", clearable=False,
                             className="gw-dropdown"),
                dcc.Dropdown(id="settings-webhook-severity", options=[{"label": f"≥ {s}", "value": s} for s in SEVERITIES],
                             value="info", clearable=False, className="gw-dropdown"),
                dcc.Dropdown(id="settings-webhook-project", placeholder="project", clearable=False,
                             options=options, value=first,
                             className="gw-dropdown"),
                dcc.Input(id="settings-webhook-secret", type="password", placeholder="HMAC secret (optional)",
                          className="gw-input"),
                html.Button("Add endpoint", id="settings-webhook-add", n_clicks=0, className="gw-button gw-button-primary"),
            ], className="gw-form"),
            html.Div(id="settings-webhook-message", className="gw-message"),
            html.Div(id="settings-endpoints", className="gw-card"),
            html.H2("Delivery log", className="gw-subtitle"),
            html.Div(id="settings-deliveries", className="gw-card"),
        ], className="gw-section"),
        html.Section([
            html.H2("Rule thresholds", className="gw-subtitle"),
            html.Div([
                dcc.Dropdown(id="settings-rules-project", placeholder="choose a project", clearable=False,
                             options=options, value=first,
                             className="gw-dropdown"),
                html.Span("Defaults come from the rule catalogue (and the server's rules file); values changed here "
                          "are stored per project and apply to the next ingested step.", className="gw-muted"),
            ], className="gw-filters"),
            html.Div(id="settings-rules-message", className="gw-message"),
            html.Div(id="settings-rules", className="gw-card"),
        ], className="gw-section"),
        dcc.Store(id="settings-changed", data=0),
        dcc.Store(id="settings-sig"),
        dcc.Store(id="settings-rules-saved", data=0),
        dcc.Interval(id="settings-interval", interval=REFRESH_MS),
    ])


# --------------------------------------------------------------------------- webhooks

def endpoints_table(endpoints: list[dict]) -> html.Table:
    head = html.Thead(html.Tr([html.Th(h) for h in ("URL", "Format", "Min severity", "Project", "Secret", "")]))
    rows = []
    for e in endpoints:
        eid = e.get("id")
        rows.append(html.Tr([
            html.Td(e.get("url", ""), className="gw-endpoint-url"),
            html.Td(e.get("format", "json")),
            html.Td(e.get("min_severity", "info")),
            html.Td("all projects (server-wide)" if e.get("server_wide") else (e.get("project") or "—")),
            html.Td("yes" if e.get("has_secret") else "—"),
            html.Td([html.Button("Send test", id={"type": "settings-test", "index": eid}, n_clicks=0,
                                 className="gw-button"), " ",
                     html.Button("Delete", id={"type": "settings-delete", "index": eid}, n_clicks=0,
                                 className="gw-button gw-button-danger")]),
        ], id=f"settings-endpoint-{eid}", className="gw-endpoint-row"))
    if not rows:
        rows = [html.Tr(html.Td("No webhook endpoints yet.", colSpan=6, className="gw-empty"))]
    return html.Table([head, html.Tbody(rows)], className="gw-table")


def deliveries_table(deliveries: list[dict]) -> html.Table:
    head = html.Thead(html.Tr([html.Th(h) for h in ("Created", "URL", "What", "Status", "Attempts", "HTTP", "Error")]))
    rows = []
    for d in deliveries:
        what = d.get("rule") or d.get("kind") or ("test" if d.get("alert_id") is None else f"alert #{d['alert_id']}")
        rows.append(html.Tr([
            html.Td(format_time(d.get("created_at")), className="gw-muted"),
            html.Td(d.get("url", "")),
            html.Td(what),
            html.Td(html.Span(d.get("status", ""), className=f"gw-badge gw-delivery-{d.get('status', '')}")),
            html.Td(str(d.get("attempts", 0))),
            html.Td(str(d.get("last_status_code") or "—")),
            html.Td((d.get("last_error") or "")[:120], className="gw-muted"),
        ], className="gw-delivery-row", **{"data-status": d.get("status", "")}))
    if not rows:
        rows = [html.Tr(html.Td("Nothing sent yet.", colSpan=7, className="gw-empty"))]
    return html.Table([head, html.Tbody(rows)], className="gw-table")


@callback(
    Output("settings-endpoints", "children"),
    Output("settings-deliveries", "children"),
    Output("settings-webhook-project", "options"),
    Output("settings-rules-project", "options"),
    Output("settings-sig", "data"),
    Input("settings-interval", "n_intervals"),
    Input("settings-changed", "data"),
    State("settings-sig", "data"),
    running=pause_while_running("settings-interval"),
)
def refresh_webhooks(_tick, _changed, previous_sig):
    projects = _projects()
    endpoints = gateway.list_endpoints(projects)
    deliveries = gateway.list_deliveries(limit=50)
    sig = [[[e.get("id"), e.get("url"), e.get("format"), e.get("min_severity"), e.get("project")] for e in endpoints],
           [[d.get("id"), d.get("status"), d.get("attempts")] for d in deliveries], projects]
    if sig == previous_sig:
        return no_update, no_update, no_update, no_update, no_update
    options = [{"label": p, "value": p} for p in projects]
    return endpoints_table(endpoints), deliveries_table(deliveries), options, options, sig


@callback(
    Output("settings-webhook-message", "children"),
    Output("settings-webhook-message", "className"),
    Output("settings-changed", "data"),
    Output("settings-webhook-url", "value"),
    Input("settings-webhook-add", "n_clicks"),
    Input({"type": "settings-test", "index": ALL}, "n_clicks"),
    Input({"type": "settings-delete", "index": ALL}, "n_clicks"),
    State("settings-webhook-url", "value"),
    State("settings-webhook-format", "value"),
    State("settings-webhook-severity", "value"),
    State("settings-webhook-project", "value"),
    State("settings-webhook-secret", "value"),
    State("settings-changed", "data"),
    prevent_initial_call=True,
)
def webhook_action(_add, _tests, _deletes, url, fmt, severity, project, secret, changed):
    trig = ctx.triggered_id
    if trig is None or not ctx.triggered or not ctx.triggered[0].get("value"):
        return no_update, no_update, no_update, no_update
    ok, error = "gw-message", "gw-message gw-message-error"
    try:
        if trig == "settings-webhook-add":
            url = (url or "").strip()
            if not project:
                return "Choose the project whose alerts go to this endpoint.", error, no_update, no_update
            gateway.create_endpoint(url=url, format=fmt or "json", min_severity=severity or "info",
                                    project=project, secret=secret or None)
            return f"Added {url} for project {project}.", ok, (changed or 0) + 1, ""
        if trig.get("type") == "settings-test":
            gateway.send_test(int(trig["index"]))
            return "Test delivery queued; it shows in the delivery log below.", ok, (changed or 0) + 1, no_update
        if trig.get("type") == "settings-delete":
            gateway.delete_endpoint(int(trig["index"]))
            return "Endpoint deleted.", ok, (changed or 0) + 1, no_update
    except (ValueError, LookupError) as e:
        return str(e), error, no_update, no_update
    return no_update, no_update, no_update, no_update


# --------------------------------------------------------------------------- rule thresholds

def _field(rule: str, key: str, value) -> html.Div:
    fid = {"type": "settings-rule-field", "rule": rule, "key": key}
    if key == "enabled":
        control = dcc.Checklist(id=fid, options=[{"label": "enabled", "value": "on"}],
                                value=["on"] if value else [], className="gw-rule-enabled")
        return html.Div(control, className="gw-rule-param")
    if key == "severity":
        control = dcc.Dropdown(id=fid, options=list(SEVERITIES), value=value, clearable=False,
                               className="gw-dropdown gw-dropdown-small")
    else:
        control = dcc.Input(id=fid, type="number", value=value, className="gw-input", debounce=True)
    return html.Div([html.Span(key.replace("_", " "), className="gw-muted"), control], className="gw-rule-param")


def rules_table(config: dict) -> html.Table:
    head = html.Thead(html.Tr([html.Th(h) for h in ("Rule", "Fires when", "Settings", "")]))
    rows = []
    for rid, values in config.items():
        overridden = set(values.get("overridden") or [])
        keys = [k for k in values if k not in ("id", "name", "overridden")]
        keys.sort(key=lambda k: (k not in ("enabled", "severity"), k))
        text = gateway.rule_text(rid, values)
        rows.append(html.Tr([
            html.Td([html.Strong(rid), html.Br(), html.Span(values.get("name", ""), className="gw-muted")]),
            html.Td(text, className="gw-rule-text"),
            html.Td(html.Div([_field(rid, k, values[k]) for k in keys], className="gw-rule-params")),
            html.Td([html.Button("Save", id={"type": "settings-rule-save", "index": rid}, n_clicks=0,
                                 className="gw-button"),
                     html.Div(f"overridden: {', '.join(sorted(overridden))}" if overridden else "",
                              className="gw-overridden")]),
        ], id=f"settings-rule-{rid}"))
    return html.Table([head, html.Tbody(rows)], className="gw-table gw-rules-table")


@callback(
    Output("settings-rules", "children"),
    Input("settings-rules-project", "value"),
    Input("settings-rules-saved", "data"),
)
def show_rules(project, _saved):
    if not project:
        return html.Div("Choose a project to see and change its thresholds.", className="gw-empty")
    return rules_table(gateway.get_rule_config(project))


@callback(
    Output("settings-rules-message", "children"),
    Output("settings-rules-message", "className"),
    Output("settings-rules-saved", "data"),
    Input({"type": "settings-rule-save", "index": ALL}, "n_clicks"),
    State({"type": "settings-rule-field", "rule": ALL, "key": ALL}, "value"),
    State({"type": "settings-rule-field", "rule": ALL, "key": ALL}, "id"),
    State("settings-rules-project", "value"),
    State("settings-rules-saved", "data"),
    prevent_initial_call=True,
)
def save_rule(_clicks, values, ids, project, saved):
    trig = ctx.triggered_id
    if not trig or not project or not ctx.triggered or not ctx.triggered[0].get("value"):
        return no_update, no_update, no_update
    rule = trig["index"]
    current = gateway.get_rule_config(project).get(rule, {})
    changes = {}
    for fid, value in zip(ids, values):
        if fid["rule"] != rule:
            continue
        key = fid["key"]
        if key == "enabled":
            value = bool(value)
        if value is None or value == current.get(key):
            continue
        changes[key] = value
    if not changes:
        return f"{rule}: nothing changed.", "gw-message", no_update
    try:
        gateway.set_rule_override(project, rule, changes)
    except ValueError as e:
        return str(e), "gw-message gw-message-error", no_update
    return (f"{rule} for project {project}: saved " + ", ".join(f"{k} = {v}" for k, v in changes.items()),
            "gw-message", (saved or 0) + 1)


dash.register_page(__name__, path="/settings", name="Settings", title="gradwatch · settings", order=4, layout=layout)
