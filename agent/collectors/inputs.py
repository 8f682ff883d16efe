"""Non-finite values in the step's first input batch, every ``inputs_every`` steps and while hunting a NaN."""
from __future__ import annotations

from gradwatch.agent.capture.activation_stats import count_nonfinite
from gradwatch.agent.collectors.base import Collector


class InputNonfinite(Collector):
    name = "inputs"
    order = 70
    every = "inputs_every"
    while_hunting = True
    emits = ("input_nonfinite",)

    def __init__(self, watched, guards):
        super().__init__(watched, guards)
        self.count = None

    def on_first_forward(self, step, args, kwargs) -> None:
        self.count = count_nonfinite(args, kwargs)

    def end_step(self, step, rec) -> None:
        if self.count is not None:
            rec.add("input_nonfinite", self.count)
            self.count = None
