"""A one-line progress bar on stderr, redrawn in place; silent when stderr is not a terminal.

Standard library only. Redraws at most every ``interval`` seconds so a fast
import spends its time importing, not printing.

>>> import io
>>> out = io.StringIO()
>>> bar = Progress(10, "run-1", out=out, enabled=True, interval=0.0)
>>> bar.update(5); bar.done()
>>> "5/10 steps" in out.getvalue() and out.getvalue().endswith("\\n")
True
>>> bar = Progress(3_000_000, "reading", unit="MB", scale=1e-6, out=out, enabled=True, interval=0.0)
>>> bar.update(1_500_000); "1.5/3.0 MB" in out.getvalue()
True
"""
from __future__ import annotations

import sys
import time
from typing import Optional, TextIO

WIDTH = 28


class Progress:
    def __init__(self, total: int, label: str, *, unit: str = "steps", scale: float = 1.0,
                 out: Optional[TextIO] = None, enabled: Optional[bool] = None, interval: float = 0.1,
                 clock=time.monotonic):
        self.total = max(0, total)
        self.label = label
        self.unit = unit
        self.scale = scale          # shown as count * scale (bytes as MB: 1e-6)
        self.out = out if out is not None else sys.stderr
        self.enabled = self.out.isatty() if enabled is None else enabled
        self.interval = interval
        self.clock = clock
        self.done_count = 0
        self._started = clock()
        self._drawn = float("-inf")

    def update(self, n: int) -> None:
        self.done_count += n
        now = self.clock()
        if self.enabled and now - self._drawn >= self.interval:
            self._draw(now)

    def done(self) -> None:
        if self.enabled:
            self._draw(self.clock())
            self.out.write("\n")
            self.out.flush()

    def _draw(self, now: float) -> None:
        self._drawn = now
        frac = self.done_count / self.total if self.total else 1.0
        filled = int(round(WIDTH * min(1.0, frac)))
        elapsed = now - self._started
        rate = self.done_count / elapsed if elapsed > 0 else 0.0
        # the first draws have too little elapsed time for a rate that means anything
        eta = f"{(self.total - self.done_count) / rate:4.0f}s" if rate > 0 and elapsed >= 1.0 else "   ?s"
        num = (lambda n: f"{n * self.scale:,.1f}") if self.scale != 1.0 else (lambda n: f"{n:,.0f}")
        self.out.write(f"\r{self.label} [{'#' * filled}{'.' * (WIDTH - filled)}] "
                       f"{num(self.done_count)}/{num(self.total)} {self.unit} {frac:4.0%} "
                       f"{num(rate)} {self.unit}/s eta {eta} ")
        self.out.flush()
