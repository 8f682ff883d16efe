"""``gradwatch webhooks``: manage per-project webhook endpoints and read the delivery log.

    gradwatch webhooks add --project vision --url https://hooks.slack.com/services/… --format slack \\
        --min-severity warning --secret s3cret
    gradwatch webhooks list [--project vision]
    gradwatch webhooks delete 3
    gradwatch webhooks test 3          # a sample alert; a running server's worker sends it within a second
    gradwatch webhooks log [--endpoint 3] [--limit 20]

The database is ``--db`` / ``GRADWATCH_DATABASE_URL`` / the default SQLite file, as for ``serve``.
"""
from __future__ import annotations

import argparse

import sys
import time

from gradwatch.server.webhooks.formats import FORMATS


def add_subparser(subparsers) -> None:
    p = subparsers.add_parser("webhooks", help="manage webhook endpoints and read the delivery log")
    p.add_argument("--db", help="database URL (default as for serve)")
    sub = p.add_subparsers(dest="webhooks_command", required=True)
    add = sub.add_parser("add", help="add an endpoint for a project")
    add.add_argument("--project", required=True)
    add.add_argument("--url", required=True)
    add.add_argument("--format", choices=FORMATS, default="json")
    add.add_argument("--min-severity", choices=("info", "warning", "critical"), default="info")
    add.add_argument("--secret", default=None, help="HMAC-SHA256 signing secret (see docs/webhooks.md)")
    ls = sub.add_parser("list", help="list endpoints")
    ls.add_argument("--project", default=None)
    rm = sub.add_parser("delete", help="delete an endpoint (its pending deliveries expire)")
    rm.add_argument("endpoint_id", type=int)
    test = sub.add_parser("test", help="queue a sample alert for an endpoint")
    test.add_argument("endpoint_id", type=int)
    log = sub.add_parser("log", help="the delivery log, newest first")
    log.add_argument("--endpoint", type=int, default=None)
    log.add_argument("--limit", type=int, default=20)
    for sp in (add, ls, rm, test, log):
        # --db also after the subcommand, as `gradwatch token ... --db URL` takes it; SUPPRESS keeps a
        # value given before the subcommand when none is given after
        sp.add_argument("--db", default=argparse.SUPPRESS, help="database URL (default as for serve)")
    p.set_defaults(func=run)


def run(args) -> int:
    from gradwatch.server.storage.db import open_database
    from gradwatch.server.operations.settings import Settings
    from gradwatch.server.webhooks import endpoints as ep

    settings = Settings.from_env(db=args.db)
    database = open_database(settings.database_url)
    try:
        with database.write_sessionmaker() as s:
            cmd = args.webhooks_command
            if cmd == "add":
                e = ep.create_endpoint(s, project=args.project, url=args.url, format=args.format,
                                       min_severity=args.min_severity, secret=args.secret)
                s.commit()
                print(f"endpoint {e.id}: {e.url} ({e.format}, {e.min_severity}+) for project {args.project}")
            elif cmd == "list":
                for e in ep.list_endpoints(s, project=args.project):
                    d = ep.endpoint_to_dict(e)
                    scope = "server-wide" if d["server_wide"] else f"project_id {d['project_id']}"
                    print(f"{e.id:>4}  {e.format:<8} {e.min_severity:<8} {'on ' if e.enabled else 'off'} "
                          f"{'signed' if e.secret else '      '}  {scope:<14} {e.url}")
            elif cmd == "delete":
                if not ep.delete_endpoint(s, endpoint_id=args.endpoint_id):
                    print(f"gradwatch webhooks: no endpoint {args.endpoint_id}", file=sys.stderr)
                    return 1
                s.commit()
                print(f"deleted endpoint {args.endpoint_id}")
            elif cmd == "test":
                try:
                    d = ep.send_test(s, endpoint_id=args.endpoint_id, settings=settings, now=time.time())
                except ValueError as e:
                    print(f"gradwatch webhooks: {e}", file=sys.stderr)
                    return 1
                s.commit()
                print(f"queued test delivery {d.id} to {d.url}; see `gradwatch webhooks log`")
            elif cmd == "log":
                for d in ep.list_deliveries(s, endpoint_id=args.endpoint, limit=args.limit):
                    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(d.created_at))
                    print(f"{d.id:>6}  {when}  {d.status:<9} attempts {d.attempts:<3} "
                          f"{d.last_status_code or '-':<4} alert {d.alert_id or 'test':<6} {d.url}"
                          + (f"  ({d.last_error[:80]})" if d.last_error and d.status != "delivered" else ""))
    except ValueError as e:
        print(f"gradwatch webhooks: {e}", file=sys.stderr)
        return 2
    finally:
        database.dispose()
    return 0
