"""``gradwatch runs list|delete``, ``gradwatch projects delete``, ``gradwatch backup`` and ``gradwatch restore``.

``runs`` and ``projects`` talk to a running server (``--server``, default ``$GRADWATCH_SERVER`` or
http://127.0.0.1:8470; ``--token`` / ``$GRADWATCH_TOKEN`` when auth is on), or with ``--db`` straight to a
database (no server needed; the delete is the same bounded-batch purge, server/lifecycle/delete.py).
``backup`` / ``restore`` work on the database itself (docs/deployment.md, "Backup and restore").

Standard library only at import (server/cli.py).
"""
from __future__ import annotations

import json
import os
import re
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Any, Optional

DEFAULT_SERVER = "http://127.0.0.1:8470"
_AGE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw])\s*$")
_AGE_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def _eprint(*args) -> None:
    print(*args, file=sys.stderr, flush=True)


def parse_age(text: str) -> float:
    """``30d`` -> seconds.

    >>> parse_age("30d"), parse_age("12h"), parse_age("90m")
    (2592000.0, 43200.0, 5400.0)
    """
    m = _AGE.match(text)
    if not m:
        raise ValueError(f"--older-than {text!r}: give a number and a unit, e.g. 30d, 12h, 90m, 2w")
    return float(m.group(1)) * _AGE_SECONDS[m.group(2)]


def human_bytes(n: Optional[float]) -> str:
    """Decimal units, as docs/performance.md writes them.

    >>> human_bytes(1_375_000_000), human_bytes(52_300), human_bytes(None)
    ('1.38 GB', '52.3 kB', '-')
    """
    if n is None:
        return "-"
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.3g} {unit}" if n / size < 100 else f"{n / size:,.0f} {unit}"
    return f"{int(n)} B"


# ----------------------------------------------------------------------------- parsers

def _target(p) -> None:
    p.add_argument("--server", help=f"server URL (default: $GRADWATCH_SERVER or {DEFAULT_SERVER})")
    p.add_argument("--token", help="API token when the server has auth on (default: $GRADWATCH_TOKEN)")
    p.add_argument("--db", help="work on this database directly instead of through a server "
                                "(sqlite:///file.db, postgresql://...; env GRADWATCH_DATABASE_URL is not read "
                                "here: say it)")


def _filters(p) -> None:
    p.add_argument("--project", help="only runs of this project")
    p.add_argument("--name", metavar="PATTERN", help="run name, a shell pattern: exp-*, *-debug")
    p.add_argument("--status", choices=["running", "stalled", "finished", "crashed"])
    p.add_argument("--older-than", metavar="AGE", help="last seen longer ago than AGE: 30d, 12h, 90m, 2w")


def add_subparser(subparsers) -> None:
    runs = subparsers.add_parser("runs", help="list runs with their sizes; delete runs")
    sub = runs.add_subparsers(dest="runs_command", required=True)
    lst = sub.add_parser("list", help="runs with status, last step and estimated size",
                         epilog="Example: gradwatch runs list --project vision --older-than 30d")
    _filters(lst)
    _target(lst)
    lst.add_argument("--json", action="store_true", help="one JSON object per run")
    lst.set_defaults(func=run_runs_list)
    rm = sub.add_parser("delete", help="delete runs and every row they own",
                        description="Delete runs by id, or every run matching the filters (at least one). "
                                    "A run still sending is refused unless --force; its later batches are "
                                    "refused by the server (410). docs/deployment.md, 'Deleting runs'.",
                        epilog="Example: gradwatch runs delete --project sweeps --name 'lr-*' --older-than 30d --dry-run")
    rm.add_argument("ids", nargs="*", type=int, metavar="ID", help="run ids (gradwatch runs list)")
    _filters(rm)
    _target(rm)
    _delete_flags(rm)
    rm.set_defaults(func=run_runs_delete)

    projects = subparsers.add_parser("projects", help="delete a project with all its runs")
    psub = projects.add_subparsers(dest="projects_command", required=True)
    prm = psub.add_parser("delete", help="delete a project: its runs, tokens, silences, webhooks, then itself",
                          epilog="Example: gradwatch projects delete scratch --dry-run")
    prm.add_argument("project", metavar="NAME")
    _target(prm)
    _delete_flags(prm)
    prm.set_defaults(func=run_projects_delete)

    bk = subparsers.add_parser("backup", help="copy the database to a file while the server runs",
                               description="SQLite: the online backup API (a consistent copy while ingest goes "
                                           "on). PostgreSQL: pg_dump in its custom format (pg_dump must be "
                                           "installed). docs/deployment.md, 'Backup and restore'.",
                               epilog="Example: gradwatch backup --db sqlite:///srv/gradwatch.db gradwatch-2026-12-05.db")
    bk.add_argument("out", metavar="FILE")
    bk.add_argument("--db", help="database URL (default: as for serve)")
    bk.set_defaults(func=run_backup)
    rs = subparsers.add_parser("restore", help="restore a backup into a new database",
                               description="SQLite: copy the backup into a new file. PostgreSQL: pg_restore into "
                                           "an empty database (create it first). Stop servers on the target first.",
                               epilog="Example: gradwatch restore gradwatch-2026-12-05.db --db sqlite:///srv/new.db")
    rs.add_argument("backup", metavar="FILE")
    rs.add_argument("--db", required=True, help="the database to restore into (a new SQLite file, an empty "
                                                "PostgreSQL database)")
    rs.set_defaults(func=run_restore)


def _delete_flags(p) -> None:
    p.add_argument("--dry-run", action="store_true", help="print what would be deleted and its size; delete nothing")
    p.add_argument("--force", action="store_true", help="also delete runs still sending")
    p.add_argument("--yes", "-y", action="store_true", help="do not ask (required when stdin is not a terminal)")


# ----------------------------------------------------------------------------- talking to a server

def _server(args) -> str:
    return (args.server or os.environ.get("GRADWATCH_SERVER") or DEFAULT_SERVER).rstrip("/")


def _http(args, method: str, path: str, query: Optional[dict] = None, timeout: float = 3600) -> tuple[int, Any]:
    url = _server(args) + path
    if query:
        url += "?" + urllib.parse.urlencode({k: v for k, v in query.items() if v is not None}, doseq=True)
    req = urllib.request.Request(url, method=method)
    token = args.token or os.environ.get("GRADWATCH_TOKEN")
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read() or b"null")
    except urllib.error.HTTPError as e:
        raw = e.read()
        try:
            return e.code, json.loads(raw)
        except ValueError:
            return e.code, {"detail": raw.decode(errors="replace")[:300]}
    except (urllib.error.URLError, OSError) as e:
        raise SystemExit(_fail(f"cannot reach the server at {_server(args)}: {getattr(e, 'reason', e)} "
                               f"(--server URL, or --db to work on a database directly)"))


def _fail(msg: str) -> int:
    _eprint(f"gradwatch: {msg}")
    return 1


def _database(url: str):
    from gradwatch.server.storage.db import open_database
    from gradwatch.server.operations.settings import Settings

    return open_database(Settings.from_env(db=url).database_url)


def _stall_seconds(url: Optional[str] = None) -> float:
    from gradwatch.server.operations.settings import Settings

    return Settings.from_env(db=url).stall_seconds


# ----------------------------------------------------------------------------- runs list

def _list_rows(args) -> list[dict]:
    older = parse_age(args.older_than) if args.older_than else None
    if args.db:
        from gradwatch.server.lifecycle import delete, sizes

        database = _database(args.db)
        try:
            with database.sessionmaker() as session:
                refs = delete.select_runs(session, project=args.project, name=args.name, status=args.status,
                                          older_than_s=older, stall_seconds=_stall_seconds(args.db))
                size = sizes.run_bytes(session, [r.id for r in refs])
                from gradwatch.server.storage.models import Run
                from sqlalchemy import select
                steps = dict(session.execute(select(Run.id, Run.last_step).where(Run.id.in_([r.id for r in refs]))).all())
        finally:
            database.dispose()
        return [{"id": r.id, "project": r.project, "name": r.name, "status": r.status, "last_step": steps.get(r.id),
                 "last_seen": r.last_seen, "bytes": size.get(r.id)} for r in refs]
    status, body = _http(args, "GET", "/api/v1/runs", {"project": args.project, "status": args.status})
    if status != 200:
        raise SystemExit(_fail(f"the server answered {status}: {body.get('detail', body)}"))
    import fnmatch
    now = time.time()
    rows = [r for r in body["runs"]
            if (args.name is None or fnmatch.fnmatchcase(r["name"], args.name))
            and (older is None or r["last_seen"] < now - older)]
    return sorted(rows, key=lambda r: r["id"])


def _print_runs(rows: list[dict]) -> None:
    head = ("ID", "PROJECT", "NAME", "STATUS", "LAST STEP", "SIZE", "LAST SEEN (UTC)")
    table = [head] + [(str(r["id"]), r["project"], r["name"], r["status"],
                       "-" if r.get("last_step") is None else f"{r['last_step']:,}", human_bytes(r.get("bytes")),
                       time.strftime("%Y-%m-%d %H:%M", time.gmtime(r["last_seen"]))) for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(head))]
    for row in table:
        print("  ".join(c.rjust(w) if i in (0, 4, 5) else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))).rstrip())


def run_runs_list(args) -> int:
    try:
        rows = _list_rows(args)
    except ValueError as e:
        return _fail(str(e))
    if args.json:
        for r in rows:
            print(json.dumps(r))
        return 0
    _print_runs(rows)
    total = sum(r.get("bytes") or 0 for r in rows)
    print(f"{len(rows)} run(s), {human_bytes(total)} estimated")
    return 0


# ----------------------------------------------------------------------------- deleting

def _confirm(args, what: str) -> bool:
    if args.yes or args.dry_run:
        return True
    if not sys.stdin.isatty():
        _eprint("gradwatch: not a terminal: add --yes to delete (or --dry-run to see what would go)")
        return False
    answer = input(f"Delete {what}? This cannot be undone. [y/N] ")
    return answer.strip().lower() in ("y", "yes")


def _report(out: dict, *, dry_run: bool) -> None:
    rows = [{**r, "last_step": None} for r in out["runs"]]
    if rows:
        _print_runs(rows)
    verb = "would delete" if dry_run else "deleted"
    extra = "" if dry_run else f" ({out['rows']:,} rows in {out['seconds']:.1f} s)"
    what = f"project {out['project']!r} and " if out.get("project") else ""
    print(f"{verb} {what}{len(out['runs'])} run(s), {human_bytes(out['bytes'])} estimated{extra}")


def _report_local(report, project: Optional[str] = None) -> dict:
    return {"dry_run": report.dry_run, "project": project, "rows": report.rows, "seconds": report.seconds,
            "bytes": sum(report.bytes.get(r.id, 0) for r in report.runs),
            "runs": [{"id": r.id, "project": r.project, "name": r.name, "status": r.status,
                      "last_seen": r.last_seen, "bytes": report.bytes.get(r.id, 0)} for r in report.runs]}


def run_runs_delete(args) -> int:
    has_filter = any(v is not None for v in (args.project, args.name, args.status, args.older_than))
    if args.ids and has_filter:
        return _fail("give run ids or filters, not both")
    if not args.ids and not has_filter:
        return _fail("say which runs: ids, or --project / --name / --status / --older-than "
                     "(a whole project: gradwatch projects delete NAME)")
    try:
        older = parse_age(args.older_than) if args.older_than else None
    except ValueError as e:
        return _fail(str(e))
    if not args.dry_run and not args.yes:
        # show what would go before asking
        args.dry_run = True
        code = run_runs_delete(args)
        args.dry_run = False
        if code != 0:
            return code
        if not _confirm(args, "these runs"):
            return 1
    if args.db:
        from gradwatch.server.lifecycle import delete

        database = _database(args.db)
        stall = _stall_seconds(args.db)
        try:
            with database.sessionmaker() as session:
                refs = delete.select_runs(session, run_ids=args.ids or None, project=args.project, name=args.name,
                                          status=args.status, older_than_s=older, stall_seconds=stall)
            if args.ids and len(refs) < len(set(args.ids)):
                missing = sorted(set(args.ids) - {r.id for r in refs})
                return _fail(f"no such run: {', '.join(map(str, missing))}")
            try:
                report = delete.delete_runs(database, runs=refs, force=args.force, dry_run=args.dry_run,
                                            stall_seconds=stall)
            except delete.RunStillSending as e:
                return _fail(str(e).replace("force=true", "--force"))
        finally:
            database.dispose()
        _report(_report_local(report), dry_run=args.dry_run)
        return 0
    flags = {"force": str(args.force).lower(), "dry_run": str(args.dry_run).lower()}
    if args.ids:
        total = {"dry_run": args.dry_run, "runs": [], "bytes": 0, "rows": 0, "seconds": 0.0}
        for rid in args.ids:
            status, out = _http(args, "DELETE", f"/api/v1/runs/{rid}", flags)
            if status != 200:
                _report(total, dry_run=args.dry_run) if total["runs"] else None
                return _fail(f"run {rid}: {status} {out.get('detail', out)}".replace("force=true", "--force"))
            for k in ("runs",):
                total[k] += out[k]
            for k in ("bytes", "rows", "seconds"):
                total[k] += out[k]
        _report(total, dry_run=args.dry_run)
        return 0
    status, out = _http(args, "DELETE", "/api/v1/runs", {**flags, "project": args.project, "name": args.name,
                                                         "status": args.status, "older_than_s": older})
    if status != 200:
        return _fail(f"{status} {out.get('detail', out)}".replace("force=true", "--force"))
    _report(out, dry_run=args.dry_run)
    return 0


def run_projects_delete(args) -> int:
    if not args.dry_run and not args.yes:
        args.dry_run = True
        code = run_projects_delete(args)
        args.dry_run = False
        if code != 0:
            return code
        if not _confirm(args, f"project {args.project!r} with all its runs"):
            return 1
    if args.db:
        from gradwatch.server.lifecycle import delete

        database = _database(args.db)
        try:
            try:
                report = delete.delete_project(database, project=args.project, force=args.force,
                                               dry_run=args.dry_run, stall_seconds=_stall_seconds(args.db))
            except delete.RunStillSending as e:
                return _fail(str(e).replace("force=true", "--force"))
        finally:
            database.dispose()
        if report is None:
            return _fail(f"no project {args.project!r}")
        _report(_report_local(report, args.project), dry_run=args.dry_run)
        return 0
    status, out = _http(args, "DELETE", f"/api/v1/projects/{urllib.parse.quote(args.project, safe='')}",
                        {"force": str(args.force).lower(), "dry_run": str(args.dry_run).lower()})
    if status != 200:
        return _fail(f"{status} {out.get('detail', out)}".replace("force=true", "--force"))
    _report(out, dry_run=args.dry_run)
    return 0


# ----------------------------------------------------------------------------- backup / restore

def run_backup(args) -> int:
    from gradwatch.server.operations.settings import Settings
    from gradwatch.server.lifecycle.backup import backup

    url = Settings.from_env(db=args.db).database_url
    try:
        info = backup(url, args.out)
    except (FileExistsError, RuntimeError, ValueError) as e:
        return _fail(str(e))
    print(f"backed up {info.source} to {info.path}: {human_bytes(info.bytes)} in {info.seconds:.1f} s")
    return 0


def run_restore(args) -> int:
    from gradwatch.server.operations.settings import Settings
    from gradwatch.server.lifecycle.backup import restore

    url = Settings.from_env(db=args.db).database_url
    try:
        info = restore(args.backup, url)
    except (FileExistsError, FileNotFoundError, RuntimeError, ValueError, OSError) as e:
        return _fail(str(e))
    print(f"restored {info.path} into {info.source} in {info.seconds:.1f} s; start the server with --db on it "
          f"(it upgrades an older schema with --migrate)")
    return 0
