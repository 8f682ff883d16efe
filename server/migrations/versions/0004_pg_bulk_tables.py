"""PostgreSQL: no per-row foreign-key checks and lz4 TOAST compression on the bulk tables and rule states

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-29

Why (measured with bench/ingest.py's per-table COPY timing, 178-step batches,
docs/performance.md "PostgreSQL write path"): every row COPYed into a table
with a foreign key fires a referential-integrity trigger (a lookup and a KEY
SHARE lock on the run row), 432 per batch at agent defaults; and the layer
rollup partials (~3.6 KB, over the 2 KB TOAST threshold) were compressed with
pglz, PostgreSQL's slow default.

Safe without the foreign keys: these rows are only written by ingest, inside a
transaction that holds the run's row lock (SELECT … FOR UPDATE), so the run
exists and cannot go away meanwhile; nothing deletes runs. Code that ever
deletes runs must delete these tables' rows itself (docs/architecture.md).
The models keep the ForeignKey declarations (SQLite keeps its constraints:
rebuilding its big tables in a migration would take minutes, and its checks
are cheap index probes in-process).
"""
from alembic import op


revision = '0004'
down_revision = '0003'
branch_labels = None
depends_on = None

BULK_TABLES = ("steps", "custom_scalars", "layer_stats", "step_rollups", "layer_rollups")
# The rule states too: ~80 KB of JSON rewritten by every batch of a run at agent defaults
# (E1 and E2 keep per-layer baselines, ~30 KB each), over the TOAST threshold.
BLOB_COLUMNS = (("layer_stats", "values"), ("layer_rollups", "data"), ("step_rollups", "data"),
                ("rule_states", "state"))


def _lz4_available(bind) -> bool:
    if (bind.dialect.server_version_info or (0,)) < (14,):
        return False
    row = bind.exec_driver_sql(
        "SELECT 1 FROM pg_settings WHERE name = 'default_toast_compression' AND 'lz4' = ANY(enumvals)").first()
    return row is not None


def upgrade() -> None:
    bind = op.get_bind()
    if bind.dialect.name != "postgresql":
        return
    for table in BULK_TABLES:
        op.execute(f'ALTER TABLE {table} DROP CONSTRAINT IF EXISTS {table}_run_id_fkey')
    if _lz4_available(bind):
        for table, column in BLOB_COLUMNS:
            op.execute(f'ALTER TABLE {table} ALTER COLUMN "{column}" SET COMPRESSION lz4')


def downgrade() -> None:
    bind = op.get_bind()
    if bind.dialect.name != "postgresql":
        return
    if _lz4_available(bind):
        for table, column in BLOB_COLUMNS:
            op.execute(f'ALTER TABLE {table} ALTER COLUMN "{column}" SET COMPRESSION pglz')
    for table in BULK_TABLES:
        op.execute(f'ALTER TABLE {table} ADD CONSTRAINT {table}_run_id_fkey '
                   f'FOREIGN KEY (run_id) REFERENCES runs (id) ON DELETE CASCADE')
