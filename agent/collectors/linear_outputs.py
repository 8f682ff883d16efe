"""Output RMS of every ``nn.Linear`` module, every ``linear_every`` steps (H4 linear_output_growth).

Before a Transformer diverges, the output norms of its linear layers (QKV, the attention projection,
FC2) rise step after step (Rybakov et al. 2024, arXiv:2410.16682). On a sampled step's first
training forward, forward hooks on the model's ``nn.Linear`` modules (subclasses included) record
``‖y‖ / √n`` of each one's output, in float32 (``vector_norm(..., dtype=float32)``: no upcast copy of a
bf16 output), and are removed when that forward returns: other steps pay nothing. The record part
``layers.linear_out_rms`` holds one value per module of the run's module list, "not measured" for
the others (and for a Linear whose ``forward`` is not called, such as ``MultiheadAttention.out_proj``).

Cost on a sampled step: one norm kernel per Linear output; no host sync.
"""
from __future__ import annotations

import math

import torch

from gradwatch.agent.capture.shards import local_tensor
from gradwatch.agent.collectors.base import OneForwardHooks, scatter_measured


def output_rms(out: torch.Tensor) -> torch.Tensor:
    """‖y‖ / √n of one output, float32, on its device.

    >>> float(output_rms(torch.full((2, 3), -2.0)))
    2.0
    """
    x = local_tensor(out.detach())   # a DTensor output (tensor parallel): this rank's shard
    return torch.linalg.vector_norm(x, dtype=torch.float32) / math.sqrt(max(x.numel(), 1))


class LinearOutputs(OneForwardHooks):
    name = "linear_outputs"
    every = "linear_every"

    def __init__(self, watched, guards):
        super().__init__(watched, guards)
        self.linears = [i for i, (_, m) in enumerate(watched.modules) if isinstance(m, torch.nn.Linear)]
        self.values: dict[int, torch.Tensor] = {}

    def wanted(self) -> bool:
        return self.interval > 0 and bool(self.linears)

    def on_first_forward(self, step, args, kwargs) -> None:
        modules = self.watched.modules
        self.hook_this_forward([modules[i][1].register_forward_hook(self._hook(i)) for i in self.linears])

    def _hook(self, index: int):
        def hook(module, args, output):
            if index in self.values or self.name in self.guards.disabled:
                return None
            with self.guards.guard(self.name):
                if isinstance(output, torch.Tensor) and output.is_floating_point() and output.numel() > 0:
                    self.values[index] = output_rms(output)
            return None
        return hook

    def end_step(self, step, rec) -> None:
        values, self.values = self.values, {}
        if not values or not self.guards.on(self.name):
            return
        with self.guards.guard(self.name):
            order = sorted(values)
            rec.add("layers.linear_out_rms", scatter_measured(torch.stack([values[i] for i in order]), order,
                                                              len(self.watched.modules)))
