"""The server's rooms as docs/architecture.md states them: only entry modules on the top floor, and
each room importing only the rooms listed before it (so no two rooms import each other).

Read from the code (every import statement, top-level or inside a function) and from the sentence in
the map that lists the rooms, so a move that breaks the order, or a doc that no longer says it, fails."""
from __future__ import annotations

import ast
import re
from pathlib import Path

from tests.conftest import REPO_ROOT

SERVER = REPO_ROOT / "server"
ENTRY_MODULES = {"__init__.py", "__main__.py", "app.py", "cli.py", "healthcheck.py"}


def _documented_order() -> list[str]:
    text = (REPO_ROOT / "docs" / "architecture.md").read_text()
    found = re.search(r"A room imports only rooms listed above it\s*\(([^)]*)\)", text)
    assert found, "docs/architecture.md no longer states the rooms' order"
    return [name.strip() for name in found.group(1).replace("\n", " ").split(",")]


def _room_of(path: Path) -> str:
    parts = path.relative_to(SERVER).parts
    return parts[0] if len(parts) > 1 else path.stem


def _imported_rooms(path: Path) -> set[str]:
    rooms = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level:
            raise AssertionError(f"{path}: a relative import; the server imports by its full names")
        names = [node.module or ""] if isinstance(node, ast.ImportFrom) else \
            [a.name for a in node.names] if isinstance(node, ast.Import) else []
        if isinstance(node, ast.ImportFrom) and node.module == "gradwatch.server":
            names = [f"gradwatch.server.{a.name}" for a in node.names]
        rooms |= {n.split(".")[2] for n in names if n.startswith("gradwatch.server.")}
    return rooms


def test_the_top_floor_holds_packages_and_the_entry_modules_only():
    loose = sorted(p.name for p in SERVER.glob("*.py") if p.name not in ENTRY_MODULES)
    assert loose == [], f"modules on the server's top floor that are not entry points: {loose}"


def test_each_room_imports_only_the_rooms_listed_before_it():
    order = _documented_order()
    rooms = sorted(p.name for p in SERVER.iterdir() if (p / "__init__.py").exists() and p.name != "migrations")
    assert sorted(order) == rooms, "the rooms docs/architecture.md lists are not the server's packages"
    rank = {room: i for i, room in enumerate(order)}
    wrong = []
    for path in sorted(SERVER.rglob("*.py")):
        room = _room_of(path)
        if room not in rank:          # an entry module, or migrations (Alembic's, it reads storage only)
            continue
        for other in _imported_rooms(path) - {room}:
            if other not in rank or rank[other] > rank[room]:
                wrong.append(f"{path.relative_to(REPO_ROOT)} ({room}) imports {other}")
    assert wrong == [], "imports that point up the rooms' order:\n" + "\n".join(wrong)
