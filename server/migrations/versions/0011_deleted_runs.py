"""deleted runs: runs.deleted_at and the deleted_runs tombstones

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-05

Deleting a run (server/lifecycle/delete.py) first sets ``runs.deleted_at``: from that commit on the run
is hidden from every read and ingest refuses its batches (410) while its rows are removed in bounded
batches; the ``runs`` row goes last. A tombstone in ``deleted_runs`` outlives the row: it names the run
(project and run *names*, as batches do) and the agent sessions that wrote it, so a late batch of those
sessions — a spool replayed after an outage, an agent still running — is refused instead of starting a
new, partial run under the same name. A new process (a new session) may reuse the name.
"""
from alembic import op
import sqlalchemy as sa


revision = '0011'
down_revision = '0010'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('runs') as batch:
        batch.add_column(sa.Column('deleted_at', sa.Float(), nullable=True))
    op.create_table(
        'deleted_runs',
        sa.Column('id', sa.Integer(), nullable=False),
        sa.Column('run_id', sa.Integer(), nullable=False),
        sa.Column('project', sa.String(length=200), nullable=False),
        sa.Column('run', sa.String(length=200), nullable=False),
        sa.Column('sessions', sa.JSON(), nullable=False),
        sa.Column('deleted_at', sa.Float(), nullable=False),
        sa.Column('purged_at', sa.Float(), nullable=True),
        sa.PrimaryKeyConstraint('id'),
    )
    op.create_index('ix_deleted_runs_name', 'deleted_runs', ['project', 'run'])


def downgrade() -> None:
    op.drop_index('ix_deleted_runs_name', table_name='deleted_runs')
    op.drop_table('deleted_runs')
    with op.batch_alter_table('runs') as batch:
        batch.drop_column('deleted_at')
