"""Names in alerts come from the training script: a run called `<!channel>` or `@everyone` must not ping a
Slack channel or a Discord server, nor forge a link, through the alert messages (hostile-input report)."""
from __future__ import annotations

import json

from gradwatch.server.webhooks.formats import render

HOSTILE = "<!channel> @everyone <@U123> <http://evil.example|click me> & co"


def _payload():
    return {"event": "alert", "alert_id": 1, "rule": "A1", "name": "loss_nonfinite", "severity": "critical",
            "status": "firing", "project": HOSTILE, "run": HOSTILE, "run_id": 1, "rank": 0, "step": 5,
            "first_step": 5, "last_step": 5, "message": f"loss NaN in {HOSTILE}", "diagnosis": HOSTILE,
            "actions": [HOSTILE], "evidence": {}, "dashboard_url": "http://127.0.0.1:8470/runs/1",
            "created_at": 0.0}


def test_slack_messages_escape_names_and_keep_their_own_link():
    body = json.loads(render("slack", _payload()))
    texts = [body["text"]] + [b["text"]["text"] for b in body["blocks"] if "text" in b] + \
        [e["text"] for b in body["blocks"] for e in b.get("elements", [])]
    every = "\n".join(texts)
    assert "<!channel>" not in every and "<@U123>" not in every and "<http://evil" not in every
    assert "&lt;!channel&gt;" in body["text"] and "&amp; co" in body["text"]
    assert "<http://127.0.0.1:8470/runs/1|Open the run>" in every     # gradwatch's own link still works


def test_discord_messages_allow_no_mentions():
    body = json.loads(render("discord", _payload()))
    assert body["allowed_mentions"] == {"parse": []}
    assert HOSTILE in body["content"]      # shown as text; Discord pings nobody with parse: []
