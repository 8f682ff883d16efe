"""steps.extra: the per-step signals declared after the first 14, stored by id

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-01

The first 14 step signals have a column each (0001). Every signal declared in
agent/signals.py after them is stored in this one blob column, at the slot its
permanent id names (server/wire/numbers.py, ``pack_extra``), so a new per-step
signal needs no migration and no rewrite of existing rows: rows written before
it have no slot for it and read as "not measured". Adding a nullable column
rewrites nothing on either database (SQLite: ALTER TABLE ADD COLUMN;
PostgreSQL: a catalogue change).
"""
from alembic import op
import sqlalchemy as sa


revision = '0005'
down_revision = '0004'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column('steps', sa.Column('extra', sa.LargeBinary(), nullable=True))
    bind = op.get_bind()
    if bind.dialect.name == "postgresql" and (bind.dialect.server_version_info or (0,)) >= (14,):
        row = bind.exec_driver_sql(
            "SELECT 1 FROM pg_settings WHERE name = 'default_toast_compression' AND 'lz4' = ANY(enumvals)").first()
        if row is not None:
            op.execute('ALTER TABLE steps ALTER COLUMN "extra" SET COMPRESSION lz4')


def downgrade() -> None:
    with op.batch_alter_table('steps') as batch:
        batch.drop_column('extra')
