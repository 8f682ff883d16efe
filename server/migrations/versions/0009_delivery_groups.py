"""webhook_deliveries.group_id: the notification group a delivery belongs to

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-01

A group's group_interval and repeat_interval count from when its last notification was
delivered (Alertmanager writes its notification log after a successful send), not from when
the notification was written to the outbox inside a batch's transaction: the delivery
worker reads the group of each delivery it records. A nullable column, added empty: a
delivery written without routing (or before this revision) has no group; nothing existing
is rewritten on either database.
"""
from alembic import op
import sqlalchemy as sa


revision = '0009'
down_revision = '0008'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('webhook_deliveries') as batch:
        batch.add_column(sa.Column('group_id', sa.Integer(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('webhook_deliveries') as batch:
        batch.drop_column('group_id')
