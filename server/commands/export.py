"""``gradwatch export RUN --format csv|parquet``: a run's per-step signals as one table.

One row per (rank, step), one column per signal: every step field of the wire
format (``loss``, ``grad_norm``, ``loss_scale``, ``overflow``, ``lr``, …) and
one ``custom:<key>`` column per value logged with ``monitor.log(...)``. Steps
are exported at full resolution (never downsampled). Non-finite values stay
non-finite: ``nan`` / ``inf`` / ``-inf`` in CSV (what ``float()`` and pandas
read back), IEEE values in Parquet; an empty CSV cell (a Parquet null) means
"not measured at this step". Steps a retention policy compacted (docs/deployment.md, "Retention")
are not exported: only their rollups remain, and a bucket is no step.

The data comes either straight from the database (``--db URL``, read through
``server.queries``) or from a running server's read API (``--server URL``,
with ``--token`` / ``GRADWATCH_TOKEN`` when the server has auth on).

Examples::

    gradwatch export 7 --format csv -o run7.csv
    gradwatch export bert-ft-3 --project nlp --format parquet --server http://gw:8470
"""
from __future__ import annotations

import csv
import json
import math
import os
import sys
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional, Protocol

from gradwatch.agent.signals import STEP_SIGNAL_NAMES, STEP_SIGNALS
from gradwatch.server.commands.http_json import request_json

CHUNK_STEPS = 50_000            # steps per read (queries and the API return them unbucketed)
# typed by the signal table: counts are integers and bools booleans in Parquet, both integers in CSV
INT_SIGNALS = frozenset(s.name for s in STEP_SIGNALS if s.kind == "count")
BOOL_SIGNALS = frozenset(s.name for s in STEP_SIGNALS if s.kind == "bool")


class ExportError(Exception):
    """A problem the user can fix; the message says how."""


@dataclass
class RunRef:
    id: int
    name: str
    project: str
    world_size: int
    last_step: Optional[int]


class Source(Protocol):
    def find_run(self, ref: str, project: Optional[str]) -> RunRef: ...
    def signals(self, run: RunRef) -> list[str]: ...
    def points(self, run: RunRef, signal: str, rank: int, start: int, end: int) -> list[tuple[int, Optional[float]]]: ...


def _pick_run(ref: str, project: Optional[str], candidates: list[RunRef]) -> RunRef:
    """The run named ``ref`` exactly (in ``project`` if given)."""
    exact = [r for r in candidates if r.name == ref and (project is None or r.project == project)]
    if len(exact) == 1:
        return exact[0]
    if not exact:
        where = f" in project {project!r}" if project else ""
        raise ExportError(f"no run named {ref!r}{where}; list runs with: "
                          f"curl <server>/api/v1/runs?name={urllib.parse.quote(ref)} (or pass the run id)")
    projects = ", ".join(sorted({r.project for r in exact}))
    raise ExportError(f"{len(exact)} runs are named {ref!r} (projects: {projects}); "
                      f"add --project NAME or pass the run id")


# --------------------------------------------------------------------------- sources

class DatabaseSource:
    """Reads through ``server.queries`` on a database URL."""

    def __init__(self, url: str):
        from gradwatch.server.storage.db import open_database, schema_problem

        self.database = open_database(url)
        try:
            problem = schema_problem(self.database.engine, url)
        except Exception as e:  # noqa: BLE001 - connection errors: say which URL failed
            self.database.dispose()
            raise ExportError(f"cannot open the database {url}: {str(e).splitlines()[0]}") from None
        if problem:
            self.database.dispose()
            raise ExportError(f"{problem}; run: gradwatch db upgrade --db {url}")

    def close(self) -> None:
        self.database.dispose()

    def find_run(self, ref: str, project: Optional[str]) -> RunRef:
        from gradwatch.server import queries

        with self.database.sessionmaker() as session:
            if ref.isdigit():
                r = queries.get_run(session, run_id=int(ref))
                if r is None:
                    raise ExportError(f"no run with id {ref}")
                return RunRef(r.id, r.name, r.project, r.world_size, r.last_step)
            runs = queries.list_runs(session, project=project, name=ref)
        return _pick_run(ref, project, [RunRef(r.id, r.name, r.project, r.world_size, r.last_step) for r in runs])

    def signals(self, run: RunRef) -> list[str]:
        from gradwatch.server import queries

        with self.database.sessionmaker() as session:
            return queries.list_signals(session, run_id=run.id)

    def points(self, run: RunRef, signal: str, rank: int, start: int, end: int):
        from gradwatch.server import queries

        with self.database.sessionmaker() as session:
            start = max(start, queries.raw_steps_from(session, run_id=run.id))
            if start > end:
                return []
            s = queries.get_series(session, run_id=run.id, signal=signal, start=start, end=end,
                                   max_points=end - start + 1, rank=rank)
        return [(p.step, p.last) for p in s.points]


class HttpSource:
    """Reads through a running server's ``/api/v1`` read API."""

    def __init__(self, base: str, token: Optional[str] = None, timeout: float = 60.0):
        if not base.startswith(("http://", "https://")):
            raise ExportError(f"--server {base!r}: give an http:// or https:// URL, e.g. http://127.0.0.1:8470")
        self.base = base.rstrip("/")
        self.token = token
        self.timeout = timeout

    def close(self) -> None:
        pass

    def _get(self, path: str, **params) -> dict:
        query = urllib.parse.urlencode({k: v for k, v in params.items() if v is not None})
        req = urllib.request.Request(f"{self.base}{path}" + (f"?{query}" if query else ""))
        if self.token:
            req.add_header("Authorization", f"Bearer {self.token}")
        return request_json(req, base=self.base, path=path, timeout=self.timeout, error=ExportError,
                            token_of="the run's project")

    @staticmethod
    def _ref(r: dict) -> RunRef:
        return RunRef(r["id"], r["name"], r["project"], r.get("world_size") or 1, r.get("last_step"))

    def find_run(self, ref: str, project: Optional[str]) -> RunRef:
        if ref.isdigit():
            try:
                return self._ref(self._get(f"/api/v1/runs/{ref}"))
            except ExportError as e:
                if "HTTP 404" in str(e):
                    raise ExportError(f"no run with id {ref} on {self.base}") from None
                raise
        runs = self._get("/api/v1/runs", project=project, name=ref)["runs"]
        return _pick_run(ref, project, [self._ref(r) for r in runs])

    def signals(self, run: RunRef) -> list[str]:
        # The run detail lists the run's signals (custom:<key> included); an older server's does not,
        # and then the step signals are all that can be exported.
        detail = self._get(f"/api/v1/runs/{run.id}")
        return list(detail.get("signals") or STEP_SIGNAL_NAMES)

    def points(self, run: RunRef, signal: str, rank: int, start: int, end: int):
        known = self.__dict__.setdefault("_raw_from", {})
        if run.id not in known:
            # steps below the run's retention boundary are rollups only (runs.config["_retention"])
            config = self._get(f"/api/v1/runs/{run.id}").get("config") or {}
            known[run.id] = int((config.get("_retention") or {}).get("raw_before") or 0)
        start = max(start, known[run.id])
        if start > end:
            return []
        body = self._get(f"/api/v1/runs/{run.id}/series", signal=signal, start=start, end=end,
                         max_points=min(100_000, end - start + 1), rank=rank)
        return [(p["step"], _from_wire(p["last"])) for p in body["steps"]]


def _from_wire(v) -> Optional[float]:
    if v is None:
        return None
    return float(v)  # float() reads "NaN", "Infinity", "-Infinity"


# --------------------------------------------------------------------------- table

@dataclass
class Table:
    columns: list[str]            # "step", "rank", then the signals
    rows: list[list]              # one per (rank, step), sorted


def collect(source: Source, run: RunRef, *, ranks: Optional[Iterable[int]] = None) -> Table:
    """Every signal of every rank at full resolution, one row per (rank, step)."""
    signals = source.signals(run)
    ranks = list(range(max(1, run.world_size))) if ranks is None else list(ranks)
    rows: list[list] = []
    if run.last_step is None:
        return Table(["step", "rank", *signals], rows)
    for rank in ranks:
        by_step: dict[int, dict[str, Optional[float]]] = {}
        for signal in signals:
            start = 0
            while start <= run.last_step:
                end = min(run.last_step, start + CHUNK_STEPS - 1)
                for step, value in source.points(run, signal, rank, start, end):
                    by_step.setdefault(step, {})[signal] = value
                start = end + 1
        for step in sorted(by_step):
            values = by_step[step]
            if all(v is None for v in values.values()):
                continue
            rows.append([step, rank, *(values.get(s) for s in signals)])
    return Table(["step", "rank", *signals], rows)


def _csv_cell(signal: str, v) -> str:
    if v is None:
        return ""
    if isinstance(v, float) and not math.isfinite(v):
        return "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf")
    if signal in INT_SIGNALS or signal in BOOL_SIGNALS:
        return str(int(v))
    return repr(float(v))


def write_csv(table: Table, out) -> None:
    w = csv.writer(out, lineterminator="\n")
    w.writerow(table.columns)
    signals = table.columns[2:]
    for row in table.rows:
        w.writerow([row[0], row[1], *(_csv_cell(s, v) for s, v in zip(signals, row[2:]))])


def write_parquet(table: Table, path: Path, *, metadata: Optional[dict] = None) -> None:
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise ExportError("Parquet needs pyarrow: pip install 'gradwatch[server]' (or pip install pyarrow), "
                          "or use --format csv") from None
    arrays, fields = [], []
    for i, name in enumerate(table.columns):
        col = [row[i] for row in table.rows]
        if name in ("step", "rank"):
            typ = pa.int64()
        elif name in BOOL_SIGNALS:
            typ, col = pa.bool_(), [None if v is None or math.isnan(v) else bool(v) for v in col]
        elif name in INT_SIGNALS:
            typ, col = pa.int64(), [None if v is None or not math.isfinite(v) else int(v) for v in col]
        else:
            typ = pa.float64()
        arrays.append(pa.array(col, type=typ))
        fields.append(pa.field(name, typ))
    schema = pa.schema(fields, metadata={k: json.dumps(v) for k, v in (metadata or {}).items()})
    pq.write_table(pa.Table.from_arrays(arrays, schema=schema), path)


# --------------------------------------------------------------------------- CLI

def add_subparser(subparsers) -> None:
    p = subparsers.add_parser(
        "export",
        help="write one run's per-step signals to a CSV or Parquet file",
        description="Export one run at full resolution: a row per (rank, step), a column per signal "
                    "(step fields and custom:<key> values). Reads the database directly (--db, default: as for "
                    "serve) or a running server (--server).",
        epilog="Examples: gradwatch export 7 -o run7.csv | "
               "gradwatch export my-run --project nlp --format parquet --server http://127.0.0.1:8470",
    )
    p.add_argument("run", metavar="RUN", help="run id, or run name (exact; add --project when names repeat)")
    p.add_argument("--format", choices=["csv", "parquet"], default="csv", help="output format (default csv)")
    p.add_argument("-o", "--output", metavar="FILE",
                   help="output file (default <run name>.<format> in the current directory; '-' = stdout, csv only)")
    p.add_argument("--project", help="project of the run when RUN is a name")
    p.add_argument("--rank", type=int, action="append", help="export only this rank (repeatable; default all)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--db", metavar="URL", help="database URL (default: GRADWATCH_DATABASE_URL or the SQLite file "
                                                 "in the data dir)")
    src.add_argument("--server", metavar="URL", help="read through a running server's API instead of the database")
    p.add_argument("--token", help="API token for --server when auth is on (default: $GRADWATCH_TOKEN)")
    p.set_defaults(func=run)


def _open_source(args) -> Source:
    if args.server:
        return HttpSource(args.server, token=args.token or os.environ.get("GRADWATCH_TOKEN") or None)
    from gradwatch.server.operations.settings import Settings

    settings = Settings.from_env(db=args.db)
    url = settings.database_url
    if url.startswith("sqlite") and "///" in url and not Path(url.split("///", 1)[1]).exists():
        # (opening it would create an empty file)
        raise ExportError(f"no database at {url}; pass --db URL or --server URL (or set GRADWATCH_DATABASE_URL)")
    return DatabaseSource(url)


def run(args) -> int:
    if args.output == "-" and args.format != "csv":
        print("gradwatch export: '-o -' (stdout) works with --format csv only; give a file name for parquet.",
              file=sys.stderr)
        return 2
    try:
        source = _open_source(args)
        try:
            ref = source.find_run(args.run, args.project)
            table = collect(source, ref, ranks=args.rank)
        finally:
            source.close()
        out = args.output or f"{_safe_name(ref.name)}.{args.format}"
        if args.format == "csv":
            if out == "-":
                write_csv(table, sys.stdout)
                sys.stdout.flush()
            else:
                with open(out, "w", newline="", encoding="utf-8") as f:
                    write_csv(table, f)
        else:
            write_parquet(table, Path(out), metadata={"run_id": ref.id, "run": ref.name, "project": ref.project})
    except ExportError as e:
        print(f"gradwatch export: {e}", file=sys.stderr)
        return 1
    if out != "-":
        print(f"gradwatch: wrote {len(table.rows)} rows × {len(table.columns)} columns of run {ref.id} "
              f"({ref.project}/{ref.name}) to {out}", file=sys.stderr)
    return 0


def _safe_name(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name) or "run"
