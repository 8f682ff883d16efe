"""A2's bookkeeping across batches: the spikes it has seen, and the loss it judges them against.

A2 (``gradients.GradExplosion``) calls one grad-norm spike a warning and escalates on a second spike, a spike
that lasts, or a loss that stays up after it (checklist 3.5). What it must remember from one batch to the next,
and nothing else, lives here, so that the rule reads as its judgement. Both classes keep their state in the
rule's ``state`` dict, so a batch cut anywhere gives the same verdicts (tests/rules/test_batch_cuts.py).
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from gradwatch.server.rules.rule import pack_f8, unpack_f8


class LossHistory:
    """The last ``size`` finite losses before a batch, and the batch's own: step ``i``'s loss against the median of
    the ``size`` losses before it. The losses are kept whole and a median is taken only where a spike asks for one
    (a window screened at every step cost the rules ~9 % more CPU per batch, bench/rules_cpu.py).

    >>> import numpy as np
    >>> state = {}
    >>> h = LossHistory(state, np.array([1.0] * 12 + [4.0]), size=50, factor=3.0)
    >>> h.judge(12), h.judge(3)            # step 12's loss is 4x its median; step 3 has fewer than 10 before it
    (True, False)
    >>> round(h.ratio(12), 1)
    4.0
    """

    MIN_HISTORY = 10     # fewer losses before a step than this: no median, the loss is not judged

    def __init__(self, state: dict, loss: np.ndarray, size: int, factor: float):
        self.loss, self.size, self.factor = loss, size, factor
        self.at = np.flatnonzero(np.isfinite(loss))          # the batch rows with a finite loss
        self.losses = np.concatenate([unpack_f8(state.get("loss")), loss[self.at]])
        self.before = len(self.losses) - len(self.at)        # how many of them came from earlier batches
        state["loss"] = pack_f8(self.losses[-size:]) if size > 0 else None
        self.up = np.zeros(len(loss), dtype=bool)
        self.median = np.full(len(loss), np.nan)

    def judge(self, i: int) -> bool:
        """Whether row ``i``'s loss is ``factor`` x the median of the losses before it (kept in ``up``/``median``)."""
        k = int(np.searchsorted(self.at, i))
        if k < len(self.at) and self.at[k] == i:
            pos = self.before + k
            hist = self.losses[max(0, pos - self.size):pos]
            if len(hist) >= self.MIN_HISTORY:
                self.median[i] = med = float(np.median(hist))
                self.up[i] = med > 0 and self.loss[i] >= self.factor * med
        return bool(self.up[i])

    def ratio(self, i: int) -> float:
        """Row ``i``'s loss over its median (judged first)."""
        return float(self.loss[i] / self.median[i])


class SpikeTrack:
    """The spikes A2 has flagged: a spike is a run of consecutive flagged steps.

    ``spikes`` holds the first steps of the spikes within the last ``span`` steps, ``last`` the last flagged step,
    ``length`` how many steps its spike has lasted, ``pending`` a spike's step whose loss was up (is it still up
    a step later?).

    >>> t = SpikeTrack.load({})
    >>> [t.flag(s, span=50) for s in (60, 61, 90, 200)]     # (spikes within span, this spike's length)
    [(1, 1), (1, 2), (2, 1), (1, 1)]
    >>> state = {}; t.save(state); SpikeTrack.load(state).spikes
    [200]
    """

    def __init__(self, spikes: list[int], last: Optional[int], length: int, pending: Optional[int]):
        self.spikes, self.last, self.length, self.pending = spikes, last, length, pending

    @classmethod
    def load(cls, state: dict) -> "SpikeTrack":
        return cls(list(state.get("spikes", [])), state.get("last"), int(state.get("length", 0)),
                   state.get("loss_spike"))

    def save(self, state: dict) -> None:
        state.update(spikes=self.spikes, last=self.last, length=self.length, loss_spike=self.pending)

    def flag(self, step: int, span: int, loss_up: bool = False) -> tuple[int, int]:
        """A flagged step: the same spike one step longer, or a new one; with ``loss_up``, the step whose loss is
        judged again at the next one. Returns the spikes within ``span`` steps and this spike's length."""
        if loss_up:
            self.pending = step
        if self.last is not None and step == self.last + 1:
            self.length += 1
        else:
            self.spikes, self.length = self.spikes + [step], 1
        self.last = step
        self.spikes = [x for x in self.spikes if x > step - span]
        return len(self.spikes), self.length

    def loss_stays(self, step: int, loss_up: bool) -> bool:
        """At ``step``: is it the step after a spike whose loss was up, with the loss still up? A pending spike is
        forgotten once a later step is seen."""
        stays = self.pending is not None and step == self.pending + 1 and loss_up
        if self.pending is not None and step > self.pending:
            self.pending = None
        return stays

    def close_batch(self, last_step: Optional[int]) -> None:
        """The batch ended at ``last_step``: a pending spike whose next step came (or was skipped) is done."""
        if self.pending is not None and last_step is not None and last_step > self.pending:
            self.pending = None
