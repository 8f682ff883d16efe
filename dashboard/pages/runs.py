"""Runs page (``/``): every run with its project, status, health, early warnings, last step and loss; live.

The "Early warning" column (docs/dashboard.md): a run with a firing alert of the early-warning family
(rule ids ``H…``, docs/early-warning-advice.md) above info shows a badge naming those rules; firing
info-level notes (the configuration advice H5-H9, mostly) show a quieter "advice" mark with their count.
An acknowledged alert still counts while it fires, as in the Health column: acknowledging says someone
saw it, not that the condition went away; a resolved one no longer counts.

"Size" is the run's estimated bytes in the database (server/lifecycle/sizes.py). Each row's "Delete" asks
for confirmation first (naming the run, its project and size, and saying when it is still sending), then
deletes the run and every row it owns (server/lifecycle/delete.py).
"""
from __future__ import annotations

import time
from typing import Optional

import dash
from dash import ALL, Input, Output, State, callback, ctx, dcc, html, no_update

from gradwatch.dashboard import gateway
from gradwatch.dashboard.ticks import pause_while_running
from gradwatch.dashboard.alert_cards import format_ago, format_time, health_badge, status_badge
from gradwatch.dashboard.figures import format_number

STATUSES = ("running", "finished", "crashed", "stalled")
REFRESH_MS = 1000


def display_status(run: dict, *, now: float, stall_seconds: float) -> str:
    """A running run that has sent nothing for ``stall_seconds`` reads as stalled."""
    status = run.get("status") or "running"
    if status == "running" and run.get("last_seen") and now - run["last_seen"] > stall_seconds:
        return "stalled"
    return status


def early_warning_cell(run_id: int, early: Optional[dict]) -> list:
    """The badge naming a run's firing early warnings above info, and the "advice" mark for its info notes."""
    out: list = []
    if not early:
        return out
    warnings, advice = early.get("warnings") or [], early.get("advice") or []
    if warnings:
        worst = "critical" if any(w[2] == "critical" for w in warnings) else "warning"
        out.append(html.Span("early warning: " + ", ".join(f"{w[0]} {w[1]}" for w in warnings),
                             className=f"gw-badge gw-early gw-early-{worst}", id=f"runs-early-{run_id}",
                             title="firing early-warning alerts: " + ", ".join(f"{w[0]} {w[1]} ({w[2]})"
                                                                                 for w in warnings)))
    if advice:
        out.append(html.Span(f"advice · {len(advice)}", className="gw-advice-mark", id=f"runs-advice-{run_id}",
                             title="configuration advice (info): " + ", ".join(f"{a[0]} {a[1]}" for a in advice)))
    return out


def runs_table(runs: list[dict], *, now: float, stall_seconds: float,
               early: Optional[dict[int, dict]] = None, recovered: Optional[dict[int, tuple]] = None) -> html.Table:
    """``early``: run id -> its early warnings (``gateway.early_warnings``); ``recovered``: run id -> (resolved
    alerts, what it recovered from) (``gateway.recoveries``)."""
    early, recovered = early or {}, recovered or {}
    head = html.Thead(html.Tr([html.Th(h) for h in
                               ("Run", "Project", "Status", "Health", "Early warning", "Last step", "Last loss",
                                "Started", "Last data", "Size", "")]))
    rows = []
    for r in runs:
        status = display_status(r, now=now, stall_seconds=stall_seconds)
        rows.append(html.Tr([
            html.Td(dcc.Link(r.get("name", f"run {r['id']}"), href=f"/runs/{r['id']}", className="gw-run-link")),
            html.Td(r.get("project", "")),
            html.Td(status_badge(status)),
            html.Td(health_badge(r.get("health"), r.get("open_alerts") or 0, *recovered.get(r["id"], (0, None)))),
            html.Td(early_warning_cell(r["id"], early.get(r["id"])), className="gw-early-cell"),
            html.Td("—" if r.get("last_step") is None else f"{r['last_step']:,}", className="gw-num"),
            html.Td(format_number(r.get("last_loss")), className="gw-num"),
            html.Td(format_time(r.get("started_at")), className="gw-muted"),
            html.Td(format_ago(r.get("last_seen"), now), className="gw-muted"),
            html.Td(gateway.format_bytes(r.get("bytes")), className="gw-num gw-run-size"),
            html.Td(html.Button("Delete", id={"type": "runs-delete", "run": r["id"]}, n_clicks=0,
                                className="gw-button gw-button-danger", title="delete this run and all its data")),
        ], className="gw-run-row", id=f"runs-row-{r['id']}", **{"data-status": status}))
    if not rows:
        rows = [html.Tr(html.Td("No runs yet. Attach the agent to a training loop: "
                                "agent.attach(model, scaler, server=...)", colSpan=11, className="gw-empty"))]
    return html.Table([head, html.Tbody(rows)], className="gw-table", id="runs-table-el")


def layout(project: Optional[str] = None, run: Optional[str] = None, **_query):
    """``/?project=nlp&run=exp-42`` (the line the agent prints at attach) opens the list filtered to that run."""
    return html.Div([
        html.Div([
            html.H1("Runs", className="gw-title"),
            html.Div([
                dcc.Dropdown(id="runs-filter-project", placeholder="all projects", clearable=True,
                             className="gw-dropdown", value=project or None,
                             options=[{"label": project, "value": project}] if project else []),
                dcc.Dropdown(id="runs-filter-status", options=[{"label": s, "value": s} for s in STATUSES],
                             placeholder="any status", clearable=True, className="gw-dropdown"),
                dcc.Input(id="runs-filter-name", type="search", placeholder="name contains…", debounce=False,
                          className="gw-input", value=run or None),
            ], className="gw-filters"),
        ], className="gw-page-head"),
        html.Div(id="runs-delete-status", className="gw-muted"),
        html.Div(id="runs-table", className="gw-card"),
        dcc.ConfirmDialog(id="runs-delete-confirm"),
        dcc.Store(id="runs-delete-target"),
        dcc.Store(id="runs-signature"),
        dcc.Interval(id="runs-interval", interval=REFRESH_MS),
    ])


@callback(
    Output("runs-table", "children"),
    Output("runs-filter-project", "options"),
    Output("runs-signature", "data"),
    Input("runs-interval", "n_intervals"),
    Input("runs-filter-project", "value"),
    Input("runs-filter-status", "value"),
    Input("runs-filter-name", "value"),
    State("runs-signature", "data"),
    running=pause_while_running("runs-interval"),
)
def refresh_runs(_tick, project, status, name, signature):
    now = time.time()
    stall = gateway.stall_seconds()
    every = gateway.list_runs()
    projects = sorted({r.get("project", "") for r in every})
    runs = [r for r in every
            if (not project or r.get("project") == project)
            and (not name or name.lower() in (r.get("name") or "").lower())
            and (not status or display_status(r, now=now, stall_seconds=stall) == status)]
    runs.sort(key=lambda r: -(r.get("started_at") or 0))
    early = gateway.early_warnings([r["id"] for r in runs])
    recovered = gateway.recoveries([r["id"] for r in runs])
    # "last data" is relative to now, so it changes every tick; compare it in 5 s steps.
    new_sig = [[r["id"], r.get("status"), r.get("last_step"), str(r.get("last_loss")), r.get("health"),
                r.get("open_alerts"), early.get(r["id"]), int((now - (r.get("last_seen") or now)) // 5),
                r.get("bytes"), list(recovered.get(r["id"]) or ())] for r in runs]
    new_sig = {"rows": new_sig, "projects": projects, "filters": [project, status, name]}
    if new_sig == signature:
        return no_update, no_update, no_update
    return (runs_table(runs, now=now, stall_seconds=stall, early=early, recovered=recovered),
            [{"label": p, "value": p} for p in projects], new_sig)


def delete_message(run: dict) -> str:
    """The confirmation's text: what goes, how big it is, and that it cannot be undone."""
    text = (f"Delete run {run['name']!r} of project {run['project']!r} ({gateway.format_bytes(run.get('bytes'))})?\n\n"
            f"Every step, layer statistic, alert and incident of it is removed. This cannot be undone.")
    if run.get("status") == "running":
        text += "\n\nIt is still sending: its later batches will be refused."
    return text


@callback(
    Output("runs-delete-confirm", "displayed"),
    Output("runs-delete-confirm", "message"),
    Output("runs-delete-target", "data"),
    Input({"type": "runs-delete", "run": ALL}, "n_clicks"),
    prevent_initial_call=True,
)
def ask_delete(_clicks):
    trigger = ctx.triggered_id
    if not isinstance(trigger, dict) or not (ctx.triggered and ctx.triggered[0].get("value")):
        return no_update, no_update, no_update      # the table re-rendered: no click
    run = gateway.delete_preview(int(trigger["run"]))
    if run is None:
        return no_update, no_update, no_update
    return True, delete_message(run), {"id": run["id"], "force": run["status"] == "running"}


@callback(
    Output("runs-delete-status", "children"),
    Input("runs-delete-confirm", "submit_n_clicks"),
    State("runs-delete-target", "data"),
    prevent_initial_call=True,
)
def confirm_delete(_submitted, target):
    if not target:
        return no_update
    # the user confirmed a dialog that said whether the run is still sending: that is the force
    out = gateway.delete_run(int(target["id"]), force=bool(target.get("force")))
    if out["deleted"]:
        return f"{out['message']}: {out['rows']:,} rows, {gateway.format_bytes(out['bytes'])} estimated"
    return out["message"]


dash.register_page(__name__, path="/", name="Runs", title="gradwatch · runs", order=0, layout=layout)
