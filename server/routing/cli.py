"""``gradwatch silence``: add, list and expire silences (the operator's side; no token needed).

    gradwatch silence add 'run=exp-42' 'rule=~"C.*"' --project nlp --duration 2h --comment "bad shard"
    gradwatch silence add 'severity=info' --duration 1d          # every project
    gradwatch silence list [--project nlp] [--all]
    gradwatch silence expire 3

The database is ``--db`` / ``GRADWATCH_DATABASE_URL`` / the default SQLite file, as for ``serve``.
A running server notices an expired silence within its worker's poll (a second).
Only standard-library imports at the top: building the CLI parser loads no server code.
"""
from __future__ import annotations

import argparse
import getpass
import sys
import time


def add_subparser(subparsers) -> None:
    p = subparsers.add_parser("silence", help="silence alerts by matchers for a while")
    p.add_argument("--db", help="database URL (default as for serve)")
    sub = p.add_subparsers(dest="silence_command", required=True)
    add = sub.add_parser("add", help="add a silence")
    add.add_argument("matchers", nargs="+", help="LABEL=VALUE, LABEL!=VALUE, LABEL=~REGEX, LABEL!~REGEX; labels: "
                                                  "project, run, rule, name, family, severity, rank")
    add.add_argument("--project", default=None, help="the project it belongs to (default: every project)")
    add.add_argument("--duration", default="2h", help="how long: 90s, 30m, 2h, 1d (default 2h)")
    add.add_argument("--comment", default="")
    add.add_argument("--created-by", default=None, help="default: your user name")
    ls = sub.add_parser("list", help="list silences (active and pending; --all: expired too)")
    ls.add_argument("--project", default=None)
    ls.add_argument("--all", action="store_true")
    ex = sub.add_parser("expire", help="end a silence now")
    ex.add_argument("silence_id", type=int)
    for sp in (add, ls, ex):
        sp.add_argument("--db", default=argparse.SUPPRESS, help="database URL (default as for serve)")
    p.set_defaults(func=run)


def _created_by(value) -> str:
    if value:
        return value
    try:
        return getpass.getuser()
    except Exception:  # noqa: BLE001 - no user name in this environment
        return ""


def run(args) -> int:
    from gradwatch.server.storage.db import open_database
    from gradwatch.server.storage.models import Project
    from gradwatch.server.routing import silences as data
    from gradwatch.server.operations.settings import Settings

    settings = Settings.from_env(db=args.db)
    database = open_database(settings.database_url)
    try:
        with database.write_sessionmaker() as s:
            cmd = args.silence_command
            if cmd == "add":
                row = data.create_silence(s, project=args.project, matchers=args.matchers,
                                          duration_s=data.parse_duration(args.duration),
                                          created_by=_created_by(args.created_by), comment=args.comment)
                s.commit()
                print(f"silence {row.id}: {' '.join(row.matchers)} until "
                      f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(row.ends_at))}"
                      f" ({args.project or 'every project'})")
            elif cmd == "list":
                for row in data.list_silences(s, project=args.project, active_only=not args.all):
                    d = data.silence_to_dict(row)
                    project = s.get(Project, row.project_id).name if row.project_id is not None else "*"
                    until = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(row.ends_at))
                    print(f"{row.id:>4}  {d['state']:<8} {project:<16} until {until}  {' '.join(row.matchers)}"
                          + (f"  by {row.created_by}" if row.created_by else "")
                          + (f"  ({row.comment})" if row.comment else ""))
            elif cmd == "expire":
                row = data.expire_silence(s, silence_id=args.silence_id)
                if row is None:
                    print(f"gradwatch silence: no silence {args.silence_id}", file=sys.stderr)
                    return 1
                s.commit()
                print(f"expired silence {row.id}")
    except ValueError as e:
        print(f"gradwatch silence: {e}", file=sys.stderr)
        return 2
    finally:
        database.dispose()
    return 0
