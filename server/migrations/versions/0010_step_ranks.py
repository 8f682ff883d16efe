"""step_ranks: how many ranks of a multi-rank run have stored each step

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-03

The batch that completes a step of a run of several ranks (its last rank arriving) combines the
ranks' partial norms and runs the cross-rank rules on it. It used to find out by counting the step's
rows in ``steps``, one index range per rank (256 at 256 ranks, every batch); now ingest keeps the count
(server/storage/ranks.py ``count_sent``). The table is filled here from the steps already stored, for the runs
of more than one rank, so a run that goes on after the upgrade completes its next steps as before.
"""
from alembic import op
import sqlalchemy as sa


revision = '0010'
down_revision = '0009'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        'step_ranks',
        sa.Column('run_id', sa.Integer(), nullable=False),
        sa.Column('step', sa.BigInteger(), nullable=False),
        sa.Column('ranks', sa.Integer(), nullable=False),
        sa.ForeignKeyConstraint(['run_id'], ['runs.id'], ondelete='CASCADE'),
        sa.PrimaryKeyConstraint('run_id', 'step'),
    )
    # the ranks 0 .. world_size - 1 (the combined row, rank -1, is not a rank), as the count was taken
    op.execute(
        "INSERT INTO step_ranks (run_id, step, ranks) "
        "SELECT steps.run_id, steps.step, COUNT(*) FROM steps JOIN runs ON runs.id = steps.run_id "
        "WHERE runs.world_size > 1 AND steps.rank >= 0 AND steps.rank < runs.world_size "
        "GROUP BY steps.run_id, steps.step")


def downgrade() -> None:
    op.drop_table('step_ranks')
