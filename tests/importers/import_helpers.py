"""Helpers the import tests share: the real loggers' output for tests/importers/series.py's run."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def write_logs(kind: str, where: Path, *steps: int) -> Path:
    """``kind`` is tensorboard or wandb (``steps``: first, end for tensorboard); the logger runs in a
    subprocess (write_logs.py says why)."""
    subprocess.run([sys.executable, str(HERE / "write_logs.py"), kind, str(where), *map(str, steps)], check=True,
                   timeout=180,
                   capture_output=True, cwd=where.parent)
    return where


def wandb_run_dir(wb: Path) -> Path:
    """The offline-run-* directory wandb.init(dir=wb) made (not the latest-run link to it)."""
    (run_dir,) = [p for p in (wb / "wandb").glob("offline-run-*") if not p.is_symlink()]
    return run_dir
