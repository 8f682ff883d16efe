"""Migration 0004: PostgreSQL's bulk tables lose their per-row foreign-key checks and compress
with lz4; SQLite keeps its schema. Upgrade, downgrade and upgrade again on a real database."""
from __future__ import annotations

from alembic import command
from sqlalchemy import create_engine, inspect, text

from gradwatch.server.storage.db import alembic_config, upgrade

BULK = ("steps", "custom_scalars", "layer_stats", "step_rollups", "layer_rollups")


def _fk_tables(url: str) -> set[str]:
    engine = create_engine(url)
    try:
        insp = inspect(engine)
        return {t for t in insp.get_table_names()
                if any(fk["referred_table"] == "runs" for fk in insp.get_foreign_keys(t))}
    finally:
        engine.dispose()


def test_bulk_tables_of_postgresql_carry_no_foreign_key_and_sqlite_keeps_them(db_url):
    upgrade(db_url)
    with_fk = _fk_tables(db_url)
    if db_url.startswith("sqlite"):
        assert set(BULK) <= with_fk
        return
    assert not set(BULK) & with_fk, with_fk
    assert {"alerts", "rule_states", "ingest_batches", "run_events"} <= with_fk   # small tables keep theirs
    engine = create_engine(db_url)
    try:
        with engine.connect() as conn:
            lz4 = conn.execute(text("SELECT 'lz4' = ANY(enumvals) FROM pg_settings "
                                    "WHERE name = 'default_toast_compression'")).scalar()
            methods = dict(conn.execute(text(
                "SELECT c.relname, a.attcompression FROM pg_attribute a JOIN pg_class c ON c.oid = a.attrelid "
                "WHERE (c.relname, a.attname) IN (('layer_stats', 'values'), ('layer_rollups', 'data'), "
                "('rule_states', 'state'))")).all())
    finally:
        engine.dispose()
    if lz4:
        assert methods == {"layer_stats": "l", "layer_rollups": "l", "rule_states": "l"}, methods

    command.downgrade(alembic_config(db_url), "0003")
    assert set(BULK) <= _fk_tables(db_url)
    upgrade(db_url)
    assert not set(BULK) & _fk_tables(db_url)
