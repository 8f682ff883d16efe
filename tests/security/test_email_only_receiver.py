"""Issue 43, case 7: a receiver with ``email`` and no ``webhooks`` key sends email only. With the
documented ``continue = true`` pattern (an email route first, then the root's webhooks), one incident
reaches the webhook once and the mailbox once. A receiver that names ``webhooks = "all"`` beside its
email still posts to them (the explicit form). Real server, real SMTP server, both databases."""
from __future__ import annotations

import uuid

from tests.conftest import wait_until
from tests.routing.conftest import SmtpCapture, settle

ROUTING = """
receiver = "default"
group_by = ["project", "run"]
group_wait = 0

[[receivers]]
name = "hooks"
webhooks = "all"

[[receivers]]
name = "mail"
email = ["oncall@example.org"]

[[receivers]]
name = "mail-and-hooks"
email = ["audit@example.org"]
webhooks = "all"

[[routes]]
matchers = ['project="solo"']
receiver = "mail"
continue = true

[[routes]]
matchers = ['project="both"']
receiver = "mail-and-hooks"

[[routes]]
name = "everything"
receiver = "hooks"
"""


def _nan(srv, project):
    st, out = srv.post("/api/v1/ingest", {"batch_id": uuid.uuid4().hex, "project": project, "run": "r",
                                          "steps": [{"step": 0, "time": 1.0, "loss": 1.0},
                                                    {"step": 1, "time": 2.0, "loss": "NaN"}]})
    assert st == 200, out


def test_an_email_only_receiver_posts_to_no_webhook(server_factory, db_url, tmp_path, webhook_receiver):
    smtp = SmtpCapture().start()
    try:
        routing = tmp_path / "routing.toml"
        routing.write_text(ROUTING)
        srv = server_factory(db_url, extra_args=[f"--webhook={webhook_receiver.url}/hook"],
                             env={"GRADWATCH_ROUTING": str(routing), **smtp.env})
        _nan(srv, "solo")
        wait_until(lambda: smtp.received() and webhook_receiver.received, timeout=15,
                   what="the incident by email and by webhook")
        settle(2.0)
        solo_hooks = [r for r in webhook_receiver.received if r.json()["project"] == "solo"]
        assert len(solo_hooks) == 1, [r.json()["group"]["receiver"] for r in solo_hooks]
        assert solo_hooks[0].json()["group"]["receiver"] == "hooks"
        assert [m["X-Envelope-To"] for m in smtp.received()] == ["oncall@example.org"]

        _nan(srv, "both")          # webhooks = "all" beside email: both, once each
        wait_until(lambda: any(r.json()["project"] == "both" for r in webhook_receiver.received)
                   and len(smtp.received()) == 2, timeout=15, what="the second incident")
        settle(2.0)
        both = [r for r in webhook_receiver.received if r.json()["project"] == "both"]
        assert [r.json()["group"]["receiver"] for r in both] == ["mail-and-hooks"]
        assert sorted(m["X-Envelope-To"] for m in smtp.received()) == ["audit@example.org", "oncall@example.org"]
    finally:
        smtp.stop()
