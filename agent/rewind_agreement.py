"""DDP ranks agree on a rewind without a collective of their own: three numbers ride in DDP's gradient all-reduce.

Why: every rank must restore the same snapshot at the same step, or the replicas drift apart. Every rank
hears the run's alerts (each from its own sender's replies), but each at its own time, so a rank that
acted as soon as it heard would restore at another step than the others. A collective to agree on it
(an all-reduce every N steps, as ``stop_on``'s) would cost every healthy step, and one issued only by
the ranks that heard would deadlock the others.

How: a DDP communication hook (``ddp_model.register_comm_hook``) does what DDP's default does for
every bucket (divide by the world size, all-reduce the sum) and, for bucket 0 only, appends three
numbers to that same all-reduce: whether this rank holds a trigger it has not acted on yet (1 / 0),
that trigger's onset step, and whether it asks for a rewind (1) or only a cool (0). After the backward
every rank holds the same sums, at the same step. At that step's end (:meth:`DdpAgreement.decided`):

* ``count == world_size``: every rank has heard a trigger: all act now, alike, with the onset
  ``onset_sum // world_size`` (the same number on every rank; the onset itself when they heard the same
  alert) and a rewind if any rank asked for one;
* ``0 < count < world_size``: some rank has not heard yet: nobody acts; the training goes on in
  lockstep and the ranks ask again at the next step (a rank that hears late only delays the rewind,
  it never blocks anyone: nobody waits for anything but DDP's own all-reduce);
* ``count == 0``: nothing pending (the healthy step: three more floats in bucket 0, one ``cat``).

The gradients are divided before the sum, as DDP's built-in reduction does, so a healthy step's
gradients are bitwise the ones without the hook. Limits: the CPU (gloo) only, fp32 / fp64 buckets
(the onset must be an exact integer), a model with no comm hook of its own (DDP takes one).

Imports torch only.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist


def merged_proposal(flag: Optional[tuple[float, float, float]], onset: int,
                    rewind: bool) -> tuple[float, float, float]:
    """A rank's pending trigger as the three numbers the ranks sum: (heard, onset, rewind), merged with the
    one it already holds: the earliest onset, and a rewind wins over a cool (DDP and FSDP2 alike)."""
    if flag is None:
        return (1.0, float(onset), 1.0 if rewind else 0.0)
    return (1.0, min(flag[1], float(onset)), max(flag[2], 1.0 if rewind else 0.0))


class DdpAgreement:
    """The agreement of one DDP model's ranks: :meth:`propose` at news, :meth:`decided` at each step end."""

    def __init__(self, ddp_model: Any, world_size: int):
        self.world = int(world_size)
        self.group = getattr(ddp_model, "process_group", None)
        self._flag: Optional[tuple[float, float, float]] = None   # (1, onset, wants_rewind) while pending
        self._sums: Optional[torch.Tensor] = None                  # this step's sums, set by the hook
        def hook(state, bucket):
            return self._hook(state, bucket)
        # DDP checks the hook's annotations as objects (this module's are strings: __future__ annotations)
        hook.__annotations__ = {"state": object, "bucket": dist.GradBucket,
                                "return": torch.futures.Future[torch.Tensor]}
        ddp_model.register_comm_hook(state=None, hook=hook)

    @staticmethod
    def usable(model: Any) -> Optional[str]:
        """Why the agreement cannot run on ``model`` (None: it can)."""
        if not isinstance(model, torch.nn.parallel.DistributedDataParallel):
            return ("the model is neither wrapped in DistributedDataParallel nor sharded by fully_shard "
                    "(FSDP1 / ZeRO / tensor parallel: not supported yet)")
        p = next(model.parameters(), None)
        if p is None or p.device.type != "cpu":
            return "the DDP model is not on the CPU (the agreement is built for gloo only so far)"
        if p.dtype not in (torch.float32, torch.float64):
            return f"the gradients are {p.dtype} (the agreement needs fp32 / fp64 buckets)"
        if getattr(model, "_comm_hooks", None) or getattr(getattr(model, "reducer", None), "_comm_hook", None):
            return "the DDP model already has a communication hook"
        return None

    # ------------------------------------------------------------------ training thread

    def propose(self, onset: int, rewind: bool) -> None:
        """This rank holds a trigger: it rides in the next all-reduces until the ranks decide."""
        self._flag = merged_proposal(self._flag, onset, rewind)

    def decided(self) -> Optional[tuple[int, bool]]:
        """At a step's end: ``(onset, rewind)`` when every rank has heard a trigger (the same on every
        rank), else None. Clears this rank's proposal once decided."""
        sums, self._sums = self._sums, None
        if sums is None:
            return None
        count, onset_sum, rewinds = (float(v) for v in sums.tolist())
        if round(count) != self.world:
            return None
        self._flag = None
        return int(round(onset_sum)) // self.world, rewinds > 0.5

    # ------------------------------------------------------------------ DDP's reduction (backward)

    def _hook(self, state: Any, bucket: Any):
        buf = bucket.buffer()
        buf.div_(self.world)
        if bucket.index() != 0:
            fut = dist.all_reduce(buf, group=self.group, async_op=True).get_future()
            return fut.then(lambda f: f.value()[0])
        flag = self._flag or (0.0, 0.0, 0.0)
        joined = torch.cat([buf, torch.tensor(flag, dtype=buf.dtype, device=buf.device)])
        fut = dist.all_reduce(joined, group=self.group, async_op=True).get_future()

        def split(f):
            out = f.value()[0]
            self._sums = out[-3:].clone()
            buf.copy_(out[:-3])
            return buf
        return fut.then(split)
