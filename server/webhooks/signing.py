"""HMAC-SHA256 signatures for webhook bodies (leaf module).

Headers sent with every delivery to an endpoint that has a secret::

    X-Gradwatch-Timestamp: 1764406812          (unix seconds, when the request was sent)
    X-Gradwatch-Signature: sha256=<hex>       (HMAC-SHA256(secret, f"{timestamp}.{body}"))

A receiver recomputes the HMAC over the timestamp header, a literal ".", and
the raw body bytes, compares with ``hmac.compare_digest``, and rejects
timestamps older than a few minutes (replay protection). See docs/webhooks.md.
"""
from __future__ import annotations

import hashlib
import hmac
import time
from typing import Optional

TIMESTAMP_HEADER = "X-Gradwatch-Timestamp"
SIGNATURE_HEADER = "X-Gradwatch-Signature"


def signature(secret: str, timestamp: int | str, body: bytes) -> str:
    mac = hmac.new(secret.encode(), f"{timestamp}.".encode() + body, hashlib.sha256)
    return "sha256=" + mac.hexdigest()


def sign_headers(secret: Optional[str], body: bytes, *, now: Optional[float] = None) -> dict[str, str]:
    """The timestamp header always; the signature header when there is a secret."""
    ts = str(int(time.time() if now is None else now))
    headers = {TIMESTAMP_HEADER: ts}
    if secret:
        headers[SIGNATURE_HEADER] = signature(secret, ts, body)
    return headers


def verify(secret: str, headers: dict[str, str], body: bytes, *, tolerance_s: float = 300.0,
           now: Optional[float] = None) -> bool:
    """What a receiver does (header names case-insensitive)."""
    lower = {k.lower(): v for k, v in headers.items()}
    ts = lower.get(TIMESTAMP_HEADER.lower())
    sig = lower.get(SIGNATURE_HEADER.lower())
    if not ts or not sig or not ts.isdigit():
        return False
    if abs((time.time() if now is None else now) - int(ts)) > tolerance_s:
        return False
    return hmac.compare_digest(signature(secret, ts, body), sig)
