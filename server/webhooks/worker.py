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
from typing import Awaitable, Callable, Mapping, Optional

import httpx
from sqlalchemy.orm import sessionmaker as SessionMaker

from gradwatch.server.rules.config import rules_file_of
from gradwatch.server.rules.engine import scan_timer_rules, timer_scan_interval
from gradwatch.server.webhooks import outbox
from gradwatch.server.webhooks.signing import sign_headers
from gradwatch.server.webhooks.targets import TargetRefused, check_target

log = logging.getLogger("gradwatch.webhooks")

USER_AGENT = "gradwatch-webhooks/0.1"


class DeliveryWorker:
    def __init__(self, sessionmaker, settings, *, poll_interval: float = 1.0,
                 stall_interval: Optional[float] = None, request_timeout: float = 5.0,
                 route: Callable, flush: Optional[Callable] = None,
                 flush_due_at: Optional[Callable] = None, delivered: Optional[Callable] = None,
                 senders: Optional[Mapping[str, Callable[[str, str], Awaitable]]] = None):
        """``route(session, alerts, settings=, now=)`` hands the timer rules' alerts on (into routing);
        ``flush(session, settings=, now=)`` → (rows written, next due time) runs in a round where
        ``flush_due_at(session)`` (a read) says something is due (the notification groups);
        ``delivered(session, group_ids, now=)`` is told, in the transaction that records them, the
        notification groups of the rows just delivered (a group's intervals count from then);
        ``senders``: URL scheme → ``await send(url, body)`` → (status, error) for outbox rows that are
        not HTTP (``mailto`` for email)."""
        self.sessionmaker = sessionmaker
        self.settings = settings
        self.route = route
        self.flush = flush
        self.flush_due_at = flush_due_at
        self.delivered = delivered
        self.senders = dict(senders or {})
        self.poll_interval = poll_interval
        try:  # the timer rules' smallest timeouts (a rules file may give some project a smaller one)
            interval = timer_scan_interval(settings)
        except Exception:  # noqa: BLE001 - reported by start()
            interval = 5.0
        self.stall_interval = stall_interval if stall_interval is not None else interval
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
            done = [claimed.group_id for claimed, code, error in results
                    if outbox.record_attempt(s, claimed, now=now, status_code=code, error=error) == "delivered"]
            done = [g for g in done if g is not None]
            if done and self.delivered is not None:
                self.delivered(s, done, now=now)
            s.commit()

    def _next_due(self) -> Optional[float]:
        with self.sessionmaker() as s:
            return outbox.next_due_at(s)

    async def _send(self, c: outbox.Claimed) -> tuple[outbox.Claimed, Optional[int], Optional[str]]:
        scheme = c.url.split(":", 1)[0]
        if scheme not in ("http", "https"):
            sender = self.senders.get(scheme)
            if sender is None:
                return c, None, f"no sender for {scheme}: URLs on this server"
            try:
                code, error = await sender(c.url, c.body)
            except Exception as e:  # noqa: BLE001 - a sender's bug is one failed attempt, retried
                log.exception("delivery %s via %s failed", c.id, scheme)
                code, error = None, f"{type(e).__name__}: {e}"
            return c, code, error
        body = c.body.encode()
        headers = {"Content-Type": "application/json", "X-Gradwatch-Delivery": str(c.id),
                   **sign_headers(c.secret, body)}
        # A project's endpoint is checked again before each delivery (its name may resolve elsewhere by
        # now), and its log, which the project's token holders read, shows no reply body and does not
        # tell a closed port from a silent one: the details go to the operator's server log.
        guarded = c.project_endpoint and bool(getattr(self.settings, "checks_webhook_targets", False))
        if guarded:
            try:
                await asyncio.to_thread(check_target, c.url, allow=getattr(self.settings, "webhook_allow", ()))
            except TargetRefused as e:
                return c, None, str(e)
        try:
            resp = await self._client.post(c.url, content=body, headers=headers)
        except httpx.HTTPError as e:
            detail = f"{type(e).__name__}: {e}" or type(e).__name__
            if guarded:
                log.info("webhook delivery %s to %s failed: %s", c.id, c.url, detail)
                return c, None, "could not deliver: no answer from the endpoint"
            return c, None, detail
        if 200 <= resp.status_code < 300:
            return c, resp.status_code, None
        if guarded:
            log.info("webhook delivery %s to %s: HTTP %s %s", c.id, c.url, resp.status_code, resp.text[:200])
            return c, resp.status_code, f"HTTP {resp.status_code}"
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

    def _flush(self) -> Optional[float]:
        """The groups' timers: notifications that came due become outbox rows; returns the next due time."""
        if self.flush_due_at is not None:
            # a read first: SQLite's writer lock is taken only when a group is due, not every poll
            with self.sessionmaker() as s:
                due = self.flush_due_at(s)
            if due is None or due > time.time():
                return due
        with self._write() as s:
            _written, nxt = self.flush(s, settings=self.settings, now=time.time())
            s.commit()
        return nxt

    async def _deliver_loop(self) -> None:
        while not self._stopping:
            try:
                group_due = await asyncio.to_thread(self._flush) if self.flush is not None else None
                await self.deliver_due()
                nxt = await asyncio.to_thread(self._next_due)
                if group_due is not None:
                    nxt = group_due if nxt is None else min(nxt, group_due)
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
        """Raise the timer rules (F2 silent runs, F4 silent ranks) and enqueue their webhooks; returns the
        number of new alerts."""
        with self._write() as s:
            now = time.time()
            alerts = scan_timer_rules(s, settings=self.settings, now=now)
            enqueued = self.route(s, alerts, settings=self.settings, now=now) if alerts else 0
            s.commit()
        if alerts:
            log.info("timer rules (run_stalled, rank_silent): %d alert(s) raised", len(alerts))
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
