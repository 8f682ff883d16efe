"""What answering a batch with its run's alerts costs the server: the write path with and without it, side by side.

    .venv/bin/python bench/loop_alerts.py                       # SQLite (temp file)
    .venv/bin/python bench/loop_alerts.py --db postgresql://postgres@127.0.0.1:5432/postgres

One process, no HTTP: each round writes a batch of the agent's default payload (``bench/ingest.py``'s
``make_batch``, 100 steps, NaNs now and then, so the run has firing alerts) through ``ingest_batch`` in
its own transaction, alternately with and without the alerts query of the ingest reply
(``server/api/ingest.py``, ``_loop_alerts``, the look-back cursor of a live agent), and times the
transaction's thread CPU. Alternating rounds see the same machine load, so the ratio is what to read.
Prints the median per-batch CPU of both, their ratio, and the query's own median cost.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
import checkout  # noqa: E402
sys.path.insert(0, str(checkout.shim(ROOT)))

from ingest import FreshDatabase, make_batch  # noqa: E402  (bench/ingest.py)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--db", help="database URL (default: a fresh SQLite file); PostgreSQL: a fresh database "
                                 "beside the one named")
    ap.add_argument("--rounds", type=int, default=60, help="batches with and as many without the query")
    ap.add_argument("--steps-per-batch", type=int, default=100)
    args = ap.parse_args()

    from gradwatch.server.api.ingest import _loop_alerts
    from gradwatch.server.storage.db import open_database, upgrade
    from gradwatch.server.ingest.write import ingest_batch
    from gradwatch.server.storage.models import Alert
    from gradwatch.server.wire.schemas import IngestBatchIn
    from sqlalchemy import func, select
    from gradwatch.server.operations.settings import Settings

    tmp = tempfile.mkdtemp(prefix="gw-loop-alerts-")
    fresh = FreshDatabase(args.db, tmp, "loop_alerts")
    try:
        upgrade(fresh.url)
        database = open_database(fresh.url)
        settings = Settings(data_dir=tmp, database_url=fresh.url)
        run = f"loop-{uuid.uuid4().hex[:6]}"
        with_query, without, query_only = [], [], []
        cursor = 0.0
        for i in range(2 * args.rounds):
            body = make_batch(0, i * args.steps_per_batch, args.steps_per_batch, "default", "f32")
            body["run"] = run
            batch = IngestBatchIn.model_validate(body)
            ask = i % 2 == 1
            with database.write_sessionmaker() as session:
                t0 = time.thread_time()
                now = time.time()
                outcome = ingest_batch(session, batch=batch, settings=settings, now=now)
                t1 = time.thread_time()
                if ask:
                    alerts, cursor = _loop_alerts(session, run_id=outcome.run_id, after=cursor, now=now)
                t2 = time.thread_time()
                session.commit()
                t3 = time.thread_time()
            if i < 4:
                continue   # warm-up: the run and its rule states are created
            (with_query if ask else without).append(t3 - t0)
            if ask:
                query_only.append(t2 - t1)
        with database.sessionmaker() as s:
            n_alerts = s.scalar(select(func.count()).select_from(Alert))
        database.dispose()
    finally:
        fresh.close()
    a, b, q = statistics.median(with_query), statistics.median(without), statistics.median(query_only)
    kind = "PostgreSQL" if args.db and not args.db.startswith("sqlite") else "SQLite"
    print(f"{kind}: {len(without)} + {len(with_query)} batches of {args.steps_per_batch} steps, "
          f"{n_alerts} alerts in the run; last reply carried {len(alerts)}")
    print(f"batch CPU, median: without the alerts query {b * 1e3:.2f} ms, with it {a * 1e3:.2f} ms "
          f"(ratio {a / b:.3f}); the query and its AlertOut models alone {q * 1e3:.3f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
