"""`gradwatch demo`: server + dashboard on SQLite + a demo training run. PLACEHOLDER."""
from __future__ import annotations


def add_subparser(subparsers) -> None:
    p = subparsers.add_parser("demo", help="run the server, the dashboard and a demo training job that goes bad")
    p.set_defaults(func=run)


def run(args) -> int:
    raise SystemExit("demo not implemented yet")
