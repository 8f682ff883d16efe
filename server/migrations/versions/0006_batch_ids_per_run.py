"""ingest_batches: batch ids are scoped to their run (primary key run_id, batch_id)

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-01

Batch ids were global: a second project (or run) that happened to reuse
another's batch id was answered ``200 duplicate: true`` and nothing of its
batch was stored. A retry is always for the same run, so the id only needs to
be unique within it. The run_id index becomes the primary key's prefix.
"""
import warnings

from alembic import op
from sqlalchemy.exc import SAWarning


def _rebuild():
    # SQLAlchemy warns that the rebuilt table's key differs from the reflected one: that is the point
    warnings.filterwarnings("ignore", message=".*specifies columns .* as primary_key=True", category=SAWarning)
    return op.batch_alter_table('ingest_batches', recreate="always")


revision = '0006'
down_revision = '0005'
branch_labels = None
depends_on = None


def upgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute("ALTER TABLE ingest_batches DROP CONSTRAINT ingest_batches_pkey")
        op.execute("ALTER TABLE ingest_batches ADD CONSTRAINT ingest_batches_pkey PRIMARY KEY (run_id, batch_id)")
        op.drop_index('ix_ingest_batches_run_id', table_name='ingest_batches')
        return
    # SQLite cannot change a primary key in place: the (small: a row per batch) table is rebuilt
    with _rebuild() as batch:
        batch.drop_index('ix_ingest_batches_run_id')
        batch.create_primary_key('ingest_batches_pkey', ['run_id', 'batch_id'])


def downgrade() -> None:
    # ids that now repeat across runs cannot all keep a global key: keep the first of each
    op.execute("DELETE FROM ingest_batches WHERE EXISTS (SELECT 1 FROM ingest_batches b WHERE b.batch_id = "
               "ingest_batches.batch_id AND b.run_id < ingest_batches.run_id)")
    if op.get_bind().dialect.name == "postgresql":
        op.execute("ALTER TABLE ingest_batches DROP CONSTRAINT ingest_batches_pkey")
        op.execute("ALTER TABLE ingest_batches ADD CONSTRAINT ingest_batches_pkey PRIMARY KEY (batch_id)")
        op.create_index('ix_ingest_batches_run_id', 'ingest_batches', ['run_id'], unique=False)
        return
    with _rebuild() as batch:
        batch.create_primary_key('ingest_batches_pkey', ['batch_id'])
        batch.create_index('ix_ingest_batches_run_id', ['run_id'], unique=False)
