"""Run another checkout's code (a ``git worktree`` of an earlier commit) beside this one's.

The repo's ``agent/``, ``server/`` and ``dashboard/`` folders are the packages
``gradwatch.agent`` / ``.server`` / ``.dashboard`` only once installed (pyproject.toml maps
them); the editable install maps them to *one* checkout. To import another checkout's code
as ``gradwatch.*``, a benchmark puts a shim folder first on ``PYTHONPATH``: ``gradwatch/``
holding links to that checkout's three folders (a namespace portion found before the
editable install's finder). A checkout from before the namespace (top-level ``agent``,
``server``) also gets its root on the path, since its modules import each other by the old
names.

    env = {**os.environ, **checkout.pythonpath(root)}
    subprocess.run([sys.executable, "-m", checkout.server_module(root), "serve", ...], env=env)

``python bench/checkout.py ROOT`` prints the PYTHONPATH for ROOT (a helper's worktree runs its
tests with ``PYTHONPATH=$(python bench/checkout.py $PWD) pytest``).
"""
from __future__ import annotations

import hashlib
import os
import sys
import tempfile
from pathlib import Path

PACKAGES = ("agent", "server", "dashboard")


def namespaced(root: Path) -> bool:
    """Whether ``root`` is a checkout whose packages are named ``gradwatch.*``."""
    return '"gradwatch.server.cli:main"' in (Path(root) / "pyproject.toml").read_text()


def shim(root: Path) -> Path:
    """A folder holding ``gradwatch/{agent,server,dashboard}`` linked to ``root``'s folders."""
    root = Path(root).resolve()
    where = Path(tempfile.gettempdir()) / f"gradwatch-shim-{hashlib.sha1(str(root).encode()).hexdigest()[:10]}"
    pkg = where / "gradwatch"
    pkg.mkdir(parents=True, exist_ok=True)
    for name in PACKAGES:
        link = pkg / name
        if not link.is_symlink() or Path(os.readlink(link)) != root / name:
            tmp = pkg / f".{name}.{os.getpid()}"
            tmp.symlink_to(root / name)
            os.replace(tmp, link)     # atomic: parallel benchmarks may build the same shim
    return where


def pythonpath(root: Path) -> dict[str, str]:
    """The ``PYTHONPATH`` entry that imports ``root``'s code as ``gradwatch.*``."""
    parts = [str(shim(root))] + ([] if namespaced(root) else [str(Path(root).resolve())])
    return {"PYTHONPATH": os.pathsep.join(parts)}


def server_module(root: Path) -> str:
    """What ``python -m`` runs for ``gradwatch`` in ``root``."""
    return "gradwatch.server" if namespaced(root) else "server"


if __name__ == "__main__":
    print(pythonpath(Path(sys.argv[1] if len(sys.argv) > 1 else "."))["PYTHONPATH"])
