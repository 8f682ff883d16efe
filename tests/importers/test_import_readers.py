"""The pieces under ``gradwatch import``: the W&B log framing, the tag map, the wire steps, the progress bar."""
from __future__ import annotations

import doctest
import math
import shutil
import struct

import pytest

from gradwatch.server.importers import progress, source, tagmap, wandb_reader
from gradwatch.server.importers.source import ImportProblem, SourceRun, batches, prepare
from gradwatch.server.importers.tagmap import DEFAULT_TAGS, MapError, TagMap
from tests.importers.series import STEPS
from tests.importers.import_helpers import wandb_run_dir, write_logs


@pytest.fixture(scope="module")
def wandb_log(tmp_path_factory):
    root = tmp_path_factory.mktemp("wb")
    run_dir = wandb_run_dir(write_logs("wandb", root / "wb"))
    (log,) = run_dir.glob("run-*.wandb")
    return log


def chunk_types(data: bytes) -> dict[int, int]:
    i, seen = 7, {}
    while i + 7 <= len(data):
        left = 32768 - i % 32768
        if left < 7:
            i += left
            continue
        _, n, t = struct.unpack_from("<IHB", data, i)
        if t == 0 and n == 0:
            i += left
            continue
        seen[t] = seen.get(t, 0) + 1
        i += 7 + n
    return seen


def test_the_wandb_log_is_read_whole_across_blocks(wandb_log):
    data = wandb_log.read_bytes()
    assert len(data) > 3 * 32768 and chunk_types(data).get(2), "the run must have records split over blocks"
    run = wandb_reader.read_run(str(wandb_log))
    assert run.name == "wb-run" and run.project == "wb-project" and run.finished
    assert len(run.scalars["train/loss"]) == STEPS
    assert [s for s, _, _ in run.scalars["train/loss"]] == list(range(STEPS))


def test_a_torn_wandb_log_gives_the_records_before_the_tear(wandb_log, tmp_path):
    whole = list(wandb_reader.records(str(wandb_log)))
    torn = tmp_path / "run-torn.wandb"
    cut = whole[len(whole) // 2][0] + 5          # inside a record's chunk header
    torn.write_bytes(wandb_log.read_bytes()[:cut])
    got = list(wandb_reader.records(str(torn)))
    assert got == whole[:len(whole) // 2]
    flipped = bytearray(wandb_log.read_bytes())
    flipped[whole[10][0] + 9] ^= 0xFF               # a corrupt byte: the CRC stops the read there
    bad = tmp_path / "run-bad.wandb"
    bad.write_bytes(bytes(flipped))
    assert list(wandb_reader.records(str(bad))) == whole[:10]
    run = wandb_reader.read_run(str(torn))
    assert not run.finished                         # no exit record: the job died
    last = batches(prepare(run, TagMap.build()), project="p", run_name="r")[-1]
    assert last["status"] == "crashed"              # never "running": it would read as stalled (F2)


def test_not_a_wandb_log_is_said(tmp_path):
    f = tmp_path / "run-x.wandb"
    f.write_bytes(b"hello world, not a log")
    with pytest.raises(ImportProblem, match="not a W&B transaction log"):
        list(wandb_reader.records(str(f)))
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(ImportProblem, match="not a W&B transaction log"):
        wandb_reader.find_runs(str(tmp_path / "notes.txt"))


def test_each_wandb_run_is_found_once_through_the_latest_run_link(wandb_log, tmp_path):
    wandb_dir = tmp_path / "wandb"
    shutil.copytree(wandb_log.parent, wandb_dir / wandb_log.parent.name)
    (wandb_dir / "latest-run").symlink_to(wandb_dir / wandb_log.parent.name)
    found = wandb_reader.find_runs(str(wandb_dir))
    assert len(found) == 1 and "latest-run" not in found[0]


def test_default_tags_name_known_signals_and_overrides_win():
    from gradwatch.agent.signals import is_step_signal

    assert all(is_step_signal(s) for s in DEFAULT_TAGS.values())
    m = TagMap.build()
    # Lightning's LearningRateMonitor names
    assert m.signal("lr-AdamW") == "lr" and m.signal("lr-Adam/pg1") == "lr" and m.signal("lr-Adam/pg2") is None
    mapped, left = m.resolve(["loss", "train/loss", "train/epoch", "eval/loss"])
    assert mapped == {"loss": "loss"} and left == ["eval/loss", "train/epoch", "train/loss"]
    mapped, left = TagMap.build(["train/loss=loss"]).resolve(["loss", "train/loss"])
    assert mapped == {"train/loss": "loss"} and left == ["loss"]
    mapped, _ = TagMap.build(["eval/ppl=loss", "loss="]).resolve(["loss", "eval/ppl"])
    assert mapped == {"eval/ppl": "loss"}
    for bad in ("loss", "=loss", "x=nope"):
        with pytest.raises(MapError):
            TagMap.build([bad])


def test_wire_steps_keep_non_finite_floats_and_batch_ids_are_the_source_and_place():
    run = SourceRun(kind="tensorboard", path="/logs/a", name="a", scalars={
        "loss": [(0, 10.0, 1.5), (1, 11.0, math.nan), (1, 12.0, math.inf), (2, 13.0, -math.inf)],
        "lr": [(0, 10.5, 0.1)],
    })
    tm = TagMap.build(["x=overflow_count"])
    run.scalars["x"] = [(0, 10.0, 3.0), (1, 11.0, math.nan)]
    p = prepare(run, tm)
    assert p.steps == [{"step": 0, "time": 10.5, "loss": 1.5, "lr": 0.1, "overflow_count": 3},
                       {"step": 1, "time": 12.0, "loss": "Infinity"},     # the last value logged at a step
                       {"step": 2, "time": 13.0, "loss": "-Infinity"}]
    assert p.dropped == {"overflow_count": 1}
    one = batches(p, project="p", run_name="r", batch_steps=2)
    two = batches(prepare(run, tm), project="p", run_name="r", batch_steps=2)
    assert [b["batch_id"] for b in one] == [b["batch_id"] for b in two]
    assert len({b["batch_id"] for b in one}) == 2 and one[-1]["status"] == "finished" and "meta" in one[0]
    other = SourceRun(kind="tensorboard", path="/logs/b", name="a", scalars=run.scalars)
    assert batches(prepare(other, tm), project="p", run_name="r")[0]["batch_id"] != one[0]["batch_id"]


@pytest.mark.parametrize("module", [progress, source, tagmap])
def test_docstring_examples(module):
    failures, _ = doctest.testmod(module, raise_on_error=False)
    assert failures == 0


def test_tensorboard_new_style_scalars_restarts_and_a_torn_tail(tmp_path):
    """Scalar-plugin tensors read like simple values; a restarted TensorFlow job's second SessionLog.START
    drops what the crashed attempt logged from that step on (as TensorBoard does); a file cut mid-record
    gives the records before the cut; histograms are not scalars."""
    import numpy as np
    from tensorboard.compat.proto import event_pb2
    from tensorboard.summary.writer.event_file_writer import EventFileWriter
    from torch.utils.tensorboard import SummaryWriter

    from gradwatch.server.importers import tensorboard_reader

    run = tmp_path / "logs" / "exp" / "seed1"
    w = SummaryWriter(str(run))
    for i in range(10):
        w.add_scalar("train/loss", 1.0 / (i + 1), i, new_style=True)
        w.add_scalar("lr", 0.5, i)
        w.add_histogram("weights", np.arange(5.0) + i, i)
    w.close()
    # the job restarts from its step-6 checkpoint: TensorFlow's supervisor writes SessionLog.START
    restart = EventFileWriter(str(run), filename_suffix=".restart")
    for step in (0, 6):
        restart.add_event(event_pb2.Event(step=step, wall_time=2e9, session_log=event_pb2.SessionLog(
            status=event_pb2.SessionLog.START)))
    restart.close()
    (extra,) = [f for f in run.iterdir() if f.name.endswith(".restart")]
    extra.rename(run / ("events.out.tfevents.9999999999.host.1.restart"))    # sorts after the first file

    assert tensorboard_reader.find_runs(str(tmp_path / "logs")) == [str(run)]
    assert tensorboard_reader.run_name(str(run), str(tmp_path / "logs")) == "exp/seed1"
    seen = []
    src = tensorboard_reader.read_run(str(run), str(tmp_path / "logs"), on_bytes=seen.append)
    assert sorted(src.scalars) == ["lr", "train/loss"]                 # no histogram
    assert [(s, v) for s, _, v in src.scalars["train/loss"]] == [(i, float(np.float32(1.0 / (i + 1))))
                                                                  for i in range(6)]
    assert [s for s, _, _ in src.scalars["lr"]] == list(range(6))
    assert sum(seen) == sum(f.stat().st_size for f in run.iterdir())   # the progress bar reaches the end

    (first,) = [f for f in run.iterdir() if not f.name.endswith(".restart")]
    data = first.read_bytes()
    first.write_bytes(data[:len(data) * 2 // 3])                    # a job killed mid-write
    (extra_now,) = [f for f in run.iterdir() if f.name.endswith(".restart")]
    extra_now.unlink()
    torn = tensorboard_reader.read_run(str(run), str(tmp_path / "logs"))
    n = len(torn.scalars["train/loss"])
    assert 0 < n < 10 and [s for s, _, _ in torn.scalars["train/loss"]] == list(range(n))
