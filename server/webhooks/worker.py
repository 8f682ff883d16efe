"""The delivery worker: sends outbox rows, retries with backoff, and runs the F2 stall check.

Started and stopped by ``create_app``'s lifespan. ``wake()`` (called after a
commit that enqueued deliveries, from any thread) makes it send at once;
otherwise it polls every ``poll_interval`` seconds, which also picks up
deliveries other replicas enqueued, retries that came due, and rows left
behind by a restart. Database work runs in a thread so the event loop that
serves the API never blocks on it.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Optional

import httpx
from sqlalchemy.orm import sessionmaker as SessionMaker

from server.models import Project, Run
from server.rules.config import rules_file_of
from server.rules.engine import check_stalled_runs
from server.webhooks import outbox
from server.webhooks.signing import sign_headers

log = logging.getLogger("gradwatch.webhooks")

USER_AGENT = "gradwatch-webhooks/0.1"


class DeliveryWorker:
    def __init__(self, sessionmaker, settings, *, poll_interval: float = 1.0,
                 stall_interval: Optional[float] = None, request_timeout: float = 5.0):
        self.sessionmaker = sessionmaker
        self.settings = settings
        self.poll_interval = poll_interval
        stall = float(getattr(settings, "stall_seconds", 300.0) or 300.0)
        try:  # a rules file may give some project a smaller F2 timeout
            rf = rules_file_of(settings)
            for table in ([rf.every_project] + list(rf.projects.values())) if rf else []:
                stall = min(stall, float(table.get("F2", {}).get("timeout_s") or stall))
        except Exception:  # noqa: BLE001 - reported by start()
            pass
        # check several times per timeout, at most every 5 s
        self.stall_interval = stall_interval if stall_interval is not None else max(0.2, min(5.0, stall / 4))
        self.request_timeout = request_timeout
        engine = sessionmaker.kw.get("bind")
        if engine is not None and engine.dialect.name == "sqlite":
            # BEGIN IMMEDIATE: take SQLite's write lock up front instead of failing to upgrade a read lock
            self._write = SessionMaker(engine.execution_options(sqlite_immediate=True), expire_on_commit=False)
        else:
            self._write = sessionmaker
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._event: Optional[asyncio.Event] = None
        self._tasks: list[asyncio.Task] = []
        self._client: Optional[httpx.AsyncClient] = None
        self._stopping = False
        self.sent = 0

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        rules_file_of(self.settings)      # a bad rules file stops the server here, naming the rule and key
        self._loop = asyncio.get_running_loop()
        self._event = asyncio.Event()
        self._stopping = False
        await asyncio.to_thread(self._sync_endpoints)
        self._client = httpx.AsyncClient(timeout=self.request_timeout, follow_redirects=False,
                                         headers={"User-Agent": USER_AGENT})
        self._tasks = [asyncio.create_task(self._deliver_loop(), name="gradwatch-webhook-delivery"),
                       asyncio.create_task(self._stall_loop(), name="gradwatch-stall-check")]

    def wake(self) -> None:
        """Send due deliveries now. Safe from the event loop and from any other thread."""
        loop, event = self._loop, self._event
        if loop is None or event is None or loop.is_closed():
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            event.set()
        else:
            loop.call_soon_threadsafe(event.set)

    async def stop(self) -> None:
        self._stopping = True
        if self._event is not None:
            self._event.set()
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            try:
                await task
            except (asyncio.CancelledError, Exception):  # noqa: BLE001
                pass
        self._tasks = []
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    # ------------------------------------------------------------------ delivery

    def _sync_endpoints(self) -> None:
        with self._write() as s:
            outbox.sync_server_endpoints(s, self.settings)
            s.commit()

    def _claim(self) -> list[outbox.Claimed]:
        with self._write() as s:
            claimed = outbox.claim_due(s, now=time.time())
            s.commit()
            return claimed

    def _record(self, results: list[tuple[outbox.Claimed, Optional[int], Optional[str]]]) -> None:
        with self._write() as s:
            now = time.time()
            for claimed, code, error in results:
                outbox.record_attempt(s, claimed, now=now, status_code=code, error=error)
            s.commit()

    def _next_due(self) -> Optional[float]:
        with self.sessionmaker() as s:
            return outbox.next_due_at(s)

    async def _send(self, c: outbox.Claimed) -> tuple[outbox.Claimed, Optional[int], Optional[str]]:
        body = c.body.encode()
        headers = {"Content-Type": "application/json", "X-Gradwatch-Delivery": str(c.id),
                   **sign_headers(c.secret, body)}
        try:
            resp = await self._client.post(c.url, content=body, headers=headers)
        except httpx.HTTPError as e:
            return c, None, f"{type(e).__name__}: {e}" or type(e).__name__
        if 200 <= resp.status_code < 300:
            return c, resp.status_code, None
        return c, resp.status_code, f"HTTP {resp.status_code}: {resp.text[:200]}"

    async def deliver_due(self) -> int:
        """Send every due delivery once; returns how many were attempted."""
        attempted = 0
        while not self._stopping:
            claimed = await asyncio.to_thread(self._claim)
            if not claimed:
                break
            results = await asyncio.gather(*(self._send(c) for c in claimed))
            await asyncio.to_thread(self._record, list(results))
            attempted += len(claimed)
            self.sent += sum(1 for _, code, err in results if err is None)
            if len(claimed) < outbox.CLAIM_LIMIT:
                break
        return attempted

    async def _deliver_loop(self) -> None:
        while not self._stopping:
            try:
                await self.deliver_due()
                nxt = await asyncio.to_thread(self._next_due)
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - keep the worker alive; the rows stay pending
                log.exception("webhook delivery round failed; retrying")
                nxt = None
            wait = self.poll_interval
            if nxt is not None:
                wait = max(0.01, min(wait, nxt - time.time()))
            try:
                await asyncio.wait_for(self._event.wait(), timeout=wait)
            except asyncio.TimeoutError:
                pass
            self._event.clear()

    # ------------------------------------------------------------------ F2 run_stalled

    def check_stalls(self) -> int:
        """Raise F2 for silent runs and enqueue their webhooks; returns the number of new alerts."""
        with self._write() as s:
            now = time.time()
            alerts = check_stalled_runs(s, settings=self.settings, now=now)
            enqueued = 0
            for alert in alerts:
                run = s.get(Run, alert.run_id)
                project = s.get(Project, run.project_id)
                enqueued += outbox.enqueue_alerts(s, [alert], run=run, project=project, settings=self.settings,
                                                  now=now)
            s.commit()
        if alerts:
            log.info("run_stalled: %d run(s) went silent", len(alerts))
        return enqueued

    async def _stall_loop(self) -> None:
        while not self._stopping:
            try:
                await asyncio.sleep(self.stall_interval)
                if await asyncio.to_thread(self.check_stalls):
                    self.wake()
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001
                log.exception("stall check failed; retrying")
