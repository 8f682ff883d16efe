"""rank_layouts: which piece of each parameter a rank of a sharded run holds

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-01

FSDP / DTensor ranks each hold a piece of every sharded parameter, so the norms
a rank measures are of its pieces only. Each such rank sends its layout once
(``meta.param_shards``); the server keeps it per (run, rank) and combines the
ranks' per-piece norms into the full parameters' and the global grad norm
(server/storage/ranks.py). A small table (a row per rank), created empty: nothing
existing is rewritten on either database.
"""
from alembic import op
import sqlalchemy as sa


revision = '0008'
down_revision = '0007'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        'rank_layouts',
        sa.Column('run_id', sa.Integer(), nullable=False),
        sa.Column('rank', sa.Integer(), nullable=False),
        sa.Column('world_size', sa.Integer(), nullable=False),
        sa.Column('shards', sa.JSON(), nullable=False),
        sa.Column('updated_at', sa.Float(), nullable=False),
        sa.ForeignKeyConstraint(['run_id'], ['runs.id'], ondelete='CASCADE'),
        sa.PrimaryKeyConstraint('run_id', 'rank'),
    )


def downgrade() -> None:
    op.drop_table('rank_layouts')
