"""The routing file and the matchers: what is accepted, and bad input refused saying where and what."""
from __future__ import annotations

import pytest

from gradwatch.server.routing.config import RoutingConfigError, default_config, parse_routing_toml
from gradwatch.server.routing.matchers import parse_matcher
from gradwatch.server.routing.routes import routes_for


def test_matchers_equality_and_anchored_regex():
    labels = {"project": "nlp", "run": "exp-42", "rule": "C3", "severity": "warning", "rank": "3"}
    assert parse_matcher("run=exp-42").matches(labels)
    assert parse_matcher('rule=~"C[13]"').matches(labels)
    assert not parse_matcher("rule=~C").matches(labels)           # whole value, as in Alertmanager
    assert parse_matcher("rank!=0").matches(labels)
    assert not parse_matcher("severity!~warn.*").matches(labels)
    for bad, says in (("run", "expected LABEL=VALUE"), ("colour=red", "unknown label"),
                      ("rule=~(", "regular expression")):
        with pytest.raises(ValueError, match=says):
            parse_matcher(bad)


def test_routes_first_match_continue_and_root():
    cfg = parse_routing_toml("""
receiver = "rest"
[[receivers]]
name = "rest"
[[receivers]]
name = "a"
[[receivers]]
name = "b"
[[routes]]
matchers = ['severity="critical"']
receiver = "a"
continue = true
[[routes]]
matchers = ['project="nlp"']
receiver = "b"
[[routes]]
matchers = ['project=~"n.*"']
receiver = "a"
""")
    names = lambda labels: [r.receiver for r in routes_for(cfg, labels)]  # noqa: E731
    assert names({"severity": "critical", "project": "nlp"}) == ["a", "b"]
    assert names({"severity": "critical", "project": "cv"}) == ["a"]
    assert names({"severity": "info", "project": "nlp"}) == ["b"]
    assert names({"severity": "info", "project": "cv"}) == ["rest"]
    assert cfg.root.timing.group_wait == 30 and cfg.root.group_by == ("project", "run", "family")


def test_without_a_file_every_alert_is_its_own_group_sent_at_once():
    cfg = default_config()
    assert cfg.root.group_by == ("alert",) and cfg.root.timing.group_wait == 0 and cfg.root.receiver == "default"
    assert {r.name for r in cfg.inhibit} == {"nonfinite-loss", "straggler"}


@pytest.mark.parametrize("text, says", [
    ('receiver = "nobody"', "receiver 'nobody' is not defined"),
    ("group_wait = -1", "group_wait must be a number of seconds"),
    ('group_by = ["colour"]', "group_by"),
    ("colour = 1", "unknown key 'colour'"),
    ('[[routes]]\nmatchers = ["rule=~("]\nreceiver = "default"', r"\[\[routes\]\] #1: matchers"),
    ('[[routes]]\nmatchers = []', "receiver: required"),
    ('[[receivers]]\nname = "x"\nemail = ["not-an-address"]', "email"),
    ('[[inhibit]]\nsource = ["rule=A1"]\ntarget = ["rule=C3"]\nsteps_after = -3', "steps_after"),
    ('[[inhibit]]\nsource = ["rule=A1"]', "source and target"),
])
def test_a_bad_routing_file_is_refused_saying_where(text, says):
    with pytest.raises(RoutingConfigError, match=says):
        parse_routing_toml(text, source="routing.toml")
