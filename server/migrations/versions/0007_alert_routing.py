"""alert routing: silences, notification groups, and why an alert was not notified

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-01

Routing (server/routing/) sits between the rule engine and the webhook outbox.
Its state lives in the database so a restarted server or another replica
carries on: ``notification_groups`` (one incident per route, with its timers)
and their members in ``notification_group_alerts`` (insert-only), and
``silences``. ``alerts`` gains three nullable columns saying why an alert was
not notified: adding a nullable column rewrites nothing on either database.
"""
from alembic import op
import sqlalchemy as sa


revision = '0007'
down_revision = '0006'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        'silences',
        sa.Column('id', sa.Integer(), primary_key=True),
        sa.Column('project_id', sa.Integer(), sa.ForeignKey('projects.id', ondelete='CASCADE'), nullable=True),
        sa.Column('matchers', sa.JSON(), nullable=False),
        sa.Column('starts_at', sa.Float(), nullable=False),
        sa.Column('ends_at', sa.Float(), nullable=False),
        sa.Column('created_by', sa.String(200), nullable=False),
        sa.Column('comment', sa.Text(), nullable=False),
        sa.Column('created_at', sa.Float(), nullable=False),
    )
    op.create_index('ix_silences_project_id', 'silences', ['project_id'], unique=False)
    op.create_index('ix_silences_ends_at', 'silences', ['ends_at'], unique=False)
    op.create_table(
        'notification_groups',
        sa.Column('id', sa.Integer(), primary_key=True),
        sa.Column('group_key', sa.String(500), nullable=False, unique=True),
        sa.Column('route', sa.String(100), nullable=False),
        sa.Column('receiver', sa.String(100), nullable=False),
        sa.Column('project_id', sa.Integer(), sa.ForeignKey('projects.id', ondelete='CASCADE'), nullable=False),
        sa.Column('run_id', sa.Integer(), sa.ForeignKey('runs.id', ondelete='CASCADE'), nullable=True),
        sa.Column('labels', sa.JSON(), nullable=False),
        sa.Column('created_at', sa.Float(), nullable=False),
        sa.Column('next_flush_at', sa.Float(), nullable=True),
        sa.Column('last_notified_at', sa.Float(), nullable=True),
        sa.Column('notified', sa.JSON(), nullable=False),
        sa.Column('notifications', sa.Integer(), nullable=False),
    )
    op.create_index('ix_notification_groups_due', 'notification_groups', ['next_flush_at'], unique=False)
    op.create_index('ix_notification_groups_project_id', 'notification_groups', ['project_id'], unique=False)
    op.create_table(
        'notification_group_alerts',
        sa.Column('group_id', sa.Integer(), sa.ForeignKey('notification_groups.id', ondelete='CASCADE'),
                  primary_key=True),
        sa.Column('alert_id', sa.Integer(), sa.ForeignKey('alerts.id', ondelete='CASCADE'), primary_key=True),
    )
    op.create_index('ix_notification_group_alerts_alert_id', 'notification_group_alerts', ['alert_id'],
                    unique=False)
    # SQLite adds the columns in place (ALTER TABLE ADD COLUMN); the foreign keys are the ORM's business there,
    # as SQLite cannot add a constraint to an existing table without rebuilding it (alerts can be large)
    pg = op.get_bind().dialect.name == "postgresql"

    def ref(table: str) -> tuple:
        return (sa.ForeignKey(f'{table}.id', ondelete='SET NULL'),) if pg else ()

    op.add_column('alerts', sa.Column('suppressed_by', sa.Integer(), *ref('alerts'), nullable=True))
    op.add_column('alerts', sa.Column('silenced_by', sa.Integer(), *ref('silences'), nullable=True))
    op.add_column('alerts', sa.Column('muted', sa.String(32), nullable=True))

def downgrade() -> None:
    with op.batch_alter_table('alerts') as batch:
        batch.drop_column('muted')
        batch.drop_column('silenced_by')
        batch.drop_column('suppressed_by')
    op.drop_index('ix_notification_group_alerts_alert_id', table_name='notification_group_alerts')
    op.drop_table('notification_group_alerts')
    op.drop_index('ix_notification_groups_project_id', table_name='notification_groups')
    op.drop_index('ix_notification_groups_due', table_name='notification_groups')
    op.drop_table('notification_groups')
    op.drop_index('ix_silences_ends_at', table_name='silences')
    op.drop_index('ix_silences_project_id', table_name='silences')
    op.drop_table('silences')
