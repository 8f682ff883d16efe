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
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Mapping, Optional

from pydantic import BaseModel, Field, field_validator

from .ports import DEFAULT_PORT  # one definition, read by the standard-library-only CLI too

DEFAULT_HOST = "127.0.0.1"
# Seconds without data before a running run reads as stalled (and F2 fires): the one definition, read by
# the query layer, rule F2's default and the dashboard; GRADWATCH_STALL_SECONDS overrides it.
DEFAULT_STALL_SECONDS = 300.0


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
    # batches of one process inside their write transaction at once (server/write_gate.py);
    # 0: the database's default (1 on SQLite, 2 on PostgreSQL)
    write_concurrency: int = Field(default=0, ge=0, le=64)
    session_secret: str = ""

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
            stall_seconds=float(env.get("GRADWATCH_STALL_SECONDS", DEFAULT_STALL_SECONDS)),
            migrate=migrate,
            session_secret=env.get("GRADWATCH_SESSION_SECRET", ""),
            max_body_bytes=int(env.get("GRADWATCH_MAX_BODY_BYTES", 32 * 1024 * 1024)),
            max_decoded_bytes=int(env.get("GRADWATCH_MAX_DECODED_BYTES", 64 * 1024 * 1024)),
            write_concurrency=int(env.get("GRADWATCH_WRITE_CONCURRENCY", 0)),
        )
