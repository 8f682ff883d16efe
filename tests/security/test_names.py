"""Issue 43, case 3: names are safe in every sink. Ingest refuses a project or run name holding a
control character or a line break (422 naming the field and the character; nothing stored), so no
CR/LF reaches an email header, a Slack/Discord message or a file name; ordinary Unicode, spaces and
punctuation are kept. A routing-file email address that could break a header stops the server at
start; a silence's project name is held to the same rule. Real servers, both databases."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid

from tests.conftest import REPO_ROOT

HOSTILE = ["exp\r\nBcc: x@evil.example", "exp\n1", "exp\r", "nul\x00", "esc\x1b[31m", "tab\there", "del\x7f",
           "c1\x85next", "line\u2028sep", "para\u2029sep"]
KEPT = ["exp-1", "exp 1 (lr=3e-4)", "ünïcödé-实验-🚀", "a/b:c@d", "<script>alert(1)</script>", "`@everyone`"]


def _batch(project, run):
    return {"batch_id": uuid.uuid4().hex, "project": project, "run": run,
            "steps": [{"step": 0, "time": 1.0, "loss": 1.0}]}


def test_ingest_refuses_control_characters_in_names_and_keeps_the_rest(server_factory, db_url):
    srv = server_factory(db_url)
    for name in HOSTILE:
        for field, body in (("run", _batch("names", name)), ("project", _batch(name, "r"))):
            st, out = srv.post("/api/v1/ingest", body)
            assert st == 422, (field, repr(name), out)
            text = str(out)
            assert field in text and ("control characters or line breaks" in text or "NUL" in text), out
    _, runs = srv.get("/api/v1/runs?project=names")
    assert runs["runs"] == [], "nothing stored for a refused name"
    _, projects = srv.get("/api/v1/runs")
    assert all(not any(ord(c) < 32 for c in r["project"]) for r in projects["runs"])
    for name in KEPT:
        st, out = srv.post("/api/v1/ingest", _batch("names", name))
        assert st == 200, (name, out)
    _, runs = srv.get("/api/v1/runs?project=names")
    assert sorted(r["name"] for r in runs["runs"]) == sorted(KEPT)


def test_a_silence_for_a_project_name_with_a_line_break_is_refused(server_factory, db_url):
    srv = server_factory(db_url)
    st, out = srv.post("/api/v1/silences", {"project": "p\r\nq", "matchers": ["run=x"], "duration_s": 60})
    assert st == 422 and "control characters" in str(out), out
    _, listed = srv.get("/api/v1/silences")
    assert listed["silences"] == []


def test_a_routing_file_email_address_that_breaks_a_header_stops_the_server(tmp_path, db_url):
    for address in ("oncall@example.org\r\nBcc: all@example.org", "a b@example.org", "x@example.org, y@example.org",
                    "Name <x@example.org>"):
        routing = tmp_path / "routing.toml"
        routing.write_text(f'[[receivers]]\nname = "m"\nemail = [{json.dumps(address)}]\n')
        env = dict(os.environ, GRADWATCH_DATA_DIR=str(tmp_path), GRADWATCH_ROUTING=str(routing))
        done = subprocess.run([sys.executable, "-m", "gradwatch.server", "serve", "--db", db_url, "--port", "0"],
                              capture_output=True, text=True, env=env, cwd=REPO_ROOT, timeout=120)
        assert done.returncode == 2, (address, done.stderr)
        assert "refusing to start" in done.stderr and "email" in done.stderr, done.stderr
        assert "Traceback" not in done.stderr
