"""Server settings: one pydantic model built from the environment and CLI flags.

Leaf module. Nothing here runs at import time; ``Settings.from_env(...)`` is
called by the CLI (or a test) and the result is handed to ``create_app``.

Environment:

- ``GRADWATCH_DATA_DIR``      data directory (default ``~/.gradwatch``); the
  embedded SQLite file lives there
- ``GRADWATCH_DATABASE_URL``  SQLAlchemy URL (``postgresql://…`` for scale)
- ``GRADWATCH_WEBHOOK_URLS``  comma-separated server-wide webhook URLs
- ``GRADWATCH_PUBLIC_URL``    base URL used in webhook links
- ``GRADWATCH_AUTH``          ``on`` to require project tokens
- ``GRADWATCH_ROUTING``       routing file: receivers, routes, grouping, inhibitions (docs/webhooks.md)
- ``GRADWATCH_STALL_SECONDS`` seconds without data before a running run reads as stalled
- ``GRADWATCH_MAX_BODY_BYTES`` / ``GRADWATCH_MAX_DECODED_BYTES`` ingest size limits (413 above)
- ``GRADWATCH_WRITE_CONCURRENCY`` batches in their write transaction at once (0: the database's default)
- ``GRADWATCH_HEAVY_READ_BUDGET_MB`` memory the heavy reads (heatmaps) may hold at once (default 384)

A value out of range stops the server at start with ``SettingsError`` naming the setting, the value
and the range (docs/deployment.md, "Settings").
"""
from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Mapping, Optional

from pydantic import BaseModel, Field, field_validator

from gradwatch.server.operations.ports import DEFAULT_PORT  # one definition, read by the standard-library-only CLI too

DEFAULT_HOST = "127.0.0.1"
# Seconds without data before a running run reads as stalled (and F2 fires): the one definition, read by
# the query layer, rule F2's default and the dashboard; GRADWATCH_STALL_SECONDS overrides it.
DEFAULT_STALL_SECONDS = 300.0


class SettingsError(ValueError):
    """An operator setting that cannot be used: the message names the setting, the value and the range."""


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


def env_number(env: Mapping[str, str], name: str, default: float, *, lo: float, hi: float,
               whole: bool = False, lo_open: bool = False) -> float:
    """``env[name]`` as a number within [lo, hi] (``lo_open``: above lo), or ``SettingsError`` saying so.

    Every numeric ``GRADWATCH_*`` variable goes through here when the server starts: 0, a negative
    number, ``nan`` or ``inf`` in a pacing setting made a background thread spin.

    >>> env_number({"GRADWATCH_RETENTION_INTERVAL": "nan"}, "GRADWATCH_RETENTION_INTERVAL", 600, lo=1, hi=86400)
    Traceback (most recent call last):
    ...
    gradwatch.server.operations.settings.SettingsError: GRADWATCH_RETENTION_INTERVAL='nan': expected a number from 1 to 86400
    """
    raw = env.get(name)
    if raw is None or str(raw).strip() == "":
        return default
    text = str(raw).strip()
    try:
        value = int(text) if whole else float(text)
    except ValueError:
        value = None
    fits = value is not None and math.isfinite(value) and (value > lo if lo_open else value >= lo) and value <= hi
    if not fits:
        what = "a whole number" if whole else "a number"
        bounds = f"above {_num(lo)} and at most {_num(hi)}" if lo_open else f"from {_num(lo)} to {_num(hi)}"
        raise SettingsError(f"{name}={text!r}: expected {what} {bounds}")
    return value


def default_data_dir(env: Mapping[str, str]) -> Path:
    raw = env.get("GRADWATCH_DATA_DIR")
    return Path(raw).expanduser() if raw else Path.home() / ".gradwatch"


def normalize_db_url(url: str) -> str:
    """``postgresql://`` and ``postgres://`` mean the psycopg 3 driver here."""
    for prefix in ("postgres://", "postgresql://"):
        if url.startswith(prefix):
            return "postgresql+psycopg://" + url[len(prefix):]
    return url


class Settings(BaseModel):
    """Everything the server needs to know; immutable once built."""

    model_config = {"frozen": True}

    data_dir: Path
    database_url: str
    # True when the database is the embedded default (upgraded automatically on serve).
    embedded_db: bool = False
    host: str = DEFAULT_HOST
    port: int = Field(default=DEFAULT_PORT, ge=0, le=65535)
    webhook_urls: tuple[str, ...] = ()
    # hosts, addresses or networks (CIDR) that project webhooks may target although internal
    webhook_allow: tuple[str, ...] = ()
    public_url: str = ""
    rules_file: Optional[Path] = None
    # receivers, routes, group timers, inhibitions (server/routing/config.py); None: every alert to every endpoint
    routing_file: Optional[Path] = None
    auth: bool = False
    stall_seconds: float = Field(default=DEFAULT_STALL_SECONDS, gt=0)
    migrate: bool = False
    # Ingest limits: compressed body and decompressed body, in bytes.
    max_body_bytes: int = 32 * 1024 * 1024
    max_decoded_bytes: int = 64 * 1024 * 1024
    # batches of one process inside their write transaction at once (server/ingest/write_gate.py);
    # 0: the database's default (1 on SQLite, 2 on PostgreSQL)
    write_concurrency: int = Field(default=0, ge=0, le=64)
    session_secret: str = ""
    # bytes the heavy reads (per-layer heatmaps) of this process may hold at once (server/queries/admission.py);
    # GRADWATCH_HEAVY_READ_BUDGET_MB
    heavy_read_budget_bytes: int = Field(default=384 * 1024 * 1024, ge=16 * 1024 * 1024)

    @field_validator("database_url")
    @classmethod
    def _url(cls, v: str) -> str:
        return normalize_db_url(v)

    @property
    def dialect(self) -> str:
        return "sqlite" if self.database_url.startswith("sqlite") else "postgresql"

    @property
    def checks_webhook_targets(self) -> bool:
        """Whether webhook endpoints added through the API or the dashboard are checked
        (server/webhooks/targets.py): always with auth on; with auth off, unless the server listens on
        loopback only, where whoever can reach it already runs on this machine."""
        return self.auth or self.host not in ("127.0.0.1", "localhost", "::1")

    @property
    def dashboard_base(self) -> str:
        return (self.public_url or f"http://{self.host}:{self.port}").rstrip("/")

    @classmethod
    def from_env(
        cls,
        env: Optional[Mapping[str, str]] = None,
        *,
        db: Optional[str] = None,
        host: Optional[str] = None,
        port: Optional[int] = None,
        webhooks: Optional[list[str]] = None,
        rules_file: Optional[str] = None,
        routing_file: Optional[str] = None,
        migrate: bool = False,
        auth: Optional[bool] = None,
    ) -> "Settings":
        """Environment first, CLI flags override. ``env`` defaults to ``os.environ``."""
        env = os.environ if env is None else env
        data_dir = default_data_dir(env)
        url = db or env.get("GRADWATCH_DATABASE_URL")
        embedded = not url
        if embedded:
            url = f"sqlite:///{data_dir / 'gradwatch.db'}"
        hooks = list(webhooks or [])
        hooks += [u.strip() for u in env.get("GRADWATCH_WEBHOOK_URLS", "").split(",") if u.strip()]
        host = host or env.get("GRADWATCH_HOST") or DEFAULT_HOST
        port = DEFAULT_PORT if port is None else port
        if auth is None:
            auth = env.get("GRADWATCH_AUTH", "off").strip().lower() in ("on", "1", "true", "yes")
        return cls(
            data_dir=data_dir,
            database_url=url,
            embedded_db=embedded,
            host=host,
            port=port,
            webhook_urls=tuple(dict.fromkeys(hooks)),
            webhook_allow=tuple(a.strip() for a in env.get("GRADWATCH_WEBHOOK_ALLOW", "").split(",") if a.strip()),
            public_url=env.get("GRADWATCH_PUBLIC_URL", "").rstrip("/"),
            rules_file=Path(rules_file) if rules_file else (Path(env["GRADWATCH_RULES"]) if env.get("GRADWATCH_RULES") else None),
            routing_file=Path(routing_file or env["GRADWATCH_ROUTING"])
            if (routing_file or env.get("GRADWATCH_ROUTING")) else None,
            auth=auth,
            stall_seconds=env_number(env, "GRADWATCH_STALL_SECONDS", DEFAULT_STALL_SECONDS, lo=1, hi=30 * 86400),
            migrate=migrate,
            session_secret=env.get("GRADWATCH_SESSION_SECRET", ""),
            max_body_bytes=env_number(env, "GRADWATCH_MAX_BODY_BYTES", 32 * 1024 * 1024, lo=1024, hi=2 ** 31,
                                      whole=True),
            max_decoded_bytes=env_number(env, "GRADWATCH_MAX_DECODED_BYTES", 64 * 1024 * 1024, lo=1024,
                                         hi=2 ** 31, whole=True),
            write_concurrency=env_number(env, "GRADWATCH_WRITE_CONCURRENCY", 0, lo=0, hi=64, whole=True),
            heavy_read_budget_bytes=env_number(env, "GRADWATCH_HEAVY_READ_BUDGET_MB", 384, lo=16, hi=1 << 20,
                                               whole=True) * 1024 * 1024,
        )
