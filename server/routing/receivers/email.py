"""Email over SMTP: the ``email = [...]`` of a receiver, sent by the delivery worker from the outbox.

An email notification is an outbox row like a webhook delivery (``url`` = ``mailto:a@x,b@y``, body =
``{"to", "subject", "text"}``), so it is retried with the same backoff and survives restarts. The
server's SMTP settings come from the environment:

- ``GRADWATCH_SMTP_HOST`` (required to send), ``GRADWATCH_SMTP_PORT`` (default 587 with STARTTLS, else 25)
- ``GRADWATCH_SMTP_FROM`` (default ``gradwatch@<host name>``)
- ``GRADWATCH_SMTP_STARTTLS`` ``on`` | ``off`` (default ``on``)
- ``GRADWATCH_SMTP_USER`` / ``GRADWATCH_SMTP_PASSWORD`` (login when both are set)
"""
from __future__ import annotations

import asyncio
import json
import smtplib
import socket
import ssl
from dataclasses import dataclass
from email.message import EmailMessage
from typing import Mapping, Optional

_TRUE = ("on", "1", "true", "yes")


@dataclass(frozen=True)
class SmtpSettings:
    host: str = ""
    port: int = 587
    sender: str = ""
    starttls: bool = True
    user: str = ""
    password: str = ""
    timeout: float = 10.0

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> "SmtpSettings":
        starttls = env.get("GRADWATCH_SMTP_STARTTLS", "on").strip().lower() in _TRUE
        port = env.get("GRADWATCH_SMTP_PORT", "")
        try:
            port = int(port) if port else (587 if starttls else 25)
        except ValueError:
            port = -1
        if not 1 <= port <= 65535:
            raise ValueError(f"GRADWATCH_SMTP_PORT={env.get('GRADWATCH_SMTP_PORT')!r}: expected a port number "
                             f"from 1 to 65535")
        sender = env.get("GRADWATCH_SMTP_FROM", "").strip()
        if any(ord(c) < 32 or ord(c) == 127 for c in sender):
            raise ValueError(f"GRADWATCH_SMTP_FROM={sender!r}: one address without control characters")
        return cls(host=env.get("GRADWATCH_SMTP_HOST", "").strip(), port=port,
                   sender=sender or f"gradwatch@{socket.gethostname()}",
                   starttls=starttls, user=env.get("GRADWATCH_SMTP_USER", ""),
                   password=env.get("GRADWATCH_SMTP_PASSWORD", ""))


class EmailSender:
    """``await sender(url, body)`` → (250, None) when the server accepted it, else (None, error)."""

    def __init__(self, settings: SmtpSettings, *, smtp=smtplib.SMTP):
        self.settings = settings
        self._smtp = smtp

    async def __call__(self, url: str, body: str) -> tuple[Optional[int], Optional[str]]:
        return await asyncio.to_thread(self.send, url, body)

    def send(self, url: str, body: str) -> tuple[Optional[int], Optional[str]]:
        s = self.settings
        if not s.host:
            return None, "email: GRADWATCH_SMTP_HOST is not set"
        try:
            doc = json.loads(body)
            msg = EmailMessage()
            msg["From"] = s.sender
            msg["To"] = ", ".join(doc["to"])
            msg["Subject"] = doc["subject"]
            msg.set_content(doc["text"])
        except (ValueError, KeyError, TypeError) as e:
            return None, f"email: bad outbox body: {e}"
        try:
            with self._smtp(s.host, s.port, timeout=s.timeout) as smtp:
                if s.starttls:
                    smtp.starttls(context=ssl.create_default_context())
                if s.user and s.password:
                    smtp.login(s.user, s.password)
                # some recipients refused, others accepted: sent (a retry would mail the accepted ones twice);
                # all refused raises SMTPRecipientsRefused and is retried
                smtp.send_message(msg)
        except (smtplib.SMTPException, OSError) as e:
            return None, f"email: {type(e).__name__}: {e}"
        return 250, None
