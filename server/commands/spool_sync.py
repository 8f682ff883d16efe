"""``gradwatch sync [DIR]``: upload an agent spool with ``agent.sync.sync_spool``.

A spool holds the batches of runs in ``GRADWATCH_MODE=offline`` (e.g. a
machine without access to the server: copy its spool directory over) and the
batches a run could not deliver before it ended. Batches go oldest first per
run and rank; each accepted file is deleted, so a second sync resumes where
the first stopped, and a batch that had already arrived is recognised by its
batch id and not stored twice.

Only the agent's torch-free modules are used (``agent.sync``, ``agent.spool``,
``agent.transport``; ``agent`` imports torch on first ``attach``), so it also
runs in the server image: copy an offline machine's spool next to the server
and sync it there.
"""
from __future__ import annotations

import os
import sys


def add_subparser(subparsers) -> None:
    p = subparsers.add_parser(
        "sync",
        help="upload an agent spool (offline runs, batches left while the server was down)",
        description="Send every batch spooled under DIR to the server, oldest first per run and rank; "
                    "each accepted file is deleted, so running it again resumes where it stopped.",
        epilog="Example: gradwatch sync ~/.cache/gradwatch/spool --server http://gw.internal:8470",
    )
    p.add_argument("directory", nargs="?", metavar="DIR",
                   help="spool directory (default: $GRADWATCH_SPOOL_DIR or ~/.cache/gradwatch/spool)")
    p.add_argument("--server", help="server URL (default: $GRADWATCH_SERVER or http://127.0.0.1:8470)")
    p.add_argument("--token", help="API token when the server has auth on (default: $GRADWATCH_TOKEN)")
    p.add_argument("--timeout", type=float, default=30.0, help="seconds per request (default 30)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


def _eprint(*args) -> None:
    print(*args, file=sys.stderr, flush=True)


def run(args) -> int:
    try:
        from gradwatch.agent.config import DEFAULT_SERVER, default_spool_dir
        from gradwatch.agent.sync import sync_spool
    except ImportError as e:
        _eprint(f"gradwatch sync: the agent package is missing ({e}); install gradwatch")
        return 1
    explicit = args.directory is not None
    directory = os.path.expanduser(args.directory or os.environ.get("GRADWATCH_SPOOL_DIR") or default_spool_dir())
    server = (args.server or os.environ.get("GRADWATCH_SERVER") or DEFAULT_SERVER).rstrip("/")
    if not server.startswith(("http://", "https://")):
        _eprint(f"gradwatch sync: --server {server!r}: give an http:// or https:// URL, e.g. {DEFAULT_SERVER}")
        return 2
    if not os.path.isdir(directory):
        if explicit:
            _eprint(f"gradwatch sync: {directory} is not a directory; give the spool directory "
                    f"(the agent's spool_dir, default {default_spool_dir()})")
            return 1
        _eprint(f"gradwatch sync: nothing to send ({directory} does not exist)")
        return 0
    token = args.token or os.environ.get("GRADWATCH_TOKEN") or None
    result = sync_spool(directory, server, token=token, progress=not args.quiet, timeout=args.timeout)
    for line in result.errors:
        _eprint(f"gradwatch sync: {line}")
    _eprint(f"gradwatch sync: {result.sent} batch(es) sent ({result.steps} steps), {result.duplicates} already "
            f"there, {result.rejected} rejected, {result.failed} left for the next sync")
    if result.ok:
        return 0
    text = " ".join(result.errors)
    if " 401 " in text or " 403 " in text or "answered 401" in text or "answered 403" in text:
        _eprint("gradwatch sync: the server requires a token: pass --token or set GRADWATCH_TOKEN to a token "
                "of the runs' project (gradwatch token create --project NAME)")
    elif "answered nothing" in text:
        _eprint(f"gradwatch sync: no answer from {server}; is `gradwatch serve` running there? "
                f"The batches stay in {directory}.")
    return 1
