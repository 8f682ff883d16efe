"""Issue 43, case 5: ``gradwatch restore`` vets its input. Random bytes, a text file, a truncated backup,
a backup of the other database kind, and a backup carrying a schema object gradwatch's migrations do
not create (a trigger, a view, a table of its own; on PostgreSQL a function and its trigger) are
refused with one line saying why: exit 1, no traceback, nothing written (no target file on SQLite, the
target database still empty on PostgreSQL). A sound backup still restores. Real databases."""
from __future__ import annotations

import os
import shutil
import sqlite3
import subprocess
import sys
import uuid

import pytest

from tests.conftest import PG_ADMIN_URL, REPO_ROOT, _pg_connect


def _gw(*args, data_dir):
    env = dict(os.environ, GRADWATCH_DATA_DIR=str(data_dir))
    return subprocess.run([sys.executable, "-m", "gradwatch.server", *args], capture_output=True, text=True,
                          env=env, cwd=REPO_ROOT, timeout=300)


def _sqlite_backup(tmp_path, srv_factory):
    """A real backup of a real server's database (one run ingested)."""
    db = f"sqlite:///{tmp_path / 'live.db'}"
    srv = srv_factory(db)
    st, out = srv.post("/api/v1/ingest", {"batch_id": "b1", "project": "p", "run": "r",
                                          "steps": [{"step": 0, "time": 1.0, "loss": 1.0}]})
    assert st == 200, out
    good = tmp_path / "good.db"
    done = _gw("backup", str(good), "--db", db, data_dir=tmp_path)
    assert done.returncode == 0, done.stderr
    return good


def _tampered(tmp_path, good, name, sql):
    path = tmp_path / name
    shutil.copy(good, path)
    con = sqlite3.connect(path)
    con.execute(sql)
    con.commit()
    con.close()
    return path


def _refused(done, *words):
    assert done.returncode == 1, (done.returncode, done.stdout, done.stderr)
    assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr
    for w in words:
        assert w in done.stderr, (w, done.stderr)


def test_sqlite_restore_refuses_junk_and_foreign_objects_and_writes_nothing(tmp_path, server_factory):
    good = _sqlite_backup(tmp_path, server_factory)
    junk = tmp_path / "junk.db"
    junk.write_bytes(os.urandom(8192))
    truncated = tmp_path / "truncated.db"
    truncated.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    text = tmp_path / "passwd"
    text.write_text("root:x:0:0:root:/root:/bin/bash\n")
    cases = {
        junk: ("not a SQLite database",),
        text: ("not a SQLite database",),
        truncated: ("damaged",),
        _tampered(tmp_path, good, "trigger.db",
                  "CREATE TRIGGER t AFTER INSERT ON alerts BEGIN DELETE FROM runs; END"): ("trigger 't'",),
        _tampered(tmp_path, good, "view.db", "CREATE VIEW v AS SELECT * FROM runs"): ("view 'v'",),
        _tampered(tmp_path, good, "table.db", "CREATE TABLE extra (x)"): ("table 'extra'",),
        _tampered(tmp_path, good, "index.db", "CREATE INDEX ix_mine ON runs (name)"): ("index 'ix_mine'",),
        _tampered(tmp_path, good, "noversion.db", "DROP TABLE alembic_version"): ("alembic_version",),
    }
    target = tmp_path / "restored.db"
    for backup, words in cases.items():
        done = _gw("restore", str(backup), "--db", f"sqlite:///{target}", data_dir=tmp_path)
        _refused(done, *words)
        assert not target.exists(), f"{backup.name}: a refused restore leaves no file behind"
        assert not [p for p in tmp_path.iterdir() if ".restoring-" in p.name]
    done = _gw("restore", str(good), "--db", f"sqlite:///{target}", data_dir=tmp_path)
    assert done.returncode == 0, done.stderr
    con = sqlite3.connect(target)
    assert con.execute("SELECT name FROM runs").fetchall() == [("r",)]
    assert con.execute("SELECT count(*) FROM sqlite_master WHERE type IN ('trigger', 'view')").fetchone() == (0,)
    con.close()


@pytest.fixture
def pg_databases():
    """Fresh PostgreSQL databases made here and dropped after: ``make()`` -> URL."""
    admin = _pg_connect(PG_ADMIN_URL)
    made = []
    base = PG_ADMIN_URL.rsplit("/", 1)[0]

    def make():
        name = f"gw_sec_{uuid.uuid4().hex[:10]}"
        admin.execute(f'CREATE DATABASE "{name}"')
        made.append(name)
        return f"{base}/{name}"

    yield make
    for name in made:
        admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    admin.close()


@pytest.mark.postgres
def test_postgresql_restore_refuses_junk_and_a_smuggled_trigger_and_writes_nothing(tmp_path, server_factory,
                                                                                  pg_databases):
    src = pg_databases()
    srv = server_factory(src)
    st, out = srv.post("/api/v1/ingest", {"batch_id": "b1", "project": "p", "run": "r",
                                          "steps": [{"step": 0, "time": 1.0, "loss": 1.0}]})
    assert st == 200, out
    srv.stop()
    con = _pg_connect(src)
    con.execute("CREATE FUNCTION wipe() RETURNS trigger LANGUAGE plpgsql AS $$BEGIN DELETE FROM runs; "
                "RETURN NEW; END$$")
    con.execute("CREATE TRIGGER wipe AFTER INSERT ON alerts FOR EACH ROW EXECUTE FUNCTION wipe()")
    con.close()
    tampered = tmp_path / "tampered.dump"
    done = _gw("backup", str(tampered), "--db", src, data_dir=tmp_path)
    assert done.returncode == 0, done.stderr
    junk = tmp_path / "junk.dump"
    junk.write_bytes(os.urandom(8192))
    truncated = tmp_path / "truncated.dump"
    truncated.write_bytes(tampered.read_bytes()[:3000])
    sqlite_file = tmp_path / "a.db"
    con = sqlite3.connect(sqlite_file)
    con.execute("CREATE TABLE t (x)")
    con.close()
    target = pg_databases()
    for backup, words in ((tampered, ("FUNCTION",)), (junk, ("not a pg_dump",)), (truncated, ("cannot be read",)),
                          (sqlite_file, ("a SQLite database",))):
        done = _gw("restore", str(backup), "--db", target, data_dir=tmp_path)
        _refused(done, *words)
        con = _pg_connect(target)
        tables = con.execute("SELECT count(*) FROM pg_tables WHERE schemaname = 'public'").fetchone()[0]
        con.close()
        assert tables == 0, f"{backup.name}: nothing written"
