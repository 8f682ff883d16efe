"""A run that breaks and heals itself through the real agent (``remediate=Rewind(...)``), seen from the
server: the same ``rewind`` event the agent's Rewind policy sent is listed, its trigger alert says it was
acted on (and every alert text of the run is true), its incident lists it. The loop is the poisoned-batch
scenario of tests/remediation/scenarios.py (the agent side's), reused read-only; a real server on SQLite."""
from __future__ import annotations

import math

from tests.alert_texts.truth import api_getter, check_run
from tests.conftest import wait_until
from tests.remediation.scenarios import BUILDERS, policy


def test_the_agents_rewind_is_listed_said_on_its_alert_and_in_its_incident(server_factory, sqlite_url):
    srv = server_factory(sqlite_url)
    out = BUILDERS["poisoned_batch"]().run(server=srv.url, project="heal", run="poisoned",
                                           remediate=policy("poisoned_batch"))
    done = [d for d in out["rewinds"] if d["action"] == "rewind"]
    assert done and all(math.isfinite(v) for v in out["losses"][-50:]), "the scenario did not heal itself"
    first = done[0]
    get = api_getter(srv.url)
    run_id = wait_until(lambda: next((r["id"] for r in get("/api/v1/runs?project=heal")["runs"]), None),
                        timeout=30, what="the run")
    listed = wait_until(lambda: get(f"/api/v1/runs/{run_id}/rewinds")["rewinds"] or None, timeout=30,
                        what="the rewinds")
    r = next(x for x in listed if x["action"] == "rewind")
    assert (r["step"], r["to_step"], r["batches_skipped"]) == \
        (first["from_step"], first["to_step"], first["batches_skipped"])
    trigger = get(f"/api/v1/alerts?run={run_id}")["alerts"]
    alert = next(a for a in trigger if a["id"] == first["trigger"]["alert_id"])
    assert r["text"].startswith(f"rewound to step {first['to_step']:,}, skipped {first['batches_skipped']:,} "
                                f"batch")
    assert f"({alert['rule']} {alert['name']} at step {alert['first_step']:,}" in r["text"]
    acted = [a for a in alert["actions"] if a.startswith("Acted on at step ")]
    assert acted and acted[0] == alert["actions"][0]
    latest = max(x["step"] for x in listed if (x["trigger"] or {}).get("alert_id") == alert["id"])
    assert acted[0].startswith(f"Acted on at step {latest:,} by the Rewind policy: ")
    incident = get(f"/api/v1/alerts/{alert['id']}/incident")
    assert first["from_step"] in [t["step"] for t in incident["timeline"] if t["kind"] == "rewind"]
    problems = check_run(get, run_id)
    assert not problems, "\n".join(problems)
