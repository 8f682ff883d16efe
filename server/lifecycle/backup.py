"""Backing up and restoring a gradwatch database (``gradwatch backup`` / ``gradwatch restore``).

- **SQLite**: Python's ``sqlite3.Connection.backup`` (SQLite's online backup API) copies every page in one
  step, inside one read transaction: a consistent snapshot taken while the server keeps ingesting (in WAL
  mode a reader blocks no writer; a stepped copy would restart each time ingest wrote). Restore copies the
  backup into a new file the same way.
- **PostgreSQL**: ``pg_dump --format=custom`` (a consistent snapshot too: one repeatable-read transaction)
  and ``pg_restore --no-owner --exit-on-error`` into an empty database.

A restored database may be at an older schema revision than the server: ``gradwatch serve --migrate``
upgrades it (docs/deployment.md, "Backup and restore").

Restore vets its input before it writes anything (``BackupRefused``, one line saying why): a file that
is not a SQLite database or a pg_dump archive, one that fails SQLite's ``quick_check`` or cannot be
listed by ``pg_restore``, one without gradwatch's ``alembic_version``, and one holding any schema
object gradwatch's migrations do not create (a trigger, a view, a function, a table of its own) is
refused. Only then is a SQLite backup copied, into a temporary file beside the target that is renamed
into place once complete (a failed restore leaves no file behind: a later ``serve`` would have started
on it as an empty database); a PostgreSQL archive is restored in one transaction
(``pg_restore --single-transaction``).
"""
from __future__ import annotations

import os
import re
import shutil
import sqlite3
import subprocess
import tempfile
import time
import uuid
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

SQLITE_MAGIC = b"SQLite format 3\x00"
PGDUMP_MAGIC = b"PGDMP"


class BackupRefused(ValueError):
    """A backup restore will not use; the message says what is wrong with it. Nothing was written."""


@dataclass(frozen=True)
class BackupInfo:
    source: str        # the database (SQLite path, or PostgreSQL URL without password)
    path: str          # the backup file
    bytes: int
    seconds: float


def _sqlite_path(url: str) -> Path:
    if not url.startswith("sqlite:///"):
        raise ValueError(f"not a SQLite file URL: {url}")
    return Path(url.split("///", 1)[1])


def _libpq_url(url: str) -> str:
    """postgresql+psycopg://... -> postgresql://... (what pg_dump / pg_restore take)."""
    for prefix in ("postgresql+psycopg://", "postgresql+psycopg2://", "postgres://"):
        if url.startswith(prefix):
            return "postgresql://" + url[len(prefix):]
    return url


def _safe(url: str) -> str:
    from sqlalchemy.engine import make_url

    return make_url(url).render_as_string(hide_password=True)


def _tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        raise RuntimeError(f"{name} not found: install the PostgreSQL client tools (Debian: postgresql-client) "
                           f"of the server's major version or newer")
    return path


def backup(url: str, out: str | Path) -> BackupInfo:
    """Copy the database at ``url`` to the new file ``out`` (refused if it exists)."""
    out = Path(out)
    if out.exists():
        raise FileExistsError(f"{out} exists: back up to a new file")
    started = time.perf_counter()
    if url.startswith("sqlite"):
        src_path = _sqlite_path(url)
        if not src_path.exists():
            raise ValueError(f"no database at {src_path}")
        src = sqlite3.connect(src_path, timeout=30)
        dst = sqlite3.connect(out)
        try:
            src.backup(dst)              # every page in one step: one consistent snapshot
        finally:
            dst.close()
            src.close()
        return BackupInfo(str(src_path), str(out), out.stat().st_size, time.perf_counter() - started)
    done = subprocess.run([_tool("pg_dump"), "--format=custom", "--file", str(out), "--dbname", _libpq_url(url)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        out.unlink(missing_ok=True)
        raise RuntimeError(f"pg_dump failed: {done.stderr.strip()[:500]}")
    return BackupInfo(_safe(url), str(out), out.stat().st_size, time.perf_counter() - started)


@lru_cache(maxsize=1)
def schema_objects() -> dict[str, str]:
    """name -> "table" | "index": every table and index gradwatch's migrations create, at any revision
    (a backup may be older than this server: ``serve --migrate`` upgrades it). Worked out by running
    the migrations one by one on a scratch SQLite file (a few seconds, once per restore)."""
    from alembic.script import ScriptDirectory

    from gradwatch.server.storage.db import alembic_config, upgrade

    with tempfile.TemporaryDirectory(prefix="gradwatch-schema-") as tmp:
        url = f"sqlite:///{Path(tmp) / 'reference.db'}"
        revisions = [r.revision for r in ScriptDirectory.from_config(alembic_config(url)).walk_revisions()][::-1]
        objects: dict[str, str] = {}
        for rev in revisions:
            upgrade(url, rev)
            con = sqlite3.connect(Path(tmp) / "reference.db")
            try:
                objects.update({name: kind for kind, name in con.execute(
                    "SELECT type, name FROM sqlite_master WHERE name NOT LIKE 'sqlite_%'")})
            finally:
                con.close()
    return objects


def known_revisions() -> set[str]:
    from alembic.script import ScriptDirectory

    from gradwatch.server.storage.db import alembic_config

    return {r.revision for r in ScriptDirectory.from_config(alembic_config("sqlite://")).walk_revisions()}


def _head_bytes(path: Path, n: int = 100) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read(n)
    except OSError as e:
        raise BackupRefused(f"cannot read {path}: {e.strerror or e}") from None


def vet_sqlite_backup(path: Path) -> str:
    """Raise ``BackupRefused`` unless ``path`` is a sound SQLite database holding gradwatch's schema and
    nothing else; returns its schema revision."""
    head = _head_bytes(path)
    if not head.startswith(SQLITE_MAGIC):
        what = "a pg_dump archive (restore it with --db postgresql://...)" if head.startswith(PGDUMP_MAGIC) else \
            "not a SQLite database (no SQLite header)"
        raise BackupRefused(f"{path} is {what}: not a gradwatch SQLite backup")
    try:
        con = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    except sqlite3.Error as e:
        raise BackupRefused(f"{path} cannot be opened as a SQLite database: {e}") from None
    try:
        problem = con.execute("PRAGMA quick_check").fetchone()[0]
        if problem != "ok":
            raise BackupRefused(f"{path} is damaged (SQLite's quick_check: {problem[:200]}): not restored")
        rows = con.execute("SELECT type, name, tbl_name FROM sqlite_master").fetchall()
        revision = _sqlite_revision(con, path)
    except sqlite3.Error as e:
        raise BackupRefused(f"{path} is damaged or truncated ({e}): not restored") from None
    finally:
        con.close()
    allowed = schema_objects()
    for kind, name, table in rows:
        if kind in ("table", "index") and name.startswith("sqlite_"):
            continue        # SQLite's own (autoindexes, sqlite_sequence, sqlite_stat*): names users cannot take
        if allowed.get(name) != kind:
            raise BackupRefused(f"{path} holds {kind} {name!r} (on {table!r}), which gradwatch's schema does not "
                                f"have: only gradwatch's tables and indexes are restored, nothing was written")
    return revision


def _sqlite_revision(con: sqlite3.Connection, path: Path) -> str:
    try:
        rows = con.execute("SELECT version_num FROM alembic_version").fetchall()
    except sqlite3.OperationalError:
        raise BackupRefused(f"{path} is a SQLite database but not gradwatch's (no alembic_version table)") from None
    known = known_revisions()
    if len(rows) != 1 or rows[0][0] not in known:
        raise BackupRefused(f"{path}: schema revision {[r[0] for r in rows]} is not one of gradwatch's "
                            f"({', '.join(sorted(known))}); a backup of a newer gradwatch needs that version")
    return rows[0][0]


_PG_ENTRY = re.compile(r"^\d+; \d+ \d+ (.*)$")
# pg_dump's TOC entry types a gradwatch database has; anything else (FUNCTION, TRIGGER, VIEW, RULE, POLICY,
# EXTENSION, SCHEMA, ...) is refused. Longest first: "TABLE DATA" before "TABLE"
_PG_TYPES = ("SEQUENCE OWNED BY", "FK CONSTRAINT", "SEQUENCE SET", "TABLE DATA", "CONSTRAINT", "SEQUENCE",
             "DEFAULT", "TABLE", "INDEX")


def vet_pg_archive(path: Path) -> None:
    """Raise ``BackupRefused`` unless ``path`` is a pg_dump custom-format archive whose entries are all
    gradwatch's tables, their data, indexes, constraints and sequences (``pg_restore --list``)."""
    head = _head_bytes(path, 5)
    if not head.startswith(PGDUMP_MAGIC):
        what = "a SQLite database (restore it with --db sqlite:///...)" if head.startswith(SQLITE_MAGIC[:5]) else \
            "not a pg_dump custom-format archive"
        raise BackupRefused(f"{path} is {what}: not a gradwatch PostgreSQL backup")
    done = subprocess.run([_tool("pg_restore"), "--list", str(path)], capture_output=True, text=True)
    if done.returncode != 0:
        first = (done.stderr.strip().splitlines() or ["(no message)"])[0]
        raise BackupRefused(f"{path} cannot be read as a pg_dump archive ({first[:300]}): not restored")
    allowed = schema_objects()
    tables = {n for n, k in allowed.items() if k == "table"}
    indexes = {n for n, k in allowed.items() if k == "index"}
    for line in done.stdout.splitlines():
        if not line.strip() or line.startswith(";"):
            continue
        m = _PG_ENTRY.match(line)
        kind = next((t for t in _PG_TYPES if m and m.group(1).startswith(t + " ")), None)
        words = m.group(1)[len(kind) + 1:].split() if kind else []
        if kind is None or len(words) < 3 or words[0] != "public":
            raise BackupRefused(f"{path} holds {line.split(' ', 3)[-1]!r}, which gradwatch's schema does not have: "
                                f"only gradwatch's tables, data, indexes, constraints and sequences are restored, "
                                f"nothing was written")
        name = words[1]
        ok = (name in indexes if kind == "INDEX" else
              name.endswith("_seq") and any(name.startswith(t + "_") for t in tables) if kind.startswith("SEQUENCE")
              else name in tables)
        if not ok:
            raise BackupRefused(f"{path} holds {kind} {name!r}, which gradwatch's schema does not have: "
                                f"nothing was written")


def restore(backup_file: str | Path, url: str) -> BackupInfo:
    """Restore ``backup_file`` into the database at ``url``: a new SQLite file, or an empty PostgreSQL
    database (refused if it has tables)."""
    backup_file = Path(backup_file)
    if not backup_file.exists():
        raise FileNotFoundError(f"no backup at {backup_file}")
    started = time.perf_counter()
    if url.startswith("sqlite"):
        dst_path = _sqlite_path(url)
        if dst_path.exists() and dst_path.stat().st_size > 0:
            raise FileExistsError(f"{dst_path} exists: restore into a new file (stop the server, move the old "
                                  f"file aside, restore, start the server)")
        vet_sqlite_backup(backup_file)
        if not dst_path.parent.is_dir():
            raise BackupRefused(f"{dst_path.parent} is not a directory: restore into a file in an existing one")
        # copied into a scratch file beside the target, renamed into place once complete and checked
        scratch = dst_path.with_name(f".{dst_path.name}.restoring-{uuid.uuid4().hex[:8]}")
        try:
            src = sqlite3.connect(f"file:{backup_file}?mode=ro", uri=True)
            dst = sqlite3.connect(scratch)
            try:
                src.backup(dst)
                if dst.execute("PRAGMA quick_check").fetchone()[0] != "ok":
                    raise BackupRefused(f"the copy of {backup_file} failed SQLite's quick_check: not restored")
            finally:
                dst.close()
                src.close()
            if dst_path.exists() and dst_path.stat().st_size > 0:
                raise FileExistsError(f"{dst_path} appeared while restoring: nothing was replaced")
            os.replace(scratch, dst_path)
        except sqlite3.Error as e:
            raise BackupRefused(f"copying {backup_file} failed ({e}): nothing was written") from None
        finally:
            scratch.unlink(missing_ok=True)
        return BackupInfo(str(dst_path), str(backup_file), dst_path.stat().st_size, time.perf_counter() - started)
    vet_pg_archive(backup_file)
    from sqlalchemy import create_engine, inspect

    engine = create_engine(url if "+" in url.split("://", 1)[0] else url.replace("postgresql://", "postgresql+psycopg://", 1))
    try:
        tables = inspect(engine).get_table_names()
    finally:
        engine.dispose()
    if tables:
        raise FileExistsError(f"{_safe(url)} is not empty ({len(tables)} tables): restore into a new database "
                              f"(createdb, then gradwatch restore)")
    # one transaction: a failure half-way leaves the database as empty as it was
    done = subprocess.run([_tool("pg_restore"), "--no-owner", "--exit-on-error", "--single-transaction",
                           "--dbname", _libpq_url(url), str(backup_file)], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"pg_restore failed: {done.stderr.strip()[:500]}")
    return BackupInfo(_safe(url), str(backup_file), backup_file.stat().st_size, time.perf_counter() - started)
