"""``step_ranks``: the count of ranks that stored each step of a multi-rank run, kept by ingest
(server/storage/ranks.py ``count_sent``), equal to the count of the steps' rows it replaced, and filled from the
stored steps by migration 0010. Real databases, both backends."""
from __future__ import annotations

import time

from alembic import command
from gw_payloads import batch, step
from sqlalchemy import create_engine, text

from gradwatch.server.storage.db import alembic_config, open_database, upgrade
from gradwatch.server.ingest.write import ingest_batch
from gradwatch.server.storage.ranks import steps_sent
from gradwatch.server.wire.schemas import IngestBatchIn
from gradwatch.server.operations.settings import Settings


def _counts(url: str) -> dict[tuple[int, int], int]:
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            return {(r, s): n for r, s, n in conn.execute(text("SELECT run_id, step, ranks FROM step_ranks"))}
    finally:
        engine.dispose()


def _send(database, settings, *, rank: int, steps: list[int], world: int = 3, run: str = "ranks"):
    body = batch([step(i) for i in steps], run=run, rank=rank, world_size=world)
    with database.write_sessionmaker() as s:
        out = ingest_batch(s, batch=IngestBatchIn.model_validate(body), settings=settings, now=time.time())
        s.commit()
    return out


def test_the_kept_count_equals_the_count_of_the_stored_rows_and_a_step_sent_again_is_not_counted_twice(
        db_url, tmp_path):
    upgrade(db_url)
    database = open_database(db_url)
    settings = Settings(database_url=db_url, data_dir=tmp_path)
    try:
        _send(database, settings, rank=0, steps=[0, 1, 2, 3])
        _send(database, settings, rank=2, steps=[0, 1])
        _send(database, settings, rank=1, steps=[1, 2])
        _send(database, settings, rank=1, steps=[2, 3, 3])     # step 2 again (stored), 3 twice in the batch
        _send(database, settings, rank=0, steps=[0], run="single", world=1)   # one rank: nothing counted
        counts = _counts(db_url)
        with database.sessionmaker() as s:
            run_id = s.execute(text("SELECT id FROM runs WHERE name = 'ranks'")).scalar_one()
            rows = steps_sent(s, run_id=run_id, world_size=3, lo=0, hi=3)
        assert counts == {(run_id, k): n for k, n in rows.items()}, (counts, rows)
        assert rows == {0: 2, 1: 3, 2: 2, 3: 2}
    finally:
        database.dispose()


def test_migration_0010_fills_the_counts_from_the_steps_stored_before_it(db_url, tmp_path):
    command.upgrade(alembic_config(db_url), "0009")
    engine = create_engine(db_url)
    now = time.time()
    try:
        with engine.begin() as conn:
            project = conn.execute(text("INSERT INTO projects (name, created_at) VALUES ('p', :t) RETURNING id"),
                                   {"t": now}).scalar_one()
            runs = {}
            for name, world in (("two", 2), ("one", 1)):
                runs[name] = conn.execute(text(
                    "INSERT INTO runs (project_id, name, status, started_at, last_seen, world_size, param_names, "
                    "module_names, bn_names, config, last_loss_nan) VALUES (:p, :n, 'running', :t, :t, :w, '[]', "
                    "'[]', '[]', '{}', false) RETURNING id"), {"p": project, "n": name, "t": now, "w": world}).scalar_one()
            # ranks 0 and 1 of "two" (rank 1 one step behind), its combined row (rank -1) at step 0, "one"
            rows = [(runs["two"], 0, s) for s in range(4)] + [(runs["two"], 1, s) for s in range(3)]
            rows += [(runs["two"], -1, 0), (runs["one"], 0, 0), (runs["one"], 0, 1)]
            for run_id, rank, s in rows:
                conn.execute(text("INSERT INTO steps (run_id, rank, step, time, nan_mask) VALUES (:r, :k, :s, :t, 0)"),
                             {"r": run_id, "k": rank, "s": s, "t": now})
    finally:
        engine.dispose()
    upgrade(db_url)
    assert _counts(db_url) == {(runs["two"], 0): 2, (runs["two"], 1): 2, (runs["two"], 2): 2, (runs["two"], 3): 1}

    # the run goes on after the upgrade: rank 1's step 3 completes it (count 2 of 2)
    database = open_database(db_url)
    try:
        body = batch([step(3)], run="two", project="p", rank=1, world_size=2)
        with database.write_sessionmaker() as s:
            ingest_batch(s, batch=IngestBatchIn.model_validate(body), settings=Settings(database_url=db_url,
                                                                                        data_dir=tmp_path), now=now)
            s.commit()
    finally:
        database.dispose()
    assert _counts(db_url)[(runs["two"], 3)] == 2
