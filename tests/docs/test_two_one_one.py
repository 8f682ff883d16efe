"""docs/architecture.md's "2 / 1 / 1, done for real" table holds: each row's commit changed exactly the code
files the row names, as many as it counts (tests and docs besides), in this repository's own history.

A new row (issue 45 added the sharded signal's) is checked as soon as it is written; a row whose commit
touched a third code file, or a count that does not match its list, fails here.
"""
from __future__ import annotations

import re
import subprocess

import pytest

from tests.conftest import REPO_ROOT

SECTION = "### 2 / 1 / 1, done for real"
NOT_CODE = ("tests/", "docs/")


def table_rows() -> list[tuple[str, int, list[str], str]]:
    """(what was added, the counted files, the files named, the commit) of each row of the table."""
    text = (REPO_ROOT / "docs" / "architecture.md").read_text()
    assert SECTION in text, f"docs/architecture.md lost its section {SECTION!r}"
    section = text.split(SECTION, 1)[1].split("\n### ", 1)[0]
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and re.fullmatch(r"[0-9a-f]{7,40}", cells[2]):
            counted = re.match(r"(\d+): (.*)", cells[1])
            assert counted, f"code files cell {cells[1]!r}: '<count>: `path`, ...'"
            rows.append((cells[0], int(counted.group(1)), re.findall(r"`([^`]+\.py)`", counted.group(2)),
                         cells[2]))
    return rows


def _git(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)


def test_the_table_has_its_rows():
    added = [row[0] for row in table_rows()]
    assert len(added) >= 4, added
    assert any("sharded signal" in a for a in added), added


@pytest.mark.parametrize("row", table_rows(), ids=lambda row: row[3])
def test_each_row_s_commit_changed_the_code_files_it_names(row):
    added, count, named, commit = row
    assert count == len(named), f"{added}: counts {count} but names {named}"
    try:
        inside = _git("rev-parse", "--is-inside-work-tree", "--is-shallow-repository")
    except FileNotFoundError:
        pytest.skip("no git here")
    if inside.returncode != 0 or inside.stdout.split() != ["true", "false"]:
        pytest.skip("not a full git clone: the table's commits cannot be read here")
    shown = _git("show", "--name-only", "--format=", commit)
    assert shown.returncode == 0, f"{commit}: {shown.stderr.strip()}"
    code = sorted(p for p in shown.stdout.split() if not p.startswith(NOT_CODE) and not p.endswith(".md"))
    assert code == sorted(named), f"{added}: commit {commit} changed {code}, the table says {named}"
