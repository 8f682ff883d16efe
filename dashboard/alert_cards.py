"""Alert cards and small badges shared by the run and alerts pages."""
from __future__ import annotations

import json
import time
from typing import Optional, Sequence

from dash import dcc, html


def severity_badge(severity: str) -> html.Span:
    return html.Span(severity, className=f"gw-badge gw-sev-{severity}")


def status_badge(status: str) -> html.Span:
    return html.Span(status, className=f"gw-badge gw-status-{status}")


def health_badge(health: Optional[str], open_alerts: int = 0, resolved_alerts: int = 0,
                 recovered: Optional[str] = None) -> html.Span:
    """The worst open severity and how many alerts are open and resolved; ``healthy`` only for a run that
    never had a warning or critical alert. A run whose alerts all resolved reads "recovered from C3 at step
    80" (``recovered``: what it recovered from), never a bare "healthy" (issue 42)."""
    health = health or ("ok" if not open_alerts else "warning")
    resolved = f" · {resolved_alerts} resolved" if resolved_alerts else ""
    if health != "ok":
        text, css = f"{health} · {open_alerts} open{resolved}", health
    elif recovered:
        text, css = f"recovered from {recovered}{resolved}", "recovered"
    else:
        text, css = "healthy", "ok"
    return html.Span(text, className=f"gw-badge gw-health-{css}",
                     title=f"{open_alerts} open alert(s), {resolved_alerts} resolved")


def recovery(alerts: Sequence[dict]) -> tuple[int, Optional[str]]:
    """How many of ``alerts`` (warning or critical) resolved, and the latest one as "C3 at step 80"."""
    done = [a for a in alerts if a.get("status") == "resolved" and a.get("severity") in ("warning", "critical")]
    if not done:
        return 0, None
    last = max(done, key=lambda a: (a.get("first_step") or 0, a.get("id") or 0))
    return len(done), f"{last.get('rule')} at step {last.get('first_step')}"


def format_time(ts: Optional[float]) -> str:
    if not ts:
        return "—"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(ts)) + " UTC"


def format_ago(ts: Optional[float], now: Optional[float] = None) -> str:
    if not ts:
        return "—"
    s = max(0.0, (now or time.time()) - ts)
    if s < 90:
        return f"{s:.0f} s ago"
    if s < 5400:
        return f"{s / 60:.0f} min ago"
    if s < 48 * 3600:
        return f"{s / 3600:.1f} h ago"
    return f"{s / 86400:.1f} d ago"


def _actions(actions) -> list:
    if not actions:
        return []
    if isinstance(actions, str):
        actions = [actions]
    return [html.Div("What to do", className="gw-alert-label"),
            html.Ul([html.Li(a if isinstance(a, str) else json.dumps(a)) for a in actions], className="gw-alert-actions")]


def held_back_note(alert: dict, by_id: Optional[dict] = None) -> Optional[str]:
    """Why this alert was not sent to the webhooks (server/routing/), in plain words; None: it was (or will
    be) sent. ``by_id``: the other alerts on the page, to name the step of the incident that held it back."""
    if alert.get("suppressed_by") is not None:
        what = alert.get("suppressed_by_rule") or "another alert"
        lead = (by_id or {}).get(alert["suppressed_by"]) or {}
        at = f" at step {lead['first_step']}" if lead.get("first_step") is not None else ""
        return (f"not sent: part of the incident of {what}{at} (alert {alert['suppressed_by']}), which was "
                f"sent instead")
    if alert.get("silenced_by") is not None:
        return f"not sent: silence {alert['silenced_by']} covers it"
    if alert.get("muted"):
        return f"not sent: muted ({alert['muted']})"
    return None


def alert_card(alert: dict, *, ack_type: str, run_label: Optional[str] = None,
               by_id: Optional[dict] = None) -> html.Div:
    """One alert: severity, rule, steps, message, diagnosis, actions, evidence and an acknowledge button.

    ``ack_type`` is the page-prefixed type of the button's pattern-matching id.
    """
    sev = alert.get("severity", "info")
    first, last = alert.get("first_step", alert.get("step")), alert.get("last_step")
    steps = f"step {first}" if last in (None, first) else f"steps {first}–{last}"
    acked = bool(alert.get("acknowledged"))
    head = [severity_badge(sev),
            html.Span(f"{alert.get('rule', '')} {alert.get('name', '')}", className="gw-alert-rule"),
            html.Span(alert.get("status", ""), className=f"gw-alert-status gw-alert-{alert.get('status', '')}"),
            html.Span(steps, className="gw-muted")]
    if alert.get("rank"):
        head.append(html.Span(f"rank {alert['rank']}", className="gw-muted"))
    if run_label is not None:
        head.append(dcc.Link(run_label, href=f"/runs/{alert.get('run_id')}", className="gw-alert-run"))
    if alert.get("id") is not None:   # the incident page: timeline, charts around it, rollback point
        head.append(dcc.Link("incident", href=f"/incidents/{alert['id']}", className="gw-alert-incident",
                             id=f"{ack_type}-incident-{alert['id']}"))
    body = [html.Div(head, className="gw-alert-head")]
    note = held_back_note(alert, by_id)
    if note:
        body.append(html.Div(note, className="gw-alert-held"))
    body.append(html.Div(alert.get("message", ""), className="gw-alert-message"))
    latest = (alert.get("evidence") or {}).get("last_message")
    if latest and latest != alert.get("message") and alert.get("status") == "firing":
        # the first message describes the step the alert opened at; this, the latest step it held at
        body.append(html.Div(f"latest: {latest}", className="gw-alert-latest"))
    if alert.get("diagnosis"):
        body += [html.Div("Diagnosis", className="gw-alert-label"), html.Div(alert["diagnosis"], className="gw-alert-diagnosis")]
    body += _actions(alert.get("actions"))
    if alert.get("evidence"):
        body.append(html.Details([html.Summary("evidence"),
                                  html.Pre(json.dumps(alert["evidence"], indent=1, default=str)[:4000])],
                                 className="gw-alert-evidence"))
    body.append(html.Button("acknowledged" if acked else "Acknowledge",
                            id={"type": ack_type, "index": alert.get("id")},
                            disabled=acked, n_clicks=0, className="gw-button gw-ack"))
    return html.Div(body, className=f"gw-alert gw-alert-sev-{sev}" + (" gw-alert-acked" if acked else "")
                    + (" gw-alert-held-back" if note else ""),
                    id=f"{ack_type}-card-{alert.get('id')}", **{"data-rule": alert.get("rule", ""),
                                                                   "data-severity": sev})


def alert_list(alerts: Sequence[dict], *, ack_type: str, run_labels: Optional[dict] = None,
               empty: str = "No alerts.") -> list:
    """Newest first: firing before resolved, then by step."""
    if not alerts:
        return [html.Div(empty, className="gw-empty")]
    ordered = sorted(alerts, key=lambda a: (a.get("status") != "firing", -(a.get("first_step") or 0), -(a.get("id") or 0)))
    by_id = {a.get("id"): a for a in alerts}
    return [alert_card(a, ack_type=ack_type, by_id=by_id,
                       run_label=None if run_labels is None else run_labels.get(a.get("run_id"), f"run {a.get('run_id')}"))
            for a in ordered]

