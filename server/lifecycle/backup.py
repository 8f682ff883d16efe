"""Backing up and restoring a gradwatch database (``gradwatch backup`` / ``gradwatch restore``).

- **SQLite**: Python's ``sqlite3.Connection.backup`` (SQLite's online backup API) copies every page in one
  step, inside one read transaction: a consistent snapshot taken while the server keeps ingesting (in WAL
  mode a reader blocks no writer; a stepped copy would restart each time ingest wrote). Restore copies the
  backup into a new file the same way.
- **PostgreSQL**: ``pg_dump --format=custom`` (a consistent snapshot too: one repeatable-read transaction)
  and ``pg_restore --no-owner --exit-on-error`` into an empty database.

A restored database may be at an older schema revision than the server: ``gradwatch serve --migrate``
upgrades it (docs/deployment.md, "Backup and restore").
"""
from __future__ import annotations

import shutil
import sqlite3
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path


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
        src = sqlite3.connect(f"file:{backup_file}?mode=ro", uri=True)
        dst = sqlite3.connect(dst_path)
        try:
            if src.execute("PRAGMA quick_check").fetchone()[0] != "ok":
                raise RuntimeError(f"{backup_file} is not a sound SQLite database (PRAGMA quick_check)")
            src.backup(dst)
        finally:
            dst.close()
            src.close()
        return BackupInfo(str(dst_path), str(backup_file), dst_path.stat().st_size, time.perf_counter() - started)
    from sqlalchemy import create_engine, inspect

    engine = create_engine(url if "+" in url.split("://", 1)[0] else url.replace("postgresql://", "postgresql+psycopg://", 1))
    try:
        tables = inspect(engine).get_table_names()
    finally:
        engine.dispose()
    if tables:
        raise FileExistsError(f"{_safe(url)} is not empty ({len(tables)} tables): restore into a new database "
                              f"(createdb, then gradwatch restore)")
    done = subprocess.run([_tool("pg_restore"), "--no-owner", "--exit-on-error", "--dbname", _libpq_url(url),
                           str(backup_file)], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"pg_restore failed: {done.stderr.strip()[:500]}")
    return BackupInfo(_safe(url), str(backup_file), backup_file.stat().st_size, time.perf_counter() - started)
