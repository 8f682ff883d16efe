"""The CUDA peak of allocated memory of each step (host counters, no sync); reset after reading."""
from __future__ import annotations

import torch

from gradwatch.agent.collectors.base import Collector


class PeakMemory(Collector):
    name = "memory"
    order = 80
    emits = ("mem_peak",)

    def wanted(self) -> bool:
        # is_available() does not initialise CUDA; without a device there is never a peak to read.
        return bool(self.watched.config.memory) and torch.cuda.is_available()

    def end_step(self, step, rec) -> None:
        if torch.cuda.is_initialized() and self.guards.on("memory"):   # implies available; a cheaper call
            with self.guards.guard("memory"):
                rec.host["mem_peak"] = float(torch.cuda.max_memory_allocated())
                torch.cuda.reset_peak_memory_stats()
