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


def _rewind_payload():
    from gradwatch.server.webhooks.formats import rewind_payload

    return rewind_payload({"action": "rewind", "from_step": 412, "to_step": 300}, text=f"rewound to step 300 ({HOSTILE})",
                          trigger={"rule": "A1", "name": HOSTILE, "alert_id": 1}, severity="critical", rank=0,
                          run_id=1, run_name=HOSTILE, project_name=HOSTILE,
                          dashboard_url="http://127.0.0.1:8470/runs/1",
                          incident_url="http://127.0.0.1:8470/incidents/1", created_at=0.0)


def test_rewind_notifications_escape_names_too():
    """Issue 44: a rewind's Slack / Discord / email message carries the same names (server/forensics/rewinds.py)."""
    from gradwatch.server.routing.notifications import email_body

    body = json.loads(render("slack", _rewind_payload()))
    every = "\n".join([body["text"]] + [b["text"]["text"] for b in body["blocks"] if "text" in b] +
                      [e["text"] for b in body["blocks"] for e in b.get("elements", [])])
    assert "<!channel>" not in every and "<@U123>" not in every and "<http://evil" not in every
    assert "<http://127.0.0.1:8470/incidents/1|Open the incident>" in every
    assert body["text"].startswith(":rewind: REWIND A1 &lt;!channel&gt;")
    discord = json.loads(render("discord", _rewind_payload()))
    assert discord["allowed_mentions"] == {"parse": []}
    assert discord["embeds"][0]["description"].startswith("Rewound to step 300 (")
    generic = json.loads(render("json", _rewind_payload()))
    assert generic["event"] == "rewind" and generic["message"] == f"rewound to step 300 ({HOSTILE})"
    mail = email_body(_rewind_payload())
    assert mail["subject"].startswith("[gradwatch] REWIND A1 ") and "\n" not in mail["subject"]
    assert "Open the incident: http://127.0.0.1:8470/incidents/1" in mail["text"]
