"""Every ``gradwatch`` command and subcommand answers ``--help``; the issue's command set is all there."""
from __future__ import annotations

import re

from tests.cli.cli_helpers import gradwatch

# The commands docs/cli.md documents (issue 7): each must exist.
DOCUMENTED = [("serve",), ("demo",), ("db", "upgrade"), ("token", "create"), ("sync",), ("rules",), ("export",)]


def _subcommands(help_text: str) -> list[str]:
    """The subcommand choices argparse lists first under "positional arguments"."""
    m = re.search(r"positional arguments:\n\s+\{([a-z0-9_,-]+)\}", help_text)
    return m.group(1).split(",") if m else []


def test_every_command_has_help_and_the_documented_ones_exist(tmp_path):
    top = gradwatch("--help", data_dir=tmp_path)
    assert top.returncode == 0, top.stderr
    assert top.stdout.startswith("usage: gradwatch")
    seen: set[tuple[str, ...]] = set()
    todo = [(c,) for c in _subcommands(top.stdout)]
    while todo:
        path = todo.pop()
        proc = gradwatch(*path, "--help", data_dir=tmp_path)
        assert proc.returncode == 0, f"gradwatch {' '.join(path)} --help failed: {proc.stderr}"
        assert proc.stdout.startswith(f"usage: gradwatch {' '.join(path)}"), proc.stdout[:200]
        seen.add(path)
        todo += [(*path, c) for c in _subcommands(proc.stdout) if (*path, c) not in seen]
    missing = [" ".join(p) for p in DOCUMENTED if p not in seen]
    assert not missing, f"commands missing from gradwatch: {missing}"


def test_a_mistyped_command_lists_the_valid_ones(tmp_path):
    proc = gradwatch("serv", data_dir=tmp_path)
    assert proc.returncode == 2
    assert "invalid choice: 'serv'" in proc.stderr and "serve" in proc.stderr
