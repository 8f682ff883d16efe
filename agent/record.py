"""One optimizer step's numbers: device tensors until the sender thread turns them into wire JSON.

Leaf module: imports torch only.

The training thread adds 0-d or 1-d tensors with :meth:`StepRecord.add` and
host values into :attr:`StepRecord.host`; :meth:`StepRecord.seal` concatenates
the tensors into one flat float32 vector and starts a single copy to the host
(on CUDA non-blocking into pinned memory, followed by an event). Nothing here
reads a device value in the training thread. The sender thread calls
:meth:`StepRecord.values`, which waits for the event and converts the vector
to Python floats once.
"""
from __future__ import annotations

import math
import time
from typing import Any, Optional

import torch


class StepRecord:
    __slots__ = ("step", "host", "parts", "layout", "vector", "event", "stream")

    def __init__(self, step: int):
        self.step = step
        self.host: dict[str, Any] = {}
        self.parts: list[tuple[str, torch.Tensor]] = []
        self.layout: list[tuple[str, int]] = []
        self.vector: Optional[torch.Tensor] = None
        self.event = None
        self.stream = None   # the training thread's CUDA stream, for a record sealed by the sender thread

    def add(self, key: str, tensor: torch.Tensor) -> None:
        self.parts.append((key, tensor))

    def seal(self) -> None:
        """Flatten the device parts into one vector and start its copy to the host (no sync)."""
        if not self.parts:
            return
        if self.stream is not None:
            with torch.cuda.stream(self.stream):   # sealed outside the training thread: queue behind its work
                self._seal()
        else:
            self._seal()

    def _seal(self) -> None:
        by_device: dict[torch.device, list[tuple[str, torch.Tensor]]] = {}
        for key, t in self.parts:
            by_device.setdefault(t.device, []).append((key, t))
        layout: list[tuple[str, int]] = []
        host_vectors = []
        for device, items in by_device.items():
            flat = [_flat32(t) for _, t in items]
            layout.extend((key, f.numel()) for (key, _), f in zip(items, flat))
            vec = torch.cat(flat) if len(flat) > 1 else flat[0].clone()
            if device.type == "cpu":
                host_vectors.append(vec)
            else:
                pinned = torch.empty(vec.shape, dtype=vec.dtype, device="cpu",
                                     pin_memory=device.type == "cuda")
                pinned.copy_(vec, non_blocking=True)
                host_vectors.append(pinned)
                if device.type == "cuda":
                    self.event = torch.cuda.Event()
                    self.event.record(torch.cuda.current_stream(device))
        self.layout = layout
        self.vector = host_vectors[0] if len(host_vectors) == 1 else host_vectors
        self.parts = []

    def values(self) -> dict[str, list[float]]:
        """Sender thread only: wait for the copy, then split the vector by key."""
        if self.vector is None:
            return {}
        if self.event is not None:
            # Poll instead of synchronize(): never a blocking CUDA call, and the GIL is free meanwhile.
            while not self.event.query():
                time.sleep(0.0005)
        vectors = self.vector if isinstance(self.vector, list) else [self.vector]
        flat: list[float] = []
        for v in vectors:
            flat.extend(v.tolist())
        out: dict[str, list[float]] = {}
        pos = 0
        for key, n in self.layout:
            out[key] = flat[pos:pos + n]
            pos += n
        return out


def _flat32(t: torch.Tensor) -> torch.Tensor:
    if t.requires_grad:
        t = t.detach()
    if t.dim() != 1:
        t = t.reshape(-1)
    return t if t.dtype == torch.float32 else t.to(torch.float32)


def finite(x: Optional[float]) -> bool:
    return x is not None and math.isfinite(x)
