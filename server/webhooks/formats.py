"""Webhook payloads: generic JSON, Slack (incoming webhook) and Discord (webhook).

Leaf-ish: works on plain dicts (``alert_payload`` builds the generic one).
"""
from __future__ import annotations

import json
from typing import Any

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


def alert_payload(alert, *, run_name: str, project_name: str, dashboard_url: str, test: bool = False) -> dict[str, Any]:
    """The generic JSON body: everything a receiver needs to act."""
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
        "created_at": alert.created_at,
    }


def render(fmt: str, payload: dict[str, Any]) -> str:
    """The request body for an endpoint of format ``fmt``."""
    if fmt == "slack":
        body = _slack(payload)
    elif fmt == "discord":
        body = _discord(payload)
    else:
        body = payload
    return json.dumps(body, separators=(",", ":"), allow_nan=False, default=str)


def _title(p: dict[str, Any]) -> str:
    test = "[TEST] " if p.get("event") == "alert.test" else ""
    return f"{test}{p['severity'].upper()} {p['rule']} {p['name']}: {p['project']}/{p['run']} step {p['step']}"


def _slack(p: dict[str, Any]) -> dict[str, Any]:
    actions = "\n".join(f"• {a}" for a in p["actions"])
    text = f"{_EMOJI.get(p['severity'], '')} {_title(p)}"
    return {
        "text": text,
        "blocks": [
            {"type": "section", "text": {"type": "mrkdwn", "text": f"*{text}*\n{p['message']}"}},
            {"type": "section", "text": {"type": "mrkdwn", "text": f"*Diagnosis:* {p['diagnosis']}"}},
            {"type": "section", "text": {"type": "mrkdwn", "text": f"*What to do:*\n{actions}"[:2900]}},
            {"type": "context", "elements": [{"type": "mrkdwn", "text": f"<{p['dashboard_url']}|Open the run>"}]},
        ],
    }


def _discord(p: dict[str, Any]) -> dict[str, Any]:
    actions = "\n".join(f"• {a}" for a in p["actions"])
    return {
        "content": _title(p)[:2000],
        "embeds": [{
            "title": f"{p['rule']} {p['name']}"[:256],
            "description": f"{p['message']}\n\n**Diagnosis:** {p['diagnosis']}"[:4000],
            "url": p["dashboard_url"],
            "color": _COLOURS.get(p["severity"], 0),
            "fields": [{"name": "What to do", "value": actions[:1024] or "-"},
                       {"name": "Run", "value": f"{p['project']}/{p['run']} rank {p['rank']}", "inline": True},
                       {"name": "Step", "value": str(p["step"]), "inline": True}],
        }],
    }
