"""``gradwatch rules`` and ``gradwatch demo``'s argument errors (the full demo run: tests/e2e/test_demo.py)."""
from __future__ import annotations

import json

from tests.cli.cli_helpers import gradwatch


def test_rules_prints_the_catalogue_and_json(tmp_path):
    proc = gradwatch("rules", data_dir=tmp_path)
    assert proc.returncode == 0, proc.stderr
    for rule in ("A1", "loss_nonfinite", "A5", "overflow_storm", "F2", "run_stalled"):
        assert rule in proc.stdout
    proc = gradwatch("rules", "--json", "--project", "vision", data_dir=tmp_path)
    assert proc.returncode == 0, proc.stderr
    body = json.loads(proc.stdout)
    assert body["project"] == "vision"
    assert {r["id"] for r in body["rules"]} >= {"A1", "A2", "A5", "B3", "C3", "D2", "F2"}


def test_rules_file_errors_name_the_rule_and_exit_2(tmp_path):
    bad = tmp_path / "rules.toml"
    bad.write_text('[rules.A2]\nratio = "ten"\n')
    proc = gradwatch("rules", "--rules", str(bad), data_dir=tmp_path)
    assert proc.returncode == 2
    assert "A2" in proc.stderr


def test_demo_argument_errors_say_what_to_do(tmp_path):
    proc = gradwatch("demo", "--steps", "10", data_dir=tmp_path)
    assert proc.returncode == 2
    assert "--steps must be at least 150" in proc.stderr
