"""HTTP delivery of one batch body to ``POST /api/v1/ingest``.

Leaf module: standard library only (``agent.sync`` uses it outside training too).

Example::

    >>> t = HttpTransport("http://127.0.0.1:8470", token="s3cret", timeout=2.0)
    >>> t.endpoint
    'http://127.0.0.1:8470/api/v1/ingest'
"""
from __future__ import annotations

import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Optional

INGEST_PATH = "/api/v1/ingest"


@dataclass
class Delivery:
    """What the server said about one batch."""

    status: int          # HTTP status; 0 when no answer came (refused, timed out, reset)
    body: str = ""

    @property
    def accepted(self) -> bool:
        return 200 <= self.status < 300

    @property
    def retryable(self) -> bool:
        """Worth sending again later: no answer, server error, auth/routing not ready yet."""
        return self.status == 0 or self.status >= 500 or self.status in (401, 403, 404, 408, 409, 429)


class HttpTransport:
    """POSTs JSON bodies with urllib; never raises, reports failures as a :class:`Delivery`."""

    def __init__(self, server: str, token: Optional[str] = None, timeout: float = 5.0):
        self.endpoint = server.rstrip("/") + INGEST_PATH
        self.token = token
        self.timeout = timeout
        # No proxies: the server is usually on loopback or the cluster network.
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

    def post(self, body: bytes) -> Delivery:
        req = urllib.request.Request(self.endpoint, data=body, method="POST")
        req.add_header("Content-Type", "application/json")
        if self.token:
            req.add_header("Authorization", f"Bearer {self.token}")
        try:
            with self._opener.open(req, timeout=self.timeout) as resp:
                return Delivery(resp.status, resp.read().decode("utf-8", "replace"))
        except urllib.error.HTTPError as e:
            try:
                text = e.read().decode("utf-8", "replace")
            except Exception:  # noqa: BLE001 - the status is what matters
                text = ""
            return Delivery(e.code, text)
        except Exception as e:  # noqa: BLE001 - refused, timeout, reset, DNS: all mean "not delivered"
            return Delivery(0, f"{type(e).__name__}: {e}")
