"""Which tables hold a run's rows, and a project's: read from the SQLAlchemy metadata (server/storage/models.py).

Not listed by hand: a table added later is covered without touching this module (see server/lifecycle/delete.py's docstring
for the rules). Both the purge (delete.py) and the size estimates (sizes.py) walk this list; it lives in a
leaf of its own so that those two do not import each other.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from sqlalchemy import Table

from gradwatch.server.storage.models import Base, Run

# tables with a run_id column that a delete keeps: the tombstones are the record of the delete
KEPT_TABLES = ("deleted_runs",)


@dataclass(frozen=True)
class Owned:
    """A table holding rows of a run: directly (``via`` None) or through a key into a direct table."""

    table: Table
    column: str                         # run_id, or the key column pointing at ``via``
    via: Optional[Table] = None         # the direct table the key points at
    via_column: str = "id"
    set_null: bool = False              # ON DELETE SET NULL: the key is cleared, the row stays


def owned_where(owned: "Owned", key: str, param: str) -> str:
    """The WHERE clause that selects ``owned``'s rows of one run or project: ``key`` (``run_id`` /
    ``project_id``) = ``:param``, on the table itself or on the table its rows hang off."""
    t = owned.table.name
    if owned.via is None:
        return f"{t}.{key} = :{param}"
    v = owned.via.name
    return f"{t}.{owned.column} IN (SELECT {v}.{owned.via_column} FROM {v} WHERE {v}.{key} = :{param})"


def owned_tables(metadata=Base.metadata) -> list[Owned]:
    """Every table holding a run's rows, children before parents (the order a purge empties them)."""
    direct = [t for t in metadata.sorted_tables
              if "run_id" in t.c and t.name != Run.__tablename__ and t.name not in KEPT_TABLES]
    direct_names = {t.name for t in direct}
    children: list[Owned] = []
    for t in metadata.sorted_tables:
        for fk in t.foreign_keys:
            parent = fk.column.table
            if parent.name in direct_names:
                children.append(Owned(t, fk.parent.name, parent, fk.column.name,
                                       set_null=(fk.ondelete or "").upper() == "SET NULL"))
    # webhook_deliveries.group_id names a notification group without a foreign key (migration 0009)
    tables = metadata.tables
    if "webhook_deliveries" in tables and "notification_groups" in tables \
            and "group_id" in tables["webhook_deliveries"].c:
        children.append(Owned(tables["webhook_deliveries"], "group_id", tables["notification_groups"], "id"))
    # children first; among the direct tables, the ones others point at (alerts, groups) after the rest
    pointed_at = {c.via.name for c in children}
    direct.sort(key=lambda t: t.name in pointed_at)
    return children + [Owned(t, "run_id") for t in direct]


def project_tables(metadata=Base.metadata) -> list[Owned]:
    """Tables holding a project's own rows (tokens, silences, rule overrides, webhook endpoints, groups)
    and the keys into them, children first; the runs are deleted before these."""
    direct = [t for t in metadata.sorted_tables if "project_id" in t.c and t.name != Run.__tablename__]
    names = {t.name for t in direct}
    children = []
    for t in metadata.sorted_tables:
        for fk in t.foreign_keys:
            if fk.column.table.name in names and t.name != Run.__tablename__:
                children.append(Owned(t, fk.parent.name, fk.column.table, fk.column.name,
                                       set_null=(fk.ondelete or "").upper() == "SET NULL"))
    tables = metadata.tables
    if "webhook_deliveries" in tables and "group_id" in tables["webhook_deliveries"].c:
        children.append(Owned(tables["webhook_deliveries"], "group_id", tables["notification_groups"], "id"))
    return children + [Owned(t, "project_id") for t in direct]
