"""``gradwatch import tensorboard LOGDIR`` / ``gradwatch import wandb RUN_DIR``: existing runs into gradwatch.

Reads the loggers' files with their own readers, maps the scalars that
gradwatch knows (loss, grad norm, LR, loss scale …) to its signals, writes
them through the server's ingest path (a database with ``--db``, or a running
server with ``--server``), which runs the rule engine over them, and prints
per run what was imported and the alerts gradwatch would have raised.
docs/import.md has the tag map and examples.

Only the standard library is imported at module level: ``gradwatch --help``
must start on an install that has neither the server extra nor the loggers;
the readers and the ingest code are imported when an import runs, and a
missing one is a one-line message naming the extra to install.
"""
from __future__ import annotations

import os
import sys

EXIT_FAILED, EXIT_USAGE = 1, 2


def add_subparser(subparsers) -> None:
    p = subparsers.add_parser(
        "import", help="import TensorBoard or W&B offline runs and show the alerts gradwatch would have raised",
        description="Turn existing runs' scalars (loss, grad norm, LR, loss scale where logged) into gradwatch runs, "
                    "run the rule engine over them and list the alerts it raises. Writes to a database "
                    "(--db, default: as for serve) or a running server (--server). docs/import.md.")
    sub = p.add_subparsers(dest="import_source", required=True, metavar="{tensorboard,wandb}")
    tb = sub.add_parser("tensorboard", help="a TensorBoard log directory (one gradwatch run per directory "
                                            "holding event files)",
                        epilog="Example: gradwatch import tensorboard runs/ --project vision "
                               "--map train/ce=loss --server http://127.0.0.1:8470")
    tb.add_argument("logdir", metavar="LOGDIR", help="the directory given to SummaryWriter / tensorboard --logdir")
    _common(tb)
    tb.set_defaults(func=run_tensorboard)
    wb = sub.add_parser("wandb", help="a W&B offline run directory (wandb/offline-run-*), or wandb/ holding several",
                        epilog="Example: WANDB_MODE=offline python train.py; "
                               "gradwatch import wandb wandb/offline-run-20250101_120000-abc123")
    wb.add_argument("path", metavar="OFFLINE_RUN_DIR",
                    help="an offline run directory, a directory of them, or a run-<id>.wandb file")
    wb.add_argument("--step-key", default="auto", metavar="KEY",
                    help="the logged key that is the optimizer step (default auto: train/global_step or "
                         "trainer/global_step when logged, else W&B's _step)")
    _common(wb)
    wb.set_defaults(func=run_wandb)


def _common(p) -> None:
    p.add_argument("--project", help="gradwatch project (default: the W&B run's project, else 'default')")
    p.add_argument("--run", dest="run_name", metavar="NAME",
                   help="gradwatch run name (default: the source run's name; with several source runs, "
                        "NAME/<source run name>)")
    p.add_argument("--map", action="append", default=[], metavar="TAG=SIGNAL",
                   help="map a logged tag to a gradwatch signal, over the defaults (repeatable; TAG= leaves it out)")
    dest = p.add_mutually_exclusive_group()
    dest.add_argument("--db", metavar="URL", help="database URL (default: GRADWATCH_DATABASE_URL or the SQLite file "
                                                  "`gradwatch serve` uses)")
    dest.add_argument("--server", metavar="URL", help="send to a running server's ingest API instead")
    p.add_argument("--token", help="API token for --server when auth is on (default: $GRADWATCH_TOKEN)")


def _eprint(*args) -> None:
    print(*args, file=sys.stderr, flush=True)


def run_tensorboard(args) -> int:
    def sources():
        from gradwatch.server.importers import tensorboard_reader as tb

        return [(tb.run_name(d, args.logdir), sum(os.path.getsize(f) for f in tb.event_files(d)),
                 lambda on_bytes, d=d: tb.read_run(d, args.logdir, on_bytes=on_bytes))
                for d in tb.find_runs(args.logdir)]
    return _run(args, sources)


def run_wandb(args) -> int:
    def sources():
        from gradwatch.server.importers import wandb_reader

        wandb_reader.check_installed()     # the install hint before anything else when wandb is missing
        return [(os.path.basename(os.path.dirname(os.path.abspath(f))), os.path.getsize(f),
                 lambda on_bytes, f=f: wandb_reader.read_run(f, step_key=args.step_key, on_bytes=on_bytes))
                for f in wandb_reader.find_runs(args.path)]
    return _run(args, sources)


def _run(args, sources) -> int:
    from gradwatch.server.importers.source import ImportProblem
    from gradwatch.server.importers.tagmap import MapError, TagMap

    try:
        tagmap = TagMap.build(args.map)
    except MapError as e:
        _eprint(f"gradwatch import: {e}")
        return EXIT_USAGE
    try:
        found = sources()
        sink = _open_sink(args)
    except ImportProblem as e:
        _eprint(f"gradwatch import: {e}")
        return EXIT_FAILED
    from gradwatch.server.importers.progress import Progress

    imported_any = False
    try:
        for label, size, read in found:
            # reading is most of a long import (TensorBoard's loader: about 50,000 values a second)
            bar = Progress(size, f"reading {label}", unit="MB", scale=1e-6)
            try:
                src = read(bar.update)
                bar.done()
                imported_any |= _import_one(args, src, tagmap, sink, several=len(found) > 1)
            except ImportProblem as e:
                _eprint(f"gradwatch import: {label}: {e}")
                return EXIT_FAILED
    finally:
        sink.close()
    return 0 if imported_any else EXIT_FAILED


def _open_sink(args):
    from gradwatch.server.importers.sinks import DatabaseSink, HttpSink

    if args.server:
        return HttpSink(args.server, token=args.token or os.environ.get("GRADWATCH_TOKEN") or None)
    return DatabaseSink(args.db)


def _import_one(args, src, tagmap, sink, *, several: bool) -> bool:
    from gradwatch.server.importers.progress import Progress
    from gradwatch.server.importers.source import batches, prepare

    prepared = prepare(src, tagmap)
    project = args.project or src.project or "default"
    name = src.name if not args.run_name else (f"{args.run_name}/{src.name}" if several else args.run_name)
    where = f"{src.kind} {src.path}"
    if not prepared.steps:
        tags = ", ".join(sorted(src.scalars)) or "none"
        _eprint(f"gradwatch import: {where}: no scalar maps to a gradwatch signal (tags: {tags}); "
                f"add --map TAG=SIGNAL (docs/import.md)")
        return False
    existing = sink.find_run(project, name)
    after = existing.last_step if existing is not None else None
    bodies = batches(prepared, project=project, run_name=name, after=after)
    total = sum(len(b["steps"]) for b in bodies)
    held = len(prepared.steps) - total          # already in the run (an earlier import of this source)
    bar = Progress(total, f"writing {name}")
    fresh = 0
    run_id = existing.id if existing is not None else None
    for body in bodies:
        sent = sink.send(body)
        run_id = sent.run_id
        if sent.duplicate:                      # another import of the same source got there first
            held += len(body["steps"])
        else:
            fresh += len(body["steps"])
        bar.update(len(body["steps"]))
    bar.done()
    alerts = sink.alerts(run_id)

    out = sys.stdout
    print(f"run {project}/{name} (id {run_id}) from {where}", file=out)
    again = f", {held} already in the run" if held else ""
    print(f"  steps imported: {fresh}{again}", file=out)
    print("  signals mapped: " + ", ".join(f"{sig} <- {tag}" for tag, sig in prepared.mapped.items()), file=out)
    if prepared.left_out:
        print("  left out: " + ", ".join(prepared.left_out), file=out)
    for sig, n in sorted(prepared.dropped.items()):
        print(f"  dropped: {n} {sig} values it cannot hold (non-finite, or a negative count)", file=out)
    if src.skipped_points:
        print(f"  skipped: {src.skipped_points} values that are not scalars or have no usable step", file=out)
    print(f"  alerts: {len(alerts)}", file=out)
    for a in alerts:
        print(f"    {a.rule:<4} {a.severity:<8} step {a.step:<8} {a.name}: {a.title}", file=out)
    url = sink.run_url(run_id)
    if url:
        print(f"  dashboard: {url}", file=out)
    out.flush()
    return True
