"""Upload a spool directory written in offline mode (or left behind by a run whose server was down).

Standard library only, so the ``gradwatch sync DIR`` command can call it
anywhere. The crash-tail journal of a process that was killed (``tail-<pid>.jsonl``,
:mod:`agent.tail`) is first turned into a batch of its run. Batches are sent oldest first within each spool directory
(``<project>/<run>/rank<k>``); each accepted file is deleted, so running it
again resumes where it stopped, and a batch that was sent but whose answer was
lost is recognised by its ``batch_id`` and answered ``duplicate: true``.

Example::

    >>> from gradwatch.agent.sync import sync_spool
    >>> result = sync_spool("~/.cache/gradwatch/spool", "http://127.0.0.1:8470")  # doctest: +SKIP
    >>> result.sent, result.failed                                                  # doctest: +SKIP
    (42, 0)
"""
from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, TextIO

from gradwatch.agent.spool import SUFFIX, Spool, _sequence
from gradwatch.agent.tail import PREFIX as TAIL_PREFIX, SUFFIX as TAIL_SUFFIX
from gradwatch.agent.transport import HttpTransport


@dataclass
class SyncResult:
    files: int = 0            # batch files found
    sent: int = 0             # accepted as new
    duplicates: int = 0       # the server had them already
    rejected: int = 0         # 4xx: bad batch, left in place and reported
    failed: int = 0           # not sent (server unreachable / 5xx); left in place
    steps: int = 0            # steps in the batches sent
    errors: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.failed == 0 and self.rejected == 0


def _spool_dirs(root: Path) -> list[Path]:
    dirs = sorted({p.parent for p in root.rglob("*" + SUFFIX)} | {p.parent for p in root.rglob(TAIL_PREFIX + "*" + TAIL_SUFFIX)})
    return dirs


def _progress(out: TextIO, done: int, total: int, width: int = 30) -> None:
    filled = int(width * done / total) if total else width
    out.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total} batches")
    out.flush()


def sync_spool(directory: str | os.PathLike, server: str, token: Optional[str] = None, progress: bool = True,
               *, transport: Optional[HttpTransport] = None, out: Optional[TextIO] = None,
               timeout: float = 30.0) -> SyncResult:
    """Send every spooled batch under ``directory`` to ``server``; returns counts.

    Stops at the first failure within a spool directory (to keep that run's
    order) and moves on to the next directory.
    """
    root = Path(os.path.expanduser(str(directory)))
    out = out or sys.stderr
    result = SyncResult()
    if not root.is_dir():
        result.errors.append(f"{root} is not a directory")
        return result
    transport = transport or HttpTransport(server, token, timeout)
    plan = []
    for d in _spool_dirs(root):
        # the crash tail of a killed process (agent/tail.py) becomes that run's next batch file
        Spool(d, max_bytes=1 << 62)
        files = sorted(d.glob("*" + SUFFIX), key=lambda p: (_sequence(p.name), p.name))
        plan.append((d, files))
    total = sum(len(f) for _, f in plan)
    result.files = total
    done = 0
    if progress:
        _progress(out, 0, total)
    for d, files in plan:
        for i, path in enumerate(files):
            try:
                body = path.read_bytes()
            except OSError as e:
                result.failed += 1
                result.errors.append(f"{path}: {e}")
                continue
            delivery = transport.post(body)
            if delivery.accepted:
                try:
                    answer = json.loads(delivery.body or "{}")
                except ValueError:
                    answer = {}
                if answer.get("duplicate"):
                    result.duplicates += 1
                else:
                    result.sent += 1
                    try:
                        result.steps += len(json.loads(body).get("steps", []))
                    except ValueError:
                        pass
                try:
                    path.unlink()
                except OSError:
                    pass
            elif not delivery.retryable:
                result.rejected += 1
                result.errors.append(f"{path}: rejected {delivery.status} {delivery.body[:300]}")
            else:
                left = len(files) - i
                result.failed += left
                done += left - 1
                result.errors.append(f"{d}: server answered {delivery.status or 'nothing'} "
                                     f"({delivery.body[:200]}); {left} batch(es) left for the next sync")
                break
            done += 1
            if progress:
                _progress(out, done, total)
    if progress:
        _progress(out, done, total)
        out.write("\n")
        out.flush()
    return result
