"""Rule-engine CPU per batch, in process on SQLite: this checkout against another, side by side.

    .venv/bin/python bench/rules_cpu.py --root /tmp/rules-base           # base vs this checkout
    .venv/bin/python bench/rules_cpu.py --root /tmp/rules-base --rounds 5 --batches 60

Each round runs one process per checkout (alternating which goes first), each on a fresh SQLite
file: the same stream of agent-default batches (``bench/ingest.py``'s ``make_batch``: 178 steps,
per-parameter grad norms every step, the other eight statistics every 100 steps, 150 layers) is
written with ``ingest_batch(evaluate_rules=False)`` and then, inside the same transaction,
``evaluate_batch`` is timed (thread CPU time) on it. Prints each process's median and mean
``evaluate_batch`` CPU per batch and the ratio this / other over all rounds.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import checkout  # bench/, this script's folder: runs a checkout's code as gradwatch.*

HERE = Path(__file__).resolve().parent.parent


def worker(batches: int, steps_per_batch: int) -> None:
    """Runs with the measured checkout first on sys.path (cwd); make_batch comes from this file's checkout."""
    import importlib.util
    import time
    import uuid

    spec = importlib.util.spec_from_file_location("bench_ingest", HERE / "bench" / "ingest.py")
    bench_ingest = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench_ingest)

    from gradwatch.server.storage.db import open_database, upgrade
    from gradwatch.server.ingest.write import _keys_present, _wire_step, ingest_batch
    from gradwatch.server.storage.models import Run
    from gradwatch.server.rules.engine import evaluate_batch
    from gradwatch.server.wire.schemas import IngestBatchIn
    from gradwatch.server.operations.settings import Settings

    tmp = tempfile.mkdtemp()
    db = f"sqlite:///{tmp}/rules.db"
    upgrade(db)
    database = open_database(db)
    settings = Settings(data_dir=tmp, database_url=db)
    bodies = [bench_ingest.make_batch(0, b * steps_per_batch, steps_per_batch, "default") for b in range(batches)]
    times = []
    for body in bodies:
        body["batch_id"] = uuid.uuid4().hex
        batch = IngestBatchIn.model_validate(body)
        with database.write_sessionmaker() as session:
            out = ingest_batch(session, batch=batch, settings=settings, now=time.time(), evaluate_rules=False)
            run = session.get(Run, out.run_id)
            steps = sorted(batch.steps, key=lambda s: s.step)
            wire = [_wire_step(s) for s in steps]
            events = [e.model_dump() for e in batch.events]
            t = time.thread_time()
            evaluate_batch(session, run=run, rank=0, steps=wire, events=events, settings=settings, now=time.time(),
                           present=_keys_present(steps))
            session.flush()
            times.append(time.thread_time() - t)
            session.commit()
    database.dispose()
    print(json.dumps(times[3:]))      # the first batches fill the windows and import lazily: not counted


def measure(root: Path, batches: int, steps: int) -> list[float]:
    env = dict(os.environ, **checkout.pythonpath(root))
    out = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--worker", "--batches", str(batches),
                          "--steps-per-batch", str(steps)], cwd=root, env=env, capture_output=True, text=True,
                         check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--root", required=False, help="the other checkout (e.g. `git worktree add /tmp/rules-base "
                                                   "<commit>`); without it, only this checkout is measured")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--batches", type=int, default=40)
    ap.add_argument("--steps-per-batch", type=int, default=178)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args.batches, args.steps_per_batch)
        return 0
    roots = {"this": HERE}
    if args.root:
        roots["other"] = Path(args.root).resolve()
    samples: dict[str, list[float]] = {k: [] for k in roots}
    for r in range(args.rounds):
        order = list(roots) if r % 2 == 0 else list(reversed(roots))
        for name in order:
            t = measure(roots[name], args.batches, args.steps_per_batch)
            samples[name].extend(t)
            print(f"round {r + 1} {name:5} ({roots[name]}): evaluate_batch median {statistics.median(t) * 1e3:6.2f} ms"
                  f"  mean {statistics.mean(t) * 1e3:6.2f} ms  per {args.steps_per_batch}-step batch", flush=True)
    for name, t in samples.items():
        print(f"{name:5}: median {statistics.median(t) * 1e3:6.2f} ms, mean {statistics.mean(t) * 1e3:6.2f} ms "
              f"over {len(t)} batches")
    if "other" in samples:
        ratio = statistics.median(samples["this"]) / statistics.median(samples["other"])
        print(f"this / other (medians): {ratio:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
