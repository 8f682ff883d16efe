"""TensorBoard event files -> :class:`SourceRun` objects, through TensorBoard's own reader.

One source run per directory holding event files (what TensorBoard shows as a
run). Each ``events.out.tfevents.*`` file of the directory is read in name
(= creation time) order with TensorBoard's ``event_file_loader``, which checks
every record's CRC and stops at a torn tail; the ``Event`` protobufs are
TensorBoard's own. Scalars are old-style ``simple_value`` summaries (what
torch's ``SummaryWriter.add_scalar`` writes) and new-style scalar-plugin
tensors; histograms, images, text and hparams are not imported.

Not ``EventAccumulator``: it keeps every value in a reservoir per tag and
migrates each old-style value to a tensor proto and back (a million-value log
takes minutes), and it reports no progress. Its one rule that changes which
values count is applied here as there: a second ``SessionLog.START`` (a
restarted TensorFlow job) drops the values logged at or after its step.
"""
from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Callable, Optional

from gradwatch.server.importers.source import ImportProblem, SourceRun
from gradwatch.server.commands.extras import pip_command

INSTALL_HINT = pip_command("import")
# bytes around each record's payload in an event file: 8 of length, 4 + 4 of CRC
_RECORD_FRAMING = 16


def _modules():
    # its INFO lines ("listing directories via walking") are noise in a CLI's output
    logging.getLogger("tensorboard").setLevel(logging.WARNING)
    try:
        from tensorboard.backend.event_processing import event_file_loader, io_wrapper
        from tensorboard.compat.proto import event_pb2
        from tensorboard.util import tensor_util
    except ImportError as e:
        raise ImportProblem(f"reading TensorBoard logs needs tensorboard ({e}); {INSTALL_HINT}") from None
    return io_wrapper, event_file_loader, event_pb2, tensor_util


def find_runs(logdir: str) -> list[str]:
    """Every directory under ``logdir`` (itself included) holding event files, sorted."""
    io_wrapper = _modules()[0]
    if not os.path.exists(logdir):
        raise ImportProblem(f"{logdir}: no such directory")
    if not os.path.isdir(logdir):
        raise ImportProblem(f"{logdir}: not a directory; give the TensorBoard log directory (--logdir of tensorboard)")
    runs = sorted(str(d) for d in io_wrapper.GetLogdirSubdirectories(logdir))
    if not runs:
        raise ImportProblem(f"{logdir}: no TensorBoard event files (events.out.tfevents.*) in it or below it")
    return runs


def run_name(run_dir: str, logdir: str) -> str:
    """The run as TensorBoard names it: its path under the log directory (the log directory's own name for
    event files directly in it)."""
    rel = os.path.relpath(run_dir, logdir)
    return Path(os.path.abspath(logdir)).name if rel == "." else rel.replace(os.sep, "/")


def event_files(run_dir: str) -> list[str]:
    io_wrapper = _modules()[0]
    return sorted(f for f in io_wrapper.ListDirectoryAbsolute(run_dir)
                  if io_wrapper.IsSummaryEventsFile(f) and os.path.isfile(f))


def read_run(run_dir: str, logdir: str, *, on_bytes: Optional[Callable[[int], None]] = None) -> SourceRun:
    """``on_bytes(n)`` is called as the files are read (for a progress bar over their total size)."""
    _, event_file_loader, event_pb2, tensor_util = _modules()
    src = SourceRun(kind="tensorboard", path=run_dir, name=run_name(run_dir, logdir))
    scalars = src.scalars
    plugin_tags: dict[str, bool] = {}      # a tensor tag -> whether it is a scalar (its first value says)
    start = event_pb2.SessionLog.START
    seen_start = False
    for path in event_files(run_dir):
        for raw in event_file_loader.RawEventFileLoader(path).Load():
            if on_bytes is not None:
                on_bytes(len(raw) + _RECORD_FRAMING)
            event = event_pb2.Event.FromString(raw)
            which = event.WhichOneof("what")
            if which == "session_log" and event.session_log.status == start:
                if seen_start:
                    _purge_from(src, event.step)
                seen_start = True
                continue
            if which != "summary":
                continue
            step, wall = int(event.step), float(event.wall_time)
            for value in event.summary.value:
                kind = value.WhichOneof("value")
                if kind == "simple_value":
                    x = float(value.simple_value)       # a float32 field: its float32 value, exactly
                elif kind == "tensor":
                    tag_is_scalar = plugin_tags.get(value.tag)
                    if tag_is_scalar is None:
                        # TensorFlow writes a tag's metadata with its first value only
                        tag_is_scalar = plugin_tags[value.tag] = value.metadata.plugin_data.plugin_name == "scalars"
                    if not tag_is_scalar:
                        continue
                    arr = tensor_util.make_ndarray(value.tensor)
                    if arr.size != 1 or arr.dtype.kind not in "fiub":
                        src.skipped_points += 1
                        continue
                    x = float(arr.reshape(()))
                else:                                   # histograms, images, audio
                    continue
                if step < 0:
                    src.skipped_points += 1
                    continue
                scalars.setdefault(value.tag, []).append((step, wall, x))
    return src


def _purge_from(src: SourceRun, step: int) -> None:
    """A restarted job's START: what the crashed attempt logged at or after ``step`` was orphaned."""
    for tag, points in list(src.scalars.items()):
        kept = [p for p in points if p[0] < step]
        if kept:
            src.scalars[tag] = kept
        else:
            del src.scalars[tag]
