"""Issue 43, case 1: a project token's silence regex cannot freeze the server.

Matchers are RE2's (linear time): the catastrophic patterns of Python's backtracking engine are
accepted and match in microseconds, whatever the run name; what RE2 cannot match in linear time
(backreferences, lookaround) and patterns over the size bounds are refused with a 422 when the silence
is written, and nothing is stored. A routing file carrying one stops the server at start, saying where.
Real servers, both databases, auth on (a project token, as in the report)."""
from __future__ import annotations

import subprocess
import sys
import uuid

from tests.conftest import REPO_ROOT, create_token, wait_until

# catastrophic for a backtracking engine: with 'a' * 40 each would take days in Python's re
CATASTROPHIC = ['(a+)+b', '(a|a)*b', '(a*)*b', '(.*a){20}b', '((a+)+)+c', '(a|aa)+b', '([a-z]+)*[0-9]']
REFUSED = {
    '(a)\\1': "invalid escape sequence",                 # backreference
    '(?=a)a': "invalid perl operator",                    # lookahead
    '(?<!b)a': "invalid perl operator",                   # lookbehind
    'a' * 1001: "at most 1000 characters",               # length
    '((a{100}){100}){100}': "",                          # RE2's own repetition limit, or the program size
    '(': "missing )",
}


def _silence(srv, headers, pattern, project="beta"):
    return srv.post("/api/v1/silences", {"project": project, "matchers": [f'run=~"{pattern}"'],
                                         "duration_s": 3600}, headers=headers)


def _nan(srv, headers, project, run):
    return srv.post("/api/v1/ingest", {"batch_id": uuid.uuid4().hex, "project": project, "run": run,
                                       "steps": [{"step": 0, "time": 1.0, "loss": 1.0},
                                                 {"step": 1, "time": 2.0, "loss": "NaN"}]},
                    headers=headers, timeout=60)      # 60 s: catches a hang only (the backtracking took days)


def test_catastrophic_patterns_match_in_linear_time_and_bad_ones_are_refused(server_factory, db_url, tmp_path):
    srv = server_factory(db_url, env={"GRADWATCH_AUTH": "on"})
    auth = {"Authorization": f"Bearer {create_token(db_url, 'beta')}"}
    for pattern in CATASTROPHIC:
        st, body = _silence(srv, auth, pattern)
        assert st == 201, (pattern, body)
    for pattern, why in REFUSED.items():
        st, body = _silence(srv, auth, pattern)
        assert st == 422, (pattern[:40], body)
        assert "matcher run=~" in body["detail"] and why in body["detail"], body
    _, listed = srv.get("/api/v1/silences?project=beta", headers=auth)
    assert len(listed["silences"]) == len(CATASTROPHIC), "a refused silence is not stored"

    st, out = _nan(srv, auth, "beta", "a" * 40)        # matches none of the catastrophic patterns
    assert st == 200, out
    _, alerts = srv.get("/api/v1/alerts?project=beta", headers=auth)
    a1 = [a for a in alerts["alerts"] if a["rule"] == "A1"]
    assert a1 and a1[0]["silenced_by"] is None, a1

    # the neighbour that does match silences the alert (matching still works)
    st, body = _silence(srv, auth, "a+")
    assert st == 201, body
    st, out = _nan(srv, auth, "beta", "a" * 39)
    assert st == 200, out
    wait_until(lambda: any(a["rule"] == "A1" and a["silenced_by"] == body["id"]
                           for a in srv.get("/api/v1/alerts?project=beta", headers=auth)[1]["alerts"]),
               timeout=10, what="the A1 of run 'a'*39 silenced by run=~'a+'")
    st, h = srv.get("/api/health")
    assert st == 200, h


def test_a_routing_file_with_a_backreference_stops_the_server_at_start(tmp_path, db_url):
    routing = tmp_path / "routing.toml"
    routing.write_text('[[receivers]]\nname = "x"\nwebhooks = "all"\n\n[[routes]]\nmatchers = [\'run=~"(a)\\1"\']\n'
                       'receiver = "x"\n')
    env = {"GRADWATCH_DATA_DIR": str(tmp_path), "GRADWATCH_ROUTING": str(routing)}
    done = subprocess.run([sys.executable, "-m", "gradwatch.server", "serve", "--db", db_url, "--port", "0"],
                          capture_output=True, text=True, env={**_env(), **env}, cwd=REPO_ROOT, timeout=120)
    assert done.returncode == 2, done.stderr
    assert "refusing to start" in done.stderr and "[[routes]] #1" in done.stderr and "RE2" in done.stderr
    assert "Traceback" not in done.stderr


def _env():
    import os

    return dict(os.environ)
