"""The crash tail: each sealed step is written to a local journal before it waits for its batch.

Leaf module: standard library only (``gradwatch sync`` recovers journals where torch is absent).

The sender ships a batch every ``flush_interval`` (0.5 s). A process killed by SIGKILL (the OOM
killer, a segfault, a CUDA fault, a scheduler's hard stop) runs no exit handler, so the steps
assembled since the last batch — the ones right before the death, the evidence — were lost.
Now the sender appends every step (and event) it takes to ``tail-<pid>.jsonl`` in the run's
spool directory as soon as it takes it, and empties the file once the batch holding them is
spooled or delivered. The journal is the write-ahead copy of the batch being assembled: its
first line names the batch id that batch will carry, so a journal recovered after its batch
did reach the spool or the server is recognised as a duplicate and stored once.

**Synced** means written with ``write(2)``: the bytes are in the kernel's page cache, which
belongs to the kernel, not to the process, so they survive any death of the process (SIGKILL,
segfault, OOM kill). They do not survive a crash of the machine itself (power loss, kernel
panic) unless ``crash_tail_fsync=True`` (``GRADWATCH_CRASH_TAIL_FSYNC=1``), which calls
``fsync`` after every write (a disk flush: milliseconds on network or spinning storage).

Recovery: a journal whose process is gone (its POSIX record lock, held for the process's life,
is free; record locks are released when a process dies and are not inherited by forked
children such as DataLoader workers) becomes an ordinary spool batch with ``status:
"crashed"``: the next ``agent.attach`` with the same project, run and rank (its spool
directory) or ``gradwatch sync`` sends it. Without ``fcntl`` (Windows) there is no crash tail.

Example::

    >>> import tempfile, json
    >>> d = tempfile.mkdtemp()
    >>> j = TailJournal(d)
    >>> j.write("b1", {"project": "p", "run": "r", "rank": 0, "world_size": 1}, None,
    ...         ['{"step": 0, "loss": 1.0}'], [])
    >>> j.abandon()                       # as a killed process would leave it (lock released)
    >>> [json.loads(b)["steps"] for b in recover_journals(d)]
    [[{'step': 0, 'loss': 1.0}]]
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows: no crash tail
    fcntl = None  # type: ignore[assignment]

PREFIX, SUFFIX = "tail-", ".jsonl"
AVAILABLE = fcntl is not None

# journals this process writes (a POSIX record lock does not exclude its own process)
_live: set[str] = set()


class TailJournal:
    """The journal of one sender: ``write`` appends, ``reset`` empties, ``close`` removes.

    Only the sender thread calls it. Every method catches its own OSError and turns the journal off
    (``last_error`` says why): the batches still go out as before, only the crash tail is gone."""

    def __init__(self, directory: str | os.PathLike, *, fsync: bool = False):
        self.directory = Path(directory)
        self.path = self.directory / f"{PREFIX}{os.getpid()}{SUFFIX}"
        self.fsync = fsync
        self.last_error: Optional[str] = None
        self._fd: Optional[int] = None
        self._batch_id: Optional[str] = None    # the batch whose header line is written
        self._off = not AVAILABLE

    @property
    def on(self) -> bool:
        return not self._off

    @property
    def batch_id(self) -> Optional[str]:
        """The batch whose steps the journal holds (None: empty)."""
        return self._batch_id

    def _open(self) -> bool:
        if self._fd is not None:
            return True
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0), 0o644)
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            self._fail(f"cannot open the crash-tail journal {self.path}: {e}")
            return False
        self._fd = fd
        _live.add(str(self.path))
        return True

    def write(self, batch_id: str, header: dict, meta: Optional[dict], steps: list[str], events: list[str]) -> None:
        """Append steps and events (already JSON) of the batch ``batch_id``; starts a new journal for a new batch."""
        if self._off or (not steps and not events) or not self._open():
            return
        parts = []
        if batch_id != self._batch_id:
            if self._batch_id is not None:
                self.reset()
                if self._off:
                    return
            parts.append(json.dumps({"tail": 1, "batch_id": batch_id, "header": header, "meta": meta}))
        parts += ["s" + s for s in steps]
        parts += ["e" + e for e in events]
        data = ("\n".join(parts) + "\n").encode()
        try:
            view = memoryview(data)
            while view:
                n = os.write(self._fd, view)
                view = view[n:]
            if self.fsync:
                os.fsync(self._fd)
        except OSError as e:
            self._fail(f"cannot write the crash-tail journal {self.path}: {e}")
            return
        self._batch_id = batch_id

    def reset(self) -> None:
        """The batch it held is stored (spool or server): empty the journal."""
        if self._fd is None or self._batch_id is None:
            return
        try:
            os.ftruncate(self._fd, 0)
            os.lseek(self._fd, 0, os.SEEK_SET)
        except OSError as e:
            self._fail(f"cannot empty the crash-tail journal {self.path}: {e}")
        self._batch_id = None

    def close(self) -> None:
        """The process ends cleanly (its last batch is stored): remove the journal."""
        fd, self._fd = self._fd, None
        self._off = True
        if fd is None:
            return
        try:
            os.unlink(self.path)
        except OSError:
            pass
        try:
            os.close(fd)
        except OSError:
            pass
        _live.discard(str(self.path))

    def abandon(self) -> None:
        """Let go of the file as a killed process would (tests, and a forked child's copy)."""
        fd, self._fd = self._fd, None
        self._off = True
        _live.discard(str(self.path))
        if fd is not None:
            try:
                os.close(fd)
            except OSError:
                pass

    def _fail(self, why: str) -> None:
        self.last_error = why
        self.close()


def _owned(path: Path) -> bool:
    """True while the process that writes ``path`` lives (or when that cannot be told)."""
    if str(path) in _live:
        return True
    if fcntl is None:
        return True
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError:
        return True
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return True      # locked: its writer is alive
    finally:
        os.close(fd)     # closing releases the lock we may have taken
    return False


def _batch_of(text: str) -> Optional[bytes]:
    """The request body a journal's lines make; None when it holds no complete step or event."""
    lines = text.split("\n")
    try:
        head = json.loads(lines[0])
    except ValueError:
        return None
    if not isinstance(head, dict) or head.get("tail") != 1 or not head.get("batch_id"):
        return None
    steps, events = [], []
    for line in lines[1:]:
        if not line:
            continue
        try:   # a line cut short by the kill is the last one: skipped
            value = json.loads(line[1:])
        except ValueError:
            continue
        (steps if line[0] == "s" else events if line[0] == "e" else []).append(value)
    if not steps and not events:
        return None
    batch = {"batch_id": head["batch_id"], **(head.get("header") or {}), "steps": steps, "events": events,
             # the process died without closing: the run's status says so until a new process sends
             "status": "crashed"}
    if head.get("meta") is not None:
        batch["meta"] = head["meta"]
    return json.dumps(batch).encode()


def journals(directory: str | os.PathLike) -> list[Path]:
    try:
        return sorted(Path(directory).glob(f"{PREFIX}*{SUFFIX}"))
    except OSError:
        return []


def recover_journals(directory: str | os.PathLike, store=None) -> list[bytes]:
    """Turn the journals of dead processes in ``directory`` into batch bodies.

    ``store(body) -> bool`` (the spool's ``append``) keeps each one; a journal is deleted once its
    batch is kept (or holds nothing). Without ``store`` the bodies are returned and the journals
    deleted. Journals of living processes are left alone."""
    out = []
    for path in journals(directory):
        if _owned(path):
            continue
        try:
            body = _batch_of(path.read_text(encoding="utf-8", errors="replace"))
        except OSError:
            continue
        if body is not None:
            if store is not None and not store(body):
                continue    # not kept (spool full): try again next time
            out.append(body)
        try:
            path.unlink()
        except OSError:
            pass
    return out
