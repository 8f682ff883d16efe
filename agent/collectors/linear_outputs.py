"""Output RMS of every ``nn.Linear`` module, every ``linear_every`` steps (H4 linear_output_growth).

Before a Transformer diverges, the output norms of its linear layers (QKV, the attention projection,
FC2) rise step after step (Rybakov et al. 2024, arXiv:2410.16682). On a sampled step's first
training forward, the model's ``nn.Linear`` modules (subclasses included) are watched for that forward
only (:func:`~agent.collectors.base.after_forward`: a wrapper on the instance, or a forward hook where
the module has hooks of its own), which record
``‖y‖ / √n`` of each one's output, in float32 (``vector_norm(..., dtype=float32)``: no upcast copy of a
bf16 output), and are removed when that forward returns: other steps pay nothing. The record part
``layers.linear_out_rms`` holds one value per module of the run's module list, "not measured" for
the others (and for a Linear whose ``forward`` is not called, such as ``MultiheadAttention.out_proj``).

Cost on a sampled step: one reduction kernel per Linear output, then one square root and one scaling
for all of them at the step's end; no host sync. On CPU a float32 output's sum of squares is one BLAS
``dot`` (3 µs on a 4 × 32 × 64 output of the reference machine against 11 µs for
``vector_norm(dtype=float32) / √n``: the dtype argument takes a slower path, the division is a kernel
more); both overflow alike (a norm past 1.8e19 reads inf either way), both accumulate in float32. A GPU
keeps ``vector_norm``: one launch either way.
"""
from __future__ import annotations

import math

import torch

from gradwatch.agent.capture.shards import local_tensor
from gradwatch.agent.collectors.base import OneForwardHooks, after_forward, scatter_measured, to_device


def output_rms(out: torch.Tensor) -> torch.Tensor:
    """‖y‖ / √n of one output, float32, on its device (what a hook and the step's end compute between them).

    >>> float(output_rms(torch.full((2, 3), -2.0)))
    2.0
    """
    return rms_of_parts([output_norm_part(out)])[0]


def output_norm_part(out: torch.Tensor) -> tuple[torch.Tensor, bool, int]:
    """(the output's squared norm or its norm, whether squared, its element count): the part of
    :func:`output_rms` a hook computes; :func:`rms_of_parts` finishes a step's parts together.

    >>> parts = [output_norm_part(torch.full((2, 3), -2.0)), output_norm_part(torch.ones(4, dtype=torch.float64))]
    >>> [p[1] for p in parts], rms_of_parts(parts).tolist()
    ([True, False], [2.0, 1.0])
    """
    x = local_tensor(out.detach())   # a DTensor output (tensor parallel): this rank's shard
    n = max(x.numel(), 1)
    if x.device.type == "cpu" and x.dtype == torch.float32 and x.is_contiguous():
        flat = x.view(-1)
        return torch.dot(flat, flat), True, n
    if x.dtype == torch.float64:   # vector_norm refuses a narrowing dtype: the norm in float64, then float32
        return torch.linalg.vector_norm(x).float(), False, n
    return torch.linalg.vector_norm(x, dtype=torch.float32), False, n   # no upcast copy of a bf16 output


def rms_of_parts(parts: list) -> torch.Tensor:
    """‖y‖ / √n of each part of :func:`output_norm_part`, float32, in a handful of kernels for all."""
    values = torch.stack([p[0] for p in parts])
    squared = [p[1] for p in parts]
    if all(squared):
        values = values.sqrt()
    elif any(squared):
        values = torch.where(to_device(squared, torch.bool, values.device), values.sqrt(), values)
    return values / to_device([math.sqrt(p[2]) for p in parts], torch.float32, values.device)


class LinearOutputs(OneForwardHooks):
    name = "linear_outputs"
    order = 160
    every = "linear_every"
    emits = ("layers.linear_out_rms",)

    def __init__(self, watched, guards):
        super().__init__(watched, guards)
        self.linears = [i for i, (_, m) in enumerate(watched.modules) if isinstance(m, torch.nn.Linear)]
        self.values: dict[int, tuple] = {}    # module position -> output_norm_part, this step

    def wanted(self) -> bool:
        return self.interval > 0 and bool(self.linears)

    def on_first_forward(self, step, args, kwargs) -> None:
        modules = self.watched.modules
        self.hook_this_forward([after_forward(modules[i][1], self._seen(i)) for i in self.linears])

    def _seen(self, index: int):
        values, guards, guard = self.values, self.guards, self.guards.guard(self.name)

        def seen(output):
            if index in values or self.name in guards.disabled:
                return
            with guard:
                if isinstance(output, torch.Tensor) and output.is_floating_point() and output.numel() > 0:
                    values[index] = output_norm_part(output)
        return seen

    def end_step(self, step, rec) -> None:
        values = dict(self.values)   # the forwards' closures hold this dict: emptied, not replaced
        self.values.clear()
        if not values or not self.guards.on(self.name):
            return
        with self.guards.guard(self.name):
            order = sorted(values)
            rec.add("layers.linear_out_rms", scatter_measured(rms_of_parts([values[i] for i in order]), order,
                                                              len(self.watched.modules)))
