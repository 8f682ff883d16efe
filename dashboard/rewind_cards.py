"""Rewind cards: what the agent's Rewind policy did to a run, one card per rewind (run and incident pages).

A card shows the action (rewind / LR cooled / gave up), the step it was made at, the sentence the
server wrote for it (the one webhooks send: ``GET /api/v1/runs/{id}/rewinds`` ``text``), the numbers
it is made of, and a link to the incident of the alert it acted on.
"""
from __future__ import annotations

from typing import Optional, Sequence

from dash import dcc, html

ACTION_BADGES = {"rewind": "rewind", "cool": "LR cooled", "gave_up": "gave up"}


def _facts(rewind: dict) -> list[tuple[str, str]]:
    out = []
    if rewind.get("to_step") is not None:
        out.append(("to step", f"{rewind['to_step']:,}"))
    if rewind.get("batches_skipped") is not None:
        out.append(("batches skipped", f"{rewind['batches_skipped']:,}"))
    if rewind.get("snapshot_age_steps") is not None:
        out.append(("snapshot age", f"{rewind['snapshot_age_steps']:,} steps"))
    if rewind.get("cool_steps"):
        out.append(("LR", f"×{float(rewind.get('lr_factor') or 1.0):g} for {rewind['cool_steps']:,} steps"))
    if rewind.get("rewind_number") is not None and rewind.get("max_rewinds") is not None:
        out.append(("rewinds", f"{rewind['rewind_number']} of {rewind['max_rewinds']}"))
    if rewind.get("then"):
        out.append(("then", str(rewind["then"])))
    if len(rewind.get("ranks") or ()) > 1:
        out.append(("ranks", ", ".join(str(r) for r in rewind["ranks"])))
    return out


def rewind_card(rewind: dict, *, id_prefix: str, link_incident: bool = True) -> html.Div:
    """One rewind; ``id_prefix`` is the page's (``run-rewind``: ids ``run-rewind-<step>-<action>``);
    ``link_incident``: link the incident of the alert it acted on (not on that incident's own page)."""
    action = rewind.get("action") or "rewind"
    text = rewind.get("text") or ""
    head = [html.Span(ACTION_BADGES.get(action, action), className=f"gw-badge gw-rewind-{action}"),
            html.Span(f"step {rewind.get('step'):,}", className="gw-muted")]
    alert_id = (rewind.get("trigger") or {}).get("alert_id")
    if alert_id is not None and link_incident:
        head.append(dcc.Link("incident", href=f"/incidents/{alert_id}", className="gw-alert-incident"))
    body = [html.Div(head, className="gw-alert-head"),
            html.Div(text[:1].upper() + text[1:], className="gw-rewind-text gw-alert-message")]
    facts = _facts(rewind)
    if facts:
        body.append(html.Div([html.Span([html.Span(k, className="gw-fact-key"), html.Span(v, className="gw-fact-value")],
                                        className="gw-fact") for k, v in facts], className="gw-facts"))
    return html.Div(body, className=f"gw-alert gw-rewind gw-rewind-card-{action}",
                    id=f"{id_prefix}-{rewind.get('step')}-{action}",
                    **{"data-action": action, "data-step": str(rewind.get("step"))})


def rewind_list(rewinds: Sequence[dict], *, id_prefix: str, title: Optional[str] = "Rewinds",
                link_incident: bool = True) -> list:
    """The rewinds newest first, under ``title``; nothing at all for a run without any."""
    if not rewinds:
        return []
    ordered = sorted(rewinds, key=lambda r: -(r.get("step") or 0))
    return ([html.H2(title, className="gw-subtitle")] if title else []) + \
        [rewind_card(r, id_prefix=id_prefix, link_incident=link_incident) for r in ordered]
