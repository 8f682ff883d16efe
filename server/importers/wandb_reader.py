"""W&B offline runs (``wandb/offline-run-*/run-*.wandb``) -> :class:`SourceRun` objects.

The ``.wandb`` file is W&B's transaction log: a 7-byte header (``:W&B``, magic
0xBEE1, version 0), then LevelDB-log framing (32 KiB blocks; each chunk a
7-byte header of CRC-32, length and type FULL / FIRST / MIDDLE / LAST) around
serialized ``wandb_internal_pb2.Record`` protobufs. Records are decoded with
W&B's own protobuf classes. The framing reader is here because wandb 0.31
has none in Python any more (``wandb.sdk.internal.datastore`` went with the
move of the internal process to the Go ``wandb-core``, which reads the log
itself); it checks every chunk's CRC and stops at a torn tail, which is where
a killed process leaves the log.

``history`` records (one per ``wandb.log`` call) give the scalars;
the ``run`` record the name and project; an ``exit`` record says the run
finished.
"""
from __future__ import annotations

import json
import math
import mmap
import os
import struct
import zlib
from pathlib import Path
from typing import Callable, Iterator, Optional

from gradwatch.server.importers.source import ImportProblem, SourceRun
from gradwatch.server.commands.extras import pip_command

INSTALL_HINT = pip_command("import")

_HEADER = struct.Struct("<4sHB")
_IDENT, _MAGIC = b":W&B", 0xBEE1
_BLOCK = 32768
_CHUNK = struct.Struct("<IHB")
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4
# W&B seeds each chunk's CRC-32 with the CRC of its type byte
_TYPE_CRC = {t: zlib.crc32(bytes([t])) for t in (_FULL, _FIRST, _MIDDLE, _LAST)}
# W&B's own history keys: _step is the step (unless the run logs a global step), _timestamp the wall time
_META_KEYS = ("_step", "_timestamp", "_runtime")
# the global step HF Trainer and Lightning log alongside their metrics (W&B's _step counts log calls)
STEP_KEYS_AUTO = ("train/global_step", "trainer/global_step")


def check_installed() -> None:
    _pb()


def _pb():
    try:
        from wandb.proto import wandb_internal_pb2
    except ImportError as e:
        raise ImportProblem(f"reading W&B runs needs wandb ({e}); {INSTALL_HINT}") from None
    return wandb_internal_pb2


def find_runs(path: str) -> list[str]:
    """The ``.wandb`` files of an offline run directory (or of a ``wandb/`` directory of several runs,
    or the file itself)."""
    p = Path(path)
    if not p.exists():
        raise ImportProblem(f"{path}: no such file or directory")
    if p.is_file():
        if p.suffix != ".wandb":
            raise ImportProblem(f"{path}: not a W&B transaction log (a run-<id>.wandb file)")
        return [str(p)]
    files, seen = [], set()
    # wandb/latest-run is a link to the newest run: each run once, by its own directory
    for f in sorted(p.glob("*.wandb")) or sorted(p.glob("*/run-*.wandb"), key=lambda f: (f.parent.is_symlink(), f)):
        if os.path.realpath(f) not in seen:
            seen.add(os.path.realpath(f))
            files.append(f)
    if not files:
        raise ImportProblem(f"{path}: not a W&B offline run directory (no run-<id>.wandb in it or in its "
                            f"offline-run-*/ subdirectories; runs are under ./wandb/ of the training job)")
    return [str(f) for f in files]


def records(path: str) -> Iterator[tuple[int, bytes]]:
    """(offset of the record's first chunk, record bytes) for every complete record of the log."""
    size = os.path.getsize(path)
    if size < _HEADER.size:
        raise ImportProblem(f"{path}: empty or truncated W&B log ({size} bytes)")
    # mapped, not read: a long run's log with media records is large, and only its chunks are copied out
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        yield from _records(path, data)


def _records(path: str, data) -> Iterator[tuple[int, bytes]]:
    ident, magic, _version = _HEADER.unpack_from(data, 0)
    if ident != _IDENT or magic != _MAGIC:
        raise ImportProblem(f"{path}: not a W&B transaction log (bad header)")
    i, n = _HEADER.size, len(data)
    parts: list[bytes] = []
    start = i
    while i + _CHUNK.size <= n:
        left = _BLOCK - i % _BLOCK
        if left < _CHUNK.size:      # the block's tail is too short for a chunk header: zero padding
            i += left
            continue
        crc, length, typ = _CHUNK.unpack_from(data, i)
        if typ == 0 and length == 0:    # preallocated zeros / padding
            i += left
            continue
        body = data[i + _CHUNK.size:i + _CHUNK.size + length]
        if typ not in _TYPE_CRC or len(body) < length or zlib.crc32(body, _TYPE_CRC[typ]) != crc:
            return                      # a torn or corrupt tail: everything before it is good
        if typ in (_FULL, _FIRST):
            start, parts = i, [body]
        elif parts:
            parts.append(body)
        i += _CHUNK.size + length
        if typ in (_FULL, _LAST) and parts:
            yield start, b"".join(parts)
            parts = []


def _item_key(item) -> str:
    return item.key or "/".join(item.nested_key)


def read_run(path: str, *, step_key: str = "auto", on_bytes: Optional[Callable[[int], None]] = None) -> SourceRun:
    """``on_bytes(n)`` is called as the log is read (for a progress bar over its size)."""
    pb = _pb()
    run_dir = Path(path).parent
    src = SourceRun(kind="wandb", path=path, name=run_dir.name, finished=False)
    done = 0
    for offset, raw in records(path):
        if on_bytes is not None:
            on_bytes(offset - done)
            done = offset
        rec = pb.Record()
        try:
            rec.ParseFromString(raw)
        except Exception:  # noqa: BLE001 - a record of a newer wandb this protobuf cannot read
            continue
        which = rec.WhichOneof("record_type")
        if which == "run":
            r = rec.run
            src.name = r.display_name or r.run_id or src.name
            src.project = r.project or None
        elif which == "exit":
            src.finished = True
        elif which == "history":
            row = {}
            for item in rec.history.item:
                try:
                    row[_item_key(item)] = json.loads(item.value_json)   # NaN / Infinity as logged
                except ValueError:
                    continue
            _add_row(src, row, rec.history.step.num, step_key)
    if on_bytes is not None:
        on_bytes(os.path.getsize(path) - done)
    return src


def _number(v):
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    return float(v)


def _add_row(src: SourceRun, row: dict, record_step: int, step_key: str) -> None:
    if step_key == "auto":
        key = next((k for k in STEP_KEYS_AUTO if _number(row.get(k)) is not None), "_step")
    else:
        key = step_key
    step = _number(row.get(key))
    if step is None and key == "_step":
        step = float(record_step)
    wall = _number(row.get("_timestamp"))
    if step is None or not math.isfinite(step) or step < 0 or wall is None or not math.isfinite(wall):
        src.skipped_points += sum(1 for k in row if k not in _META_KEYS)
        return
    for k, v in row.items():
        if k in _META_KEYS or k == key:
            continue
        x = _number(v)
        if x is None:           # media, tables, histograms, strings
            continue
        src.scalars.setdefault(k, []).append((int(step), wall, x))
