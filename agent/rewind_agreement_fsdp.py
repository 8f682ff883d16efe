"""FSDP2 ranks agree on a rewind without a collective of their own: five numbers ride in FSDP2's gradient
reduce-scatter.

Why: as under DDP (:mod:`agent.rewind_agreement`), every rank must restore the same snapshot at the same
step, each rank hears the run's alerts at its own time, and a collective of our own would cost every
healthy step (or deadlock, if only the ranks that heard issued it). FSDP2 has no DDP comm hook, but
``fully_shard`` lets a module replace its reduce-scatter (``FSDPModule.set_custom_reduce_scatter``), and
that reduce-scatter runs in every backward anyway.

How: one FSDP2 module's reduce-scatter (the root's when it holds parameters, else the first module
that does) is replaced by one that does the same ``reduce_scatter_single`` with the same op on an input
one column wider per rank: each rank's piece of the flat gradient gets five numbers appended, so
after the reduce-scatter every rank holds, besides its own gradient shard (bitwise what the default
gives: the same elements reduced with the same op), the sums over the ranks of:

1. whether the rank holds a trigger it has not acted on yet (1 / 0);
2. that trigger's onset step;
3. whether it asks for a rewind (1) or only a cool (0);
4. whether it holds a snapshot not vouched for yet (1 / 0);
5. whether that snapshot is non-finite on this rank (1 / 0).

Numbers 1-3 decide as under DDP (:meth:`FsdpAgreement.decided`): every rank acts at the first step end
where all ranks have heard, with the onset ``onset_sum // world_size``; a rank that hears late only
delays it. Numbers 4-5 are FSDP's own: each rank holds a different shard, so one rank's shard can be
non-finite while another's is finite, and a snapshot refused by one rank but kept by the other would make
the ranks restore different steps. So every rank copies its shards at the same step, keeps the copy
unusable, and the next reduce-scatter says whether any rank found its copy non-finite: every rank then
keeps it, or drops it and snapshots again, alike (:meth:`FsdpAgreement.verdict`).

With ``ReduceOp.AVG`` (what FSDP2 uses for fp32 / bf16 gradients) the numbers are sent multiplied by the
world size, so the average is their sum. Limits: the CPU (gloo) only (the sums are read on the host at the
step's end); plain FSDP2 over every rank only (HSDP's replicas would not hear: their all-reduce is not
carried yet); a module with a reduce-scatter of its own, a custom gradient divide factor (a ``PREMUL_SUM``:
the sums would not be exact) or an fp16 reduction (the onset must be an exact integer) turns remediation off.

Imports torch only.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist

from gradwatch.agent.rewind_agreement import merged_proposal

N_NUMBERS = 5


def _fsdp_modules(model: Any) -> list:
    """The FSDP2 modules of ``model`` that hold parameters (the root first), as (module, param_group)."""
    from torch.distributed.fsdp import FSDPModule
    out = []
    for m in model.modules():
        if isinstance(m, FSDPModule):
            groups = getattr(m._get_fsdp_state(), "_fsdp_param_groups", None) or []
            if groups:
                out.append((m, groups[0]))
    return out


def is_fsdp2(model: Any) -> bool:
    """True when ``model`` holds DTensor parameters sharded by ``fully_shard``."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return False
    return any(isinstance(m, FSDPModule) for m in model.modules())


class _CarryingReduceScatter:
    """FSDP2's default reduce-scatter, with the agreement's numbers appended to every rank's piece."""

    def __init__(self, agreement: "FsdpAgreement"):
        self.agreement = agreement

    def allocate(self, size, *, dtype, device):          # FSDP's DefaultAllocMixin
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op: bool = False):
        world = group.size()
        numbers = torch.tensor(self.agreement.numbers(), dtype=input_tensor.dtype, device=input_tensor.device)
        if op == dist.ReduceOp.AVG:
            numbers.mul_(world)                           # the average of n * x is the sum of x
        joined = torch.cat([input_tensor.view(world, -1), numbers.expand(world, N_NUMBERS)], dim=1)
        out = torch.empty(joined.shape[1], dtype=input_tensor.dtype, device=input_tensor.device)
        dist.reduce_scatter_single(output=out, input=joined.view(-1), group=group, op=op)
        output_tensor.copy_(out[:-N_NUMBERS])
        self.agreement.heard(out[-N_NUMBERS:])
        return None


class FsdpAgreement:
    """The agreement of one FSDP2 model's ranks: :meth:`propose` at news, :meth:`vouch` after a snapshot,
    :meth:`decided` then :meth:`verdict` at each step end."""

    shards = True   # the ranks' snapshots hold different shards: they are vouched for (see the module doc)

    def __init__(self, model: Any, world_size: int):
        self.world = int(world_size)
        self._flag: Optional[tuple[float, float, float]] = None   # (1, onset, wants_rewind) while pending
        self._snapshot: tuple[float, float] = (0.0, 0.0)          # (pending, non-finite) of the unvouched one
        self._sums: Optional[list[float]] = None                  # this step's sums, set in the backward
        self._verdict: Optional[bool] = None
        module, _ = _fsdp_modules(model)[0]
        module.set_custom_reduce_scatter(_CarryingReduceScatter(self))

    @staticmethod
    def usable(model: Any, world_size: int) -> Optional[str]:
        """Why the agreement cannot run on ``model`` (None: it can)."""
        from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultReduceScatter
        found = _fsdp_modules(model)
        if not found:
            return "no fully_shard module of the model holds parameters"
        module, group = found[0]
        p = next(model.parameters(), None)
        if p is None or p.device.type != "cpu":
            return "the FSDP2 model is not on the CPU (the agreement is built for gloo only so far)"
        from torch.distributed.fsdp._fully_shard._fsdp_common import DDPMeshInfo, FSDPMeshInfo
        info = group.mesh_info
        if isinstance(info, DDPMeshInfo) or not isinstance(info, FSDPMeshInfo):
            return "the model is replicated as well as sharded (HSDP / replicate: not supported yet)"
        if info.shard_mesh_size != world_size:
            return "the FSDP2 mesh does not span every rank"
        if len(module._get_fsdp_state()._fsdp_param_groups) > 1:
            return "the FSDP2 module has several parameter groups (a per-parameter mesh)"
        if type(group._reduce_scatter_comm) is not DefaultReduceScatter:
            return "the FSDP2 module already has a custom reduce-scatter"
        factor = getattr(group, "gradient_divide_factor", None)
        if factor is not None and factor != group.mesh_info.shard_mesh_size:
            return "the FSDP2 module has a custom gradient divide factor (its PREMUL_SUM would not sum exactly)"
        reduce_dtype = getattr(group.mp_policy, "reduce_dtype", None) or p.dtype
        if reduce_dtype not in (torch.float32, torch.float64):
            return f"the gradients are reduced in {reduce_dtype} (the agreement needs fp32 / fp64)"
        return None

    # ------------------------------------------------------------------ training thread

    def propose(self, onset: int, rewind: bool) -> None:
        """This rank holds a trigger: it rides in the next reduce-scatters until the ranks decide."""
        self._flag = merged_proposal(self._flag, onset, rewind)

    def vouch(self, finite: bool) -> None:
        """This rank just took a snapshot (every rank did, at this same step): whether its shards are finite
        rides in the next reduce-scatter."""
        self._snapshot = (1.0, 0.0 if finite else 1.0)

    def numbers(self) -> tuple:
        return (*(self._flag or (0.0, 0.0, 0.0)), *self._snapshot)

    def heard(self, sums: torch.Tensor) -> None:
        """The reduce-scatter's sums of the five numbers (the backward, FSDP's reduce-scatter)."""
        self._sums = sums.tolist()

    def decided(self) -> Optional[tuple[int, bool]]:
        """At a step's end: ``(onset, rewind)`` when every rank has heard a trigger (the same on every
        rank), else None. Also settles the snapshot verdict (:meth:`verdict`)."""
        sums, self._sums = self._sums, None
        self._verdict = None
        if sums is None:
            return None
        count, onset_sum, rewinds, pending, bad = sums
        if round(pending) > 0:
            # every rank snapshots at the same steps, so every rank vouched; a count other than the world
            # would mean they did not: the snapshot is dropped everywhere (the sums are the same everywhere)
            self._verdict = round(pending) == self.world and round(bad) == 0
            self._snapshot = (0.0, 0.0)
        if round(count) != self.world:
            return None
        self._flag = None
        return int(round(onset_sum)) // self.world, rewinds > 0.5

    def verdict(self) -> Optional[bool]:
        """Of the snapshot vouched for before this step: True every rank's copy is finite, False drop it
        (on every rank), None no reduce-scatter carried it yet."""
        v, self._verdict = self._verdict, None
        return v
