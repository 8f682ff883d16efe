"""One module, one name: the repo's folders load only as gradwatch.agent / .server / .dashboard."""
from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import REPO_ROOT


@pytest.mark.parametrize("bare, how", [("agent", "from gradwatch import agent"), ("server", "gradwatch.server"),
                                       ("dashboard", "gradwatch.dashboard")])
def test_a_checkout_folder_refuses_its_bare_name(bare, how):
    # run from the checkout's root, where `import agent` would find the folder itself
    proc = subprocess.run([sys.executable, "-c", f"import {bare}"], cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError:") and f"import it as `{how}`" in last, proc.stderr


def test_the_whole_product_loaded_holds_no_module_under_a_bare_name():
    code = ("import sys\n"
            "from gradwatch import agent\n"
            "import gradwatch.agent.monitor, gradwatch.agent.integrations.callback, gradwatch.agent.sync\n"
            "from gradwatch.server.operations.settings import Settings\n"
            "from gradwatch.server.app import create_app\n"
            "import tempfile, os\n"
            "create_app(Settings.from_env(db='sqlite:///' + os.path.join(tempfile.mkdtemp(), 'x.db')))\n"
            "import gradwatch.server.cli, gradwatch.server.importers.cli\n"
            "bare = sorted(m for m in sys.modules if m.split('.')[0] in ('agent', 'server', 'dashboard'))\n"
            "ours = [m for m in sys.modules if m.startswith('gradwatch.')]\n"
            "print(len(ours), bare)\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    count, bare = proc.stdout.split(" ", 1)
    assert int(count) > 50 and bare.strip() == "[]", proc.stdout


def test_this_test_process_imported_gradwatch_by_one_name_only():
    bare = [m for m in sys.modules if m.split(".")[0] in ("agent", "server", "dashboard")]
    assert bare == [], bare
