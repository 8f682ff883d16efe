"""The dashboard's pages, found by the one plug-in loader (agent/plugins.py) and placed by the ``order``
each declares to ``dash.register_page`` (ties by module name, Dash's rule): the page registry, and so the
header's links, in that order.

In a child process: Dash registers a page only inside an app, and its page registry is process-wide.
"""
from __future__ import annotations

import json
import subprocess
import sys

from tests.conftest import REPO_ROOT

PROBE = """
import json, types
import dash
from gradwatch.agent import plugins
from gradwatch.dashboard import create_dash
create_dash(None, types.SimpleNamespace(auth=False))
print(json.dumps({"registry": [[p["module"], p["order"], p.get("path_template") is None]
                               for p in dash.page_registry.values()],
                  "modules": [m.__name__ for m in plugins.modules("gradwatch.dashboard.pages")]}))
"""


def test_pages_are_the_packages_modules_in_their_declared_order():
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    pages = "gradwatch.dashboard.pages."
    assert sorted(m for m, _, _ in seen["registry"]) == sorted(seen["modules"])
    assert [m.removeprefix(pages) for m, _, _ in seen["registry"]] == \
        ["runs", "run", "compare", "incident", "alerts", "settings"]
    assert seen["registry"] == sorted(seen["registry"], key=lambda p: (p[1], p[0]))
    # the header's links: the pages with a fixed path, in that order
    assert [m.removeprefix(pages) for m, _, fixed in seen["registry"] if fixed] == \
        ["runs", "compare", "alerts", "settings"]
