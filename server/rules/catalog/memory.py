"""Device memory: the floor of the peak allocation rising window after window (D4, a leak)."""
from __future__ import annotations

import math

from gradwatch.server.rules.registry import register
from gradwatch.server.rules.rule import BatchRule, Outcome
from gradwatch.server.rules.spec import Float, Hit, Int
from gradwatch.server.rules.stats import fmt

GIB = float(1 << 30)


@register
class MemoryGrowth(BatchRule):
    id, name, severity, checklist = "D4", "memory_growth", "warning", "—"
    family = "D"
    fires_when = ("the smallest peak device memory of each {window}-step window rose {windows} windows in a row, "
                  "by {growth:.0%} or more in all")
    diagnosis = ("Device memory grows step after step: something keeps tensors alive across steps (a leak). "
                 "The run will end out of memory.")
    actions = {
        "item": "Accumulate logged values as numbers, not tensors: total_loss += loss.item() (or loss.detach()); "
                "a loss kept with its graph holds every activation of its step.",
        "lists": "Look for lists or dicts that grow every step (outputs, losses, hidden states kept for "
                 "logging or metrics) and store them detached, on the CPU, or not at all.",
        "cache": "A cache that grows with new input shapes (varying sequence lengths) levels off; one that never "
                 "does is a leak: torch.cuda.memory_snapshot() shows which allocations stay.",
    }
    params = {"window": Int(100), "windows": Int(5), "growth": Float(0.2)}
    needs = ("mem_peak",)
    # Why each window's smallest peak: the peak of a step moves with its batch (sequence lengths, the
    # allocator's caching), but the least any step of a window needed is the memory held across steps;
    # a floor that rises window after window is held memory growing, a leak.
    # State: "b" the window (step // window) being read and "m" its smallest peak so far; "f" the floors
    # of the complete windows before it, [window, floor] each, consecutive windows only.

    def evaluate(self, batch, state, cfg):
        out = Outcome.quiet(batch.n)
        width, count, growth = int(cfg["window"]), max(2, int(cfg["windows"])), cfg["growth"]
        peaks, measured = batch.values("mem_peak"), batch.measured("mem_peak")
        current, low = state.get("b"), state.get("m")
        floors = [tuple(f) for f in state.get("f", [])]
        for i in range(batch.n):
            v = float(peaks[i])
            if not measured[i] or not math.isfinite(v) or v <= 0:
                continue
            b = int(batch.step[i]) // width
            if current is None or b == current:
                current, low = b, v if low is None else min(low, v)
                continue
            if b < current:                    # a step from a window already closed: it changes nothing
                continue
            # the first step of a later window: the window before is complete, judged here
            if floors and floors[-1][0] != current - 1:
                floors = []                    # a window without data in between: the rise starts over
            floors = (floors + [(current, low)])[-count:]
            rising = len(floors) == count and all(a[1] < c[1] for a, c in zip(floors, floors[1:]))
            if rising and floors[-1][1] >= floors[0][1] * (1 + growth):
                first, last = floors[0][1], floors[-1][1]
                out.hits[i] = Hit({"floors_gib": [round(f / GIB, 4) for _, f in floors], "growth": last / first - 1,
                                   "window": width, "since_step": floors[0][0] * width},
                                  f"Peak device memory's floor rose {len(floors)} windows of {width} steps in a "
                                  f"row: {fmt(first / GIB)} GiB to {fmt(last / GIB)} GiB "
                                  f"(+{last / first - 1:.0%}) since step {floors[0][0] * width}")
            else:
                out.clear[i] = True
            current, low = b, v
        state["b"], state["m"] = current, low
        state["f"] = [list(f) for f in floors]
        return out
