"""On-disk spool: one file per batch, written once, replayed oldest first, deleted when delivered.

Standard library only (and :mod:`agent.tail`, whose crash-tail journals it turns into batches when
it opens).

Files are named ``<sequence>-<pid>.json`` so that sorting the names gives the
order the batches were made in. Each file holds the exact request body, batch
id included, so a batch that is replayed after a lost answer is recognised by
the server as a duplicate.

Example::

    >>> import tempfile
    >>> s = Spool(tempfile.mkdtemp(), max_bytes=1 << 20)
    >>> s.append(b'{"batch_id": "a", "steps": []}')
    True
    >>> [s.read(p) for p in s.pending()]
    [b'{"batch_id": "a", "steps": []}']
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

from gradwatch.agent.tail import recover_journals

SUFFIX = ".json"


class Spool:
    def __init__(self, directory: str | os.PathLike, max_bytes: int):
        self.directory = Path(directory)
        self.max_bytes = max_bytes
        self.last_error: Optional[str] = None
        self._pid = os.getpid()
        self._bytes = 0
        self._seq = 0
        self._usable = self._open()
        self.recovered_batches = 0
        if self._usable:
            # the crash tail of a process of this run and rank that was killed (agent/tail.py): it
            # becomes the next batch, after that process's own spooled batches
            self.recovered_batches = len(recover_journals(self.directory, self.append))

    def _open(self) -> bool:
        if self.max_bytes <= 0:
            self.last_error = "spool disabled (spool_max_mb=0)"
            return False
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            for p in self.directory.glob("*" + SUFFIX):
                self._bytes += p.stat().st_size
                self._seq = max(self._seq, _sequence(p.name))
            return True
        except OSError as e:
            self.last_error = f"spool directory {self.directory} unusable: {e}"
            return False

    @property
    def usable(self) -> bool:
        return self._usable

    def append(self, body: bytes) -> bool:
        """Write one batch; False when it does not fit or cannot be written (the caller counts a drop)."""
        if not self._usable:
            return False
        if self._bytes + len(body) > self.max_bytes:
            self.last_error = f"spool full ({self._bytes} of {self.max_bytes} bytes)"
            return False
        self._seq += 1
        final = self.directory / f"{self._seq:012d}-{self._pid}{SUFFIX}"
        tmp = final.with_suffix(".tmp")
        try:
            with open(tmp, "wb") as f:
                f.write(body)
            os.replace(tmp, final)  # a reader never sees half a batch
        except OSError as e:
            self.last_error = f"cannot write to spool {self.directory}: {e}"
            try:
                tmp.unlink()
            except OSError:
                pass
            return False
        self._bytes += len(body)
        return True

    def pending(self) -> list[Path]:
        """Spooled batches, oldest first."""
        if not self._usable:
            return []
        try:
            return sorted(self.directory.glob("*" + SUFFIX), key=lambda p: (_sequence(p.name), p.name))
        except OSError:
            return []

    def has_backlog(self) -> bool:
        return self._usable and self._bytes > 0 and bool(self.pending())

    @staticmethod
    def read(path: Path) -> Optional[bytes]:
        try:
            return path.read_bytes()
        except OSError:
            return None

    def remove(self, path: Path) -> None:
        try:
            size = path.stat().st_size
            path.unlink()
            self._bytes = max(0, self._bytes - size)
        except OSError:
            pass  # another process replaying the same directory got there first


    def prune(self, top: str | os.PathLike) -> bool:
        """After a clean close: remove this spool's directory if nothing is left in it (every batch reached
        the server), and its emptied parents below ``top`` (the spool root). ``rmdir`` only: a directory that
        still holds a batch, or a journal of another process, stays. True when the directory is gone."""
        if os.getpid() != self._pid:
            return False
        top = Path(top).resolve()
        d = self.directory.resolve()
        try:
            d.rmdir()
        except OSError:
            return False
        for parent in d.parents:
            if parent == top or top not in parent.parents:
                break
            try:
                parent.rmdir()
            except OSError:
                break
        return True


def _sequence(name: str) -> int:
    try:
        return int(name.split("-", 1)[0].split(".", 1)[0])
    except ValueError:
        return 0
