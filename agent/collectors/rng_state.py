"""The RNG state's hash at every step end (signal ``rng_hash``), where a checkpoint is usually saved.

A resumed run's G6 (``rng_not_restored``) compares the hash of the RNG state the resumed process holds
at attach with this value of the step before it (docs/resume.md). Every step, not sampled: a checkpoint
may be taken after any step. A host value: the training thread copies torch's 5 KB CPU generator state
(the CUDA generator's state is host-side), the sender thread computes its CRC-32 when it reads the
record; no device sync.
"""
from __future__ import annotations

from gradwatch.agent.collectors.base import Collector
from gradwatch.agent.resume import hash_rng_states, rng_states


class RngState(Collector):
    name = "rng_state"
    order = 170
    emits = ("rng_hash",)

    def wanted(self) -> bool:
        return bool(getattr(self.watched.config, "resume_rng", True))

    def end_step(self, step, rec) -> None:
        if not self.guards.on(self.name):
            return
        with self.guards.guard(self.name):
            # the states copied now, their CRC-32 worked out by the sender thread (StepRecord.read)
            rec.add_later("rng_hash", hash_rng_states, rng_states())
