"""``gradwatch export RUN --format csv|parquet``: a run at full resolution, non-finite values kept."""
from __future__ import annotations

import csv
import io
import math

import pytest

from gradwatch.agent.signals import STEP_SIGNAL_NAMES
from tests.cli.cli_helpers import batch, gradwatch, ingest

STEP_COLUMNS = list(STEP_SIGNAL_NAMES)


def _steps(n: int) -> list[dict]:
    out = []
    for i in range(n):
        s = {"step": i, "time": 1_700_000_000.0 + i, "loss": 2.0 / (i + 1), "grad_norm": 0.25 * i,
             "loss_scale": 1024.0, "overflow": i == 3, "overflow_count": int(i >= 3), "lr": 1e-3,
             "clip_max_norm": 1.0, "clipped": i % 2 == 0, "custom": {"acc": i / 10}}
        out.append(s)
    out[5]["loss"] = "NaN"            # non-finite values must survive the export
    out[6]["grad_norm"] = "Infinity"
    out[7]["grad_norm"] = "-Infinity"
    out[8]["lr"] = None               # not measured
    return out


def _fill(srv) -> int:
    first = ingest(srv.url, batch("exp-1", _steps(10)[:4], project="vision"))
    ingest(srv.url, batch("exp-1", _steps(10)[4:], project="vision"))
    ingest(srv.url, batch("exp-1", [{"step": 0, "time": 1.0, "loss": 9.0}], project="nlp"))   # same name elsewhere
    return first["run_id"]


def _read_csv(text: str) -> list[dict]:
    return list(csv.DictReader(io.StringIO(text)))


def _check_rows(rows: list[dict]) -> None:
    assert [int(r["step"]) for r in rows] == list(range(10))
    assert {r["rank"] for r in rows} == {"0"}
    assert math.isnan(float(rows[5]["loss"]))
    assert float(rows[6]["grad_norm"]) == math.inf and float(rows[7]["grad_norm"]) == -math.inf
    assert rows[8]["lr"] == "" and float(rows[9]["lr"]) == 1e-3
    assert float(rows[2]["loss"]) == pytest.approx(2.0 / 3)
    assert [r["overflow"] for r in rows[2:5]] == ["0", "1", "0"]
    assert [r["clipped"] for r in rows[:2]] == ["1", "0"]
    assert rows[9]["overflow_count"] == "1"
    assert [float(r["custom:acc"]) for r in rows] == pytest.approx([i / 10 for i in range(10)])


def test_export_csv_parquet_api_and_errors(server_factory, db_url, tmp_path):
    srv = server_factory(db_url)
    run_id = _fill(srv)

    # CSV from the database, by id
    out = tmp_path / "by-id.csv"
    proc = gradwatch("export", str(run_id), "--db", srv.db_url, "-o", str(out))
    assert proc.returncode == 0, proc.stderr
    assert "wrote 10 rows" in proc.stderr
    rows = _read_csv(out.read_text())
    assert list(rows[0].keys()) == ["step", "rank", *STEP_COLUMNS, "custom:acc"]
    _check_rows(rows)

    # by name: ambiguous across projects until --project says which
    proc = gradwatch("export", "exp-1", "--db", srv.db_url, "-o", "-")
    assert proc.returncode == 1
    assert "2 runs are named 'exp-1'" in proc.stderr and "--project" in proc.stderr
    proc = gradwatch("export", "exp-1", "--project", "vision", "--db", srv.db_url, "-o", "-")
    assert proc.returncode == 0, proc.stderr
    assert _read_csv(proc.stdout) == rows

    # Parquet: types kept, non-finite values kept, default file name <run name>.parquet
    pq = pytest.importorskip("pyarrow.parquet")
    proc = gradwatch("export", str(run_id), "--format", "parquet", "--db", srv.db_url, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    table = pq.read_table(tmp_path / "exp-1.parquet")
    assert table.column_names == ["step", "rank", *STEP_COLUMNS, "custom:acc"]
    assert str(table.schema.field("overflow").type) == "bool"
    assert str(table.schema.field("overflow_count").type) == "int64"
    data = table.to_pydict()
    assert data["step"] == list(range(10))
    assert math.isnan(data["loss"][5]) and data["grad_norm"][6:8] == [math.inf, -math.inf]
    assert data["lr"][8] is None and data["overflow"][3] is True
    assert table.schema.metadata[b"run"] == b'"exp-1"'

    # through a running server's read API: the same table, custom:<key> columns included
    via_api = gradwatch("export", str(run_id), "--server", srv.url, "-o", "-")
    assert via_api.returncode == 0, via_api.stderr
    assert _read_csv(via_api.stdout) == rows

    if srv.db_url.startswith("sqlite"):
        _check_errors(srv, run_id, tmp_path)


def _check_errors(srv, run_id: int, tmp_path) -> None:
    """Errors say what to do (checked once, on SQLite)."""
    proc = gradwatch("export", "999", "--db", srv.db_url)
    assert proc.returncode == 1 and "no run with id 999" in proc.stderr
    proc = gradwatch("export", "nope", "--db", srv.db_url)
    assert proc.returncode == 1 and "no run named 'nope'" in proc.stderr and "run id" in proc.stderr
    proc = gradwatch("export", str(run_id), "--format", "parquet", "-o", "-", "--db", srv.db_url)
    assert proc.returncode == 2 and "csv only" in proc.stderr
    proc = gradwatch("export", str(run_id), "--server", "http://127.0.0.1:9")
    assert proc.returncode == 1 and "cannot reach the server" in proc.stderr
    proc = gradwatch("export", str(run_id), data_dir=tmp_path / "empty")
    assert proc.returncode == 1 and "pass --db URL or --server URL" in proc.stderr
    typo = tmp_path / "typo" / "gradwatch.db"
    proc = gradwatch("export", str(run_id), "--db", f"sqlite:///{typo}")
    assert proc.returncode == 1 and f"no database at sqlite:///{typo}" in proc.stderr
    assert not typo.parent.exists(), "a mistyped path must not leave an empty database behind"
