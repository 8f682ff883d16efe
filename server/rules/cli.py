"""``gradwatch rules``: print the catalogue with the thresholds in force.

    gradwatch rules                           # defaults
    gradwatch rules --rules rules.toml --project vision
    gradwatch rules --db postgresql://… --project vision   # API overrides stored there too
    gradwatch rules --json
    gradwatch rules --markdown                # the catalogue section of docs/rules.md

A bad rules file exits with status 2 and a message naming the rule and the key.
"""
from __future__ import annotations

import json
import os
import sys
from typing import Any

from gradwatch.server.rules.catalogue import COMMON_PARAMS, RULES, RULES_BY_ID, describe
from gradwatch.server.rules.config import RuleConfigError, effective_config, get_rule_config, load_rules_file


def add_subparser(subparsers) -> None:
    p = subparsers.add_parser("rules", help="print the rule catalogue with the thresholds in force")
    p.add_argument("--rules", metavar="FILE", default=os.environ.get("GRADWATCH_RULES"),
                   help="rules file (TOML) to apply and validate (env GRADWATCH_RULES)")
    p.add_argument("--project", default="default", help="project whose settings to show (default: default)")
    p.add_argument("--db", default=None, help="database URL: also apply the project's API overrides stored there")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--markdown", action="store_true", help="the catalogue as docs/rules.md lists it (defaults)")
    p.set_defaults(func=run)


class _FileSettings:
    def __init__(self, rules_file, stall_seconds=None):
        self.rules_file = rules_file
        self.stall_seconds = stall_seconds


def catalogue_markdown() -> str:
    """The catalogue section of docs/rules.md, from the registered rules' declarations (defaults)."""
    out = []
    for r in RULES:
        c = r.defaults()
        own = [f"`{k}` = {_fmt(v)}" for k, v in r.params.items() if k not in COMMON_PARAMS]
        common = ", ".join(f"`{k}` = {c[k]}" for k in ("clear_steps", "cooldown_steps"))
        out += [f"### {r.id} {r.name} — {r.severity} (checklist {r.checklist})", "",
                f"**Fires when** {describe(r, c)}.", "",
                f"**Settings** {', '.join(own) if own else 'none of its own'}; {common}.", "",
                f"**Tells the user** {r.diagnosis}", "", *[f"- {a}" for a in r.actions], ""]
    return "\n".join(out)


def run(args) -> int:
    if getattr(args, "markdown", False):
        print(catalogue_markdown(), end="")
        return 0
    try:
        load_rules_file(args.rules)
        settings = _FileSettings(args.rules, float(os.environ["GRADWATCH_STALL_SECONDS"])
                                 if os.environ.get("GRADWATCH_STALL_SECONDS") else None)
        if args.db:
            from gradwatch.server.storage.db import open_database
            from gradwatch.server.operations.settings import normalize_db_url

            database = open_database(normalize_db_url(args.db))
            try:
                with database.sessionmaker() as s:
                    cfg = {rid: v for rid, v in get_rule_config(s, project=args.project, settings=settings).items()}
            finally:
                database.dispose()
        else:
            cfg = effective_config(None, project_id=None, project_name=args.project, settings=settings)
    except RuleConfigError as e:
        print(f"gradwatch rules: {e}", file=sys.stderr)
        return 2
    if args.json:
        out = [{**{k: v for k, v in cfg[r.id].items() if k != "overridden"}, "id": r.id, "name": r.name,
                "fires_when": describe(r, cfg[r.id]), "diagnosis": r.diagnosis, "actions": list(r.actions)}
               for r in RULES]
        print(json.dumps({"project": args.project, "rules_file": args.rules, "rules": out}, indent=2))
        return 0
    print(f"gradwatch rule catalogue — project {args.project!r}"
          + (f", rules file {args.rules}" if args.rules else "") + (" (+ API overrides)" if args.db else ""))
    for r in RULES:
        c = cfg[r.id]
        state = "on " if c.get("enabled", True) else "OFF"
        thresholds = ", ".join(f"{k}={_fmt(v)}" for k, v in c.items()
                               if k not in ("id", "name", "enabled", "severity", "overridden")
                               and k not in COMMON_PARAMS)
        common = ", ".join(f"{k}={c[k]}" for k in ("clear_steps", "cooldown_steps"))
        print(f"\n{r.id:<3} {r.name:<20} [{state}] {c.get('severity'):<8} checklist {r.checklist}")
        print(f"    fires when: {describe(r, c)}")
        print(f"    thresholds: {thresholds or '-'}; lifecycle: {common}")
        print(f"    tells:      {RULES_BY_ID[r.id].diagnosis}")
    return 0


def _fmt(v: Any) -> str:
    return f"{v:g}" if isinstance(v, float) else str(v)
