"""Every ``gradwatch`` command and subcommand answers ``--help``; the issue's command set is all there."""
from __future__ import annotations

import json
import re
import subprocess
import sys

from tests.cli.cli_helpers import gradwatch
from tests.conftest import REPO_ROOT

# The commands docs/cli.md documents (issue 7): each must exist.
DOCUMENTED = [("serve",), ("demo",), ("db", "upgrade"), ("token", "create"), ("sync",), ("rules",), ("export",),
              ("import", "tensorboard"), ("import", "wandb")]

# Walks the command tree in one process (one interpreter start instead of one per command): each
# `--help` goes through the real entry point, server.cli.main, exactly as the console script calls it.
WALK = r"""
import contextlib, io, json, re, sys
from gradwatch.server.cli import main

def subcommands(text):
    m = re.search(r"positional arguments:\n\s+\{([a-z0-9_,-]+)\}", text)
    return m.group(1).split(",") if m else []

seen, todo = {}, [()]
while todo:
    path = todo.pop()
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            code = main([*path, "--help"])
        except SystemExit as e:
            code = e.code
    seen[" ".join(path)] = [code, out.getvalue()]
    todo += [(*path, c) for c in subcommands(out.getvalue()) if " ".join((*path, c)) not in seen]
print(json.dumps(seen))
"""


def test_every_command_has_help_and_the_documented_ones_exist(tmp_path):
    top = gradwatch("--help", data_dir=tmp_path)     # the real console entry point, as a user types it
    assert top.returncode == 0, top.stderr
    assert top.stdout.startswith("usage: gradwatch")

    proc = subprocess.run([sys.executable, "-c", WALK], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
                          env={"PATH": "/usr/bin:/bin", "GRADWATCH_DATA_DIR": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr
    tree = json.loads(proc.stdout)
    for path, (code, text) in tree.items():
        assert code == 0, f"gradwatch {path} --help exited {code}"
        assert text.startswith(f"usage: gradwatch {path}".rstrip()), text[:200]
        assert re.search(r"^options:", text, flags=re.M), f"gradwatch {path} --help lists no options"
    missing = [" ".join(p) for p in DOCUMENTED if " ".join(p) not in tree]
    assert not missing, f"commands missing from gradwatch: {missing}"


def test_a_mistyped_command_lists_the_valid_ones(tmp_path):
    proc = gradwatch("serv", data_dir=tmp_path)
    assert proc.returncode == 2
    assert "invalid choice: 'serv'" in proc.stderr and "serve" in proc.stderr
