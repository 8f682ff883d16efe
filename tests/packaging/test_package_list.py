"""Every package folder of agent/, server/ and dashboard/ is in pyproject.toml's explicit package list.

The list is explicit (the three folders are mapped to gradwatch.*), so a new package folder that is not
added to it is left out of the wheel: an editable install still finds it, an installed one does not
(the image's install failed so when dashboard/gateway/ was made a package)."""
from __future__ import annotations

import tomllib

from tests.conftest import REPO_ROOT

FOLDERS = {"agent": "gradwatch.agent", "server": "gradwatch.server", "dashboard": "gradwatch.dashboard"}


def test_every_package_folder_is_listed_for_the_wheel():
    listed = set(tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    folders = {".".join([name, *init.parent.relative_to(REPO_ROOT / top).parts])
               for top, name in FOLDERS.items() for init in (REPO_ROOT / top).rglob("__init__.py")}
    assert sorted(folders - listed) == [], "package folders pyproject.toml does not list (not in the wheel)"
