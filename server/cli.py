"""The ``gradwatch`` console script (also ``python -m gradwatch.server``).

Each subcommand is one ``add_<name>(subparsers)`` function that registers its
parser and sets ``func``; adding a subcommand is one function plus one line
in ``SUBCOMMANDS`` (or a module's own ``add_subparser``, listed with
:func:`_module`, like ``gradwatch.server.commands.demo``).

This module imports the standard library only, at import and while building the
parser: the same ``gradwatch`` runs on a training node that has the agent only
(``gradwatch sync``), on a monitoring host without torch, and in development. A
command whose packages are missing says in one line which extra installs them
(:mod:`gradwatch.server.commands.extras`).
"""
from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from typing import Callable, Optional

from gradwatch.server.commands.extras import install_hint
from gradwatch.server.operations.ports import DEFAULT_PORT, port_problem


def _eprint(*args) -> None:
    print(*args, file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- serve

def add_serve(subparsers) -> None:
    p = subparsers.add_parser("serve", help="run the API server and the dashboard on one port")
    p.add_argument("--db", help="database URL (default: SQLite under $GRADWATCH_DATA_DIR or ~/.gradwatch; "
                                "env GRADWATCH_DATABASE_URL)")
    p.add_argument("--host", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=None, help=f"port (default {DEFAULT_PORT})")
    p.add_argument("--webhook", action="append", default=[], metavar="URL",
                   help="server-wide webhook URL (repeatable; env GRADWATCH_WEBHOOK_URLS)")
    p.add_argument("--rules", metavar="FILE", help="rule configuration file")
    p.add_argument("--routing", metavar="FILE", help="alert routing file: receivers, routes, grouping, inhibitions "
                                                     "(env GRADWATCH_ROUTING; docs/webhooks.md)")
    p.add_argument("--migrate", action="store_true", help="apply pending migrations before starting")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.set_defaults(func=run_serve)


def _prepare_schema(settings) -> None:
    from gradwatch.server.storage.db import prepare_schema

    prepare_schema(settings.database_url, upgrade_old=settings.embedded_db or settings.migrate)


def check_operator_env(settings, env=None) -> None:
    """Every other operator setting read from the environment, checked before the server starts
    (the retention job's pacing and policy, SMTP, the routing file): ``SettingsError`` naming the
    setting, the value and what it may be, instead of a thread that spins or a notification that
    fails later. Here, at the top, because it reads the settings of rooms below operations/
    (lifecycle, routing), which import the settings themselves."""
    from gradwatch.server.lifecycle.retention_config import JobSettings, RetentionConfigError, load_retention
    from gradwatch.server.operations.settings import SettingsError
    from gradwatch.server.routing.config import RoutingConfigError, routing_of
    from gradwatch.server.routing.receivers.email import SmtpSettings

    env = os.environ if env is None else env
    try:
        JobSettings.from_env(env)
        load_retention(env)
        SmtpSettings.from_env(env)
        routing_of(settings)
    except (RetentionConfigError, RoutingConfigError, ValueError) as e:
        raise SettingsError(str(e)) from None


def run_serve(args) -> int:
    import uvicorn

    from gradwatch.server.app import check_schema, create_app, SchemaOutOfDate
    from gradwatch.server.storage.db import open_database
    from gradwatch.server.operations.settings import Settings

    settings = Settings.from_env(db=args.db, host=args.host, port=args.port, webhooks=args.webhook,
                                 rules_file=args.rules, routing_file=args.routing, migrate=args.migrate)
    check_operator_env(settings)     # every setting checked before anything starts (SettingsError: one line)
    _prepare_schema(settings)
    database = open_database(settings.database_url)
    try:
        check_schema(database, settings)
    except SchemaOutOfDate as e:
        database.dispose()
        _eprint(f"gradwatch: refusing to start: {e}")
        return 2
    if settings.auth:
        _eprint("gradwatch: auth is on: the API needs a project token, the dashboard a login at /login")
    else:
        where = "only this machine can reach it" if settings.host in ("127.0.0.1", "localhost", "::1") else \
            f"ANYONE who can reach {settings.host} can read and write data"
        _eprint(f"gradwatch: auth is off (GRADWATCH_AUTH=on to require project tokens); "
                f"listening on {settings.host}:{settings.port}, {where}")
    busy = port_problem(settings.host, settings.port)
    if busy:
        database.dispose()
        _eprint(f"gradwatch: cannot listen on {settings.host}:{settings.port} ({busy}); "
                f"pass --port with a free port, or stop what is using it")
        return 2
    _eprint(f"gradwatch: database {database.dialect}; dashboard at http://{settings.host}:{settings.port}/")
    app = create_app(settings, database=database)
    _tune_gc_for_serving()
    uvicorn.run(app, host=settings.host, port=settings.port, log_level=args.log_level,
                access_log=args.log_level == "debug", timeout_graceful_shutdown=5)
    return 0


def _tune_gc_for_serving() -> None:
    """Keep Python's cyclic garbage collector off the ingest tail.

    With the default thresholds (a collection every 700 net allocations) an ingest batch, which
    allocates hundreds of thousands of short-lived objects, triggers dozens of collections, and the
    full ones walk every object the process holds: Dash, plotly and SQLAlchemy bring several hundred
    thousand. Measured at 1,000,000 values/s on PostgreSQL (bench/ingest.py --rate, 8 agents): p99
    165-185 ms with the defaults, 67-74 ms with this, and 8-10 % less server CPU. Objects alive after
    start-up are moved out of the collector's sight (``gc.freeze``); collections are rarer. Reference
    counting still frees almost everything at once; only reference cycles wait a little longer.
    """
    import gc

    gc.collect()
    gc.freeze()
    gc.set_threshold(50_000, 20, 100)


# --------------------------------------------------------------------------- db

def add_db(subparsers) -> None:
    p = subparsers.add_parser("db", help="database schema management")
    sub = p.add_subparsers(dest="db_command", required=True)
    up = sub.add_parser("upgrade", help="apply all pending migrations")
    up.add_argument("--db", help="database URL (default: as for serve)")
    up.add_argument("--revision", default="head")
    up.set_defaults(func=run_db_upgrade)
    chk = sub.add_parser("check", help="exit 0 if the schema is current, 1 if not")
    chk.add_argument("--db", help="database URL (default: as for serve)")
    chk.set_defaults(func=run_db_check)


def run_db_upgrade(args) -> int:
    from gradwatch.server.storage.db import upgrade
    from gradwatch.server.operations.settings import Settings

    settings = Settings.from_env(db=args.db)
    upgrade(settings.database_url, args.revision)
    print(f"gradwatch: database at {args.revision} ({settings.dialect})")
    return 0


def run_db_check(args) -> int:
    from gradwatch.server.storage.db import make_engine, schema_problem
    from gradwatch.server.operations.settings import Settings

    settings = Settings.from_env(db=args.db)
    engine = make_engine(settings.database_url)
    try:
        problem = schema_problem(engine, settings.database_url)
    finally:
        engine.dispose()
    if problem:
        print(f"gradwatch: {problem}; run: gradwatch db upgrade --db {settings.database_url}")
        return 1
    print("gradwatch: schema is current")
    return 0


# --------------------------------------------------------------------------- token

def add_token(subparsers) -> None:
    p = subparsers.add_parser("token", help="project API tokens (used when GRADWATCH_AUTH=on)")
    sub = p.add_subparsers(dest="token_command", required=True)
    create = sub.add_parser("create", help="create a token for a project (created if new); prints it once")
    create.add_argument("--project", required=True)
    create.add_argument("--name", default="", help="a label, e.g. who or what uses it")
    create.add_argument("--db", help="database URL (default: as for serve)")
    create.set_defaults(func=run_token_create)
    lst = sub.add_parser("list", help="list tokens (ids, projects, labels; never the secrets)")
    lst.add_argument("--project")
    lst.add_argument("--db")
    lst.set_defaults(func=run_token_list)
    rm = sub.add_parser("delete", help="revoke a token by id")
    rm.add_argument("id", type=int)
    rm.add_argument("--db")
    rm.set_defaults(func=run_token_delete)


def _token_db(args):
    from gradwatch.server.storage.db import open_database
    from gradwatch.server.operations.settings import Settings

    settings = Settings.from_env(db=args.db)
    _prepare_schema(settings)
    return open_database(settings.database_url)


def run_token_create(args) -> int:
    from gradwatch.server.access.tokens import create_token

    database = _token_db(args)
    try:
        with database.write_sessionmaker() as session:
            secret = create_token(session, project=args.project, name=args.name)
            session.commit()
    finally:
        database.dispose()
    print(secret)
    _eprint(f"gradwatch: token for project {args.project!r} (shown once; only its hash is stored)")
    return 0


def run_token_list(args) -> int:
    from gradwatch.server.access.tokens import list_tokens

    database = _token_db(args)
    try:
        with database.sessionmaker() as session:
            for t in list_tokens(session, project=args.project):
                print(f"{t.id}\t{t.project}\t{t.name}\tcreated {_utc(t.created_at)}\t"
                      f"last used {_utc(t.last_used_at) if t.last_used_at else 'never'}")
    finally:
        database.dispose()
    return 0


def _utc(ts: float) -> str:
    import datetime

    return datetime.datetime.fromtimestamp(ts, datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def run_token_delete(args) -> int:
    from gradwatch.server.access.tokens import delete_token

    database = _token_db(args)
    try:
        with database.write_sessionmaker() as session:
            ok = delete_token(session, token_id=args.id)
            session.commit()
    finally:
        database.dispose()
    if not ok:
        _eprint(f"gradwatch: no token {args.id}")
        return 1
    return 0


# --------------------------------------------------------------------------- main

def _module(module: str, name: str, help: str) -> Callable:
    """The subcommand ``name`` that ``module``'s ``add_subparser`` registers.

    If the module cannot be imported for want of an extra's package (none should at import time,
    but a subcommand must never take the whole CLI down), ``name`` is still listed and says in one
    line what to install.
    """
    def add(subparsers) -> None:
        try:
            mod = importlib.import_module(module, __package__)
        except ModuleNotFoundError as e:
            hint = install_hint(name, e)
            if hint is None:
                raise
            p = subparsers.add_parser(name, help=f"{help} (not installed here)", add_help=False)
            p.add_argument("rest", nargs=argparse.REMAINDER)
            p.set_defaults(func=lambda args: (_eprint(hint), 2)[1])
            return
        mod.add_subparser(subparsers)
    return add


SUBCOMMANDS: list[Callable] = [
    add_serve, add_db, add_token,
    _module(".commands.demo", "demo", "run the server, the dashboard and a demo training job that goes bad"),
    _module(".rules.cli", "rules", "the rule catalogue and a rule configuration's effective values"),
    _module(".commands.export", "export", "a run's data as CSV / JSON lines / Parquet"),
    _module(".commands.spool_sync", "sync", "upload an agent's offline spool"),
    _module(".webhooks.cli", "webhooks", "webhook endpoints and deliveries"),
    _module(".importers.cli", "import", "runs logged by TensorBoard or W&B, turned into gradwatch runs"),
    _module(".routing.cli", "silence", "silences: mute alerts matching labels until they expire"),
    # registers runs, projects, backup and restore
    _module(".lifecycle.cli", "runs", "list runs with their sizes, delete runs and projects, back up and restore"),
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gradwatch", description="training-stability monitoring server")
    subparsers = parser.add_subparsers(dest="command", required=True)
    for add in SUBCOMMANDS:
        add(subparsers)
    return parser


def main(argv: Optional[list[str]] = None) -> int:
    logging.basicConfig(level=os.environ.get("GRADWATCH_LOG_LEVEL", "INFO").upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("alembic").setLevel(logging.WARNING)
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except ModuleNotFoundError as e:
        hint = install_hint(args.command, e)
        if hint is None:
            raise
        _eprint(hint)
        return 2
    except Exception as e:  # noqa: BLE001 - one readable line for the errors a user can fix
        from sqlalchemy.exc import ArgumentError, OperationalError

        from gradwatch.server.operations.settings import SettingsError

        if isinstance(e, SettingsError):
            _eprint(f"gradwatch: refusing to start: {e}")
            return 2

        if isinstance(e, OperationalError):
            first = str(e.orig).strip().splitlines()[0] if e.orig is not None else str(e).splitlines()[0]
            _eprint(f"gradwatch: cannot use the database: {first}. Check --db / GRADWATCH_DATABASE_URL "
                    f"and that the database server is running and reachable.")
            return 1
        if isinstance(e, ArgumentError):
            _eprint(f"gradwatch: bad database URL: {e}. Use sqlite:///path/to/file.db or "
                    f"postgresql://user:password@host:5432/dbname")
            return 2
        raise
