"""Webhook payloads: generic JSON, Slack (incoming webhook) and Discord (webhook).

Leaf-ish: works on plain dicts (``alert_payload`` builds the generic one).
"""
from __future__ import annotations

import json
from typing import Any, Optional

FORMATS = ("json", "slack", "discord")
_COLOURS = {"info": 0x3B82F6, "warning": 0xF59E0B, "critical": 0xDC2626}
_EMOJI = {"info": ":information_source:", "warning": ":warning:", "critical": ":rotating_light:"}


def guess_format(url: str) -> str:
    """Server-wide URLs (GRADWATCH_WEBHOOK_URLS) carry no format: infer Slack / Discord from the host."""
    if "hooks.slack.com/" in url:
        return "slack"
    if "discord.com/api/webhooks/" in url or "discordapp.com/api/webhooks/" in url:
        return "discord"
    return "json"


def alert_payload(alert, *, run_name: str, project_name: str, dashboard_url: str, test: bool = False,
                  incident_url: Optional[str] = None) -> dict[str, Any]:
    """The generic JSON body: everything a receiver needs to act. ``incident_url``: the alert's incident
    page (``outbox.incident_url``; None for a test delivery, whose sample alert has no page)."""
    return {
        "event": "alert.test" if test else "alert",
        "alert_id": alert.id,
        "rule": alert.rule,
        "name": alert.name,
        "severity": alert.severity,
        "status": alert.status,
        "project": project_name,
        "run": run_name,
        "run_id": alert.run_id,
        "rank": alert.rank,
        "step": alert.first_step,
        "first_step": alert.first_step,
        "last_step": alert.last_step,
        "message": alert.message,
        "diagnosis": alert.diagnosis,
        "actions": list(alert.actions or []),
        "evidence": alert.evidence or {},
        "dashboard_url": dashboard_url,
        "incident_url": incident_url,
        "created_at": alert.created_at,
    }


def rewind_payload(rewind: dict[str, Any], *, text: str, trigger: Optional[dict[str, Any]], severity: str,
                   rank: int, run_id: int, run_name: str, project_name: str, dashboard_url: str,
                   incident_url: Optional[str], created_at: float) -> dict[str, Any]:
    """The generic JSON body of a rewind notification (docs/webhooks.md, "Rewinds"): ``event`` is
    ``"rewind"``; ``alert_id`` / ``rule`` / ``name`` are the trigger alert's (null when the event named
    none the server has), ``message`` the sentence (server/queries/rewind_text.py), ``rewind`` the event's data."""
    trigger = trigger or {}
    return {
        "event": "rewind",
        "action": rewind.get("action"),
        "alert_id": trigger.get("alert_id"),
        "rule": trigger.get("rule") or "",
        "name": trigger.get("name") or "",
        "severity": severity,
        "project": project_name,
        "run": run_name,
        "run_id": run_id,
        "rank": rank,
        "step": rewind.get("from_step"),
        "message": text,
        "rewind": rewind,
        "dashboard_url": dashboard_url,
        "incident_url": incident_url,
        "created_at": created_at,
    }


def render(fmt: str, payload: dict[str, Any]) -> str:
    """The request body for an endpoint of format ``fmt``."""
    if payload.get("event") == "rewind" and fmt in ("slack", "discord"):
        body = _rewind_slack(payload) if fmt == "slack" else _rewind_discord(payload)
        return json.dumps(body, separators=(",", ":"), allow_nan=False, default=str)
    if fmt == "slack":
        body = _slack(payload)
    elif fmt == "discord":
        body = _discord(payload)
    else:
        body = payload
    return json.dumps(body, separators=(",", ":"), allow_nan=False, default=str)


def notification_title(p: dict[str, Any]) -> str:
    if p.get("event") == "rewind":
        what = {"rewind": "REWIND", "cool": "LR COOLED", "gave_up": "REWIND GAVE UP"}.get(p.get("action"), "REWIND")
        who = " ".join(x for x in (p.get("rule"), p.get("name")) if x)
        return f"{what}{' ' + who if who else ''}: {p['project']}/{p['run']} step {p['step']}"
    test = "[TEST] " if p.get("event") == "alert.test" else ""
    return f"{test}{p['severity'].upper()} {p['rule']} {p['name']}: {p['project']}/{p['run']} step {p['step']}"


def _slack_text(text: Any) -> str:
    """Slack's own escaping: run, project and layer names come from the training script, and `<!channel>`,
    `<@U123>` or `<http://x|label>` in one would ping a channel or forge a link."""
    return str(text).replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def group_summary(p: dict[str, Any]) -> str:
    """The other alerts of a grouped notification (server/routing/), one line each; "" for a lone alert."""
    g = p.get("group") or {}
    if len(g.get("alerts") or ()) <= 1 and not g.get("held_back") and len(g.get("ranks") or ()) <= 1:
        return ""
    lines = [f"{g.get('count', 0)} alert(s) on ranks {', '.join(map(str, g.get('ranks') or []))}:"]
    first = g.get("first")
    if first and len(g.get("ranks") or ()) > 1:
        lines.insert(0, f"First: rank {first['rank']} at step {first['step']} ({first['rule']})")
    lines += [f"{a['severity']} {a['rule']} {a['name']} rank {a['rank']} step {a['first_step']}"
              for a in (g.get("alerts") or [])[:20]]
    if g.get("held_back"):
        lines.append(f"{g['held_back']} more held back (suppressed, silenced, muted or pending)")
    return "\n".join(lines)


def _links(p: dict[str, Any]) -> str:
    """Slack's context line: the incident page (timeline, charts around it, rollback point) and the run."""
    run = f"<{p['dashboard_url']}|Open the run>"
    return f"<{p['incident_url']}|Open the incident> · {run}" if p.get("incident_url") else run


def _slack(p: dict[str, Any]) -> dict[str, Any]:
    actions = "\n".join(f"• {_slack_text(a)}" for a in p["actions"])
    text = f"{_EMOJI.get(p['severity'], '')} {_slack_text(notification_title(p))}"
    summary = group_summary(p)
    grouped = [{"type": "section", "text": {"type": "mrkdwn", "text": _slack_text(summary)[:2900]}}] if summary else []
    return {
        "text": text,
        "blocks": [*grouped,
            {"type": "section", "text": {"type": "mrkdwn", "text": f"*{text}*\n{_slack_text(p['message'])}"}},
            {"type": "section", "text": {"type": "mrkdwn", "text": f"*Diagnosis:* {_slack_text(p['diagnosis'])}"}},
            {"type": "section", "text": {"type": "mrkdwn", "text": f"*What to do:*\n{actions}"[:2900]}},
            {"type": "context", "elements": [{"type": "mrkdwn", "text": _links(p)}]},
        ],
    }


def _discord(p: dict[str, Any]) -> dict[str, Any]:
    actions = "\n".join(f"• {a}" for a in p["actions"])
    return {
        # names come from the training script: `@everyone` or `<@id>` in one must not ping anyone
        "allowed_mentions": {"parse": []},
        "content": notification_title(p)[:2000],
        "embeds": [{
            "title": f"{p['rule']} {p['name']}"[:256],
            "description": f"{p['message']}\n\n**Diagnosis:** {p['diagnosis']}"[:4000],
            "url": p.get("incident_url") or p["dashboard_url"],
            "color": _COLOURS.get(p["severity"], 0),
            "fields": [{"name": "What to do", "value": actions[:1024] or "-"},
                       *([{"name": "Incident", "value": group_summary(p)[:1024]}] if group_summary(p) else []),
                       {"name": "Run", "value": f"{p['project']}/{p['run']} rank {p['rank']}", "inline": True},
                       *([{"name": "Incident", "value": f"[open the incident]({p['incident_url']})", "inline": True}]
                         if p.get("incident_url") else []),
                       {"name": "Step", "value": str(p["step"]), "inline": True}],
        }],
    }


def rewind_sentence(p: dict[str, Any]) -> str:
    """``Rewound to step 300, skipped 112 batches, … (A1 loss_nonfinite at step 405; rewind 1 of 3).``"""
    text = str(p.get("message") or "")
    return (text[:1].upper() + text[1:] + ".") if text else ""


def _rewind_slack(p: dict[str, Any]) -> dict[str, Any]:
    title = _slack_text(notification_title(p))
    return {"text": f":rewind: {title}",
            "blocks": [{"type": "section", "text": {"type": "mrkdwn",
                                                     "text": f"*:rewind: {title}*\n{_slack_text(rewind_sentence(p))}"}},
                       {"type": "context", "elements": [{"type": "mrkdwn", "text": _links(p)}]}]}


def _rewind_discord(p: dict[str, Any]) -> dict[str, Any]:
    return {"allowed_mentions": {"parse": []}, "content": notification_title(p)[:2000],
            "embeds": [{"title": notification_title(p)[:256], "description": rewind_sentence(p)[:4000],
                        "url": p.get("incident_url") or p["dashboard_url"],
                        "color": _COLOURS.get(p["severity"], 0),
                        "fields": [{"name": "Run", "value": f"{p['project']}/{p['run']} rank {p['rank']}"[:1024],
                                    "inline": True},
                                   {"name": "Step", "value": str(p["step"]), "inline": True}]}]}
