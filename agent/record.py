"""One optimizer step's numbers: device tensors until the sender thread turns them into wire JSON.

Leaf module: imports torch only.

The training thread adds 0-d or 1-d tensors with :meth:`StepRecord.add` and
host values into :attr:`StepRecord.host`, both under the signal table's names
(:mod:`agent.signals`: ``"loss"``, ``"layers.grad_norm"`` …); :meth:`StepRecord.seal` concatenates
the tensors into one flat float32 vector and starts a single copy to the host
(on CUDA non-blocking into pinned memory, followed by an event). What travels
between the step builder, the sealer and the wire besides the table's names
has named fields: the step's two loss sums and the one place that chooses
between them (:meth:`StepRecord.take_loss`), the user's custom scalars, the
loop's reports of step signals held for the step's end, the scaler's state,
the NaN replay's finding. Nothing here
reads a device value in the training thread. The sender thread calls
:meth:`StepRecord.read`, which waits for the event and copies the vector's
bytes out once (one memcpy, no Python object per value): per-layer arrays go
on the wire as those bytes (base64), and only the few scalars become Python
floats.
"""
from __future__ import annotations

import ctypes
import math
import struct
import sys
import time
from array import array
from typing import Any, Optional

import torch


class StepRecord:
    __slots__ = ("step", "host", "parts", "index", "layout", "vector", "event", "stream", "later",
                 "scaled_loss", "logged_loss", "custom", "custom_dev", "reported", "scaler_active", "nan_replay",
                 "lr_factor")

    def __init__(self, step: int):
        self.step = step
        self.host: dict[str, Any] = {}
        # The step's plumbing, named (agent/step_builder.py fills it, agent/sealer.py and agent/wire.py read it).
        # Its two loss sums over the micro-batches, on their device (a number for a loss logged as one): what
        # the GradScaler's scale() was given, and what monitor.log(loss=...) reported; take_loss() picks.
        self.scaled_loss: Any = None
        self.logged_loss: Any = None
        # monitor.log's own scalars ("custom:<key>" on the wire): numbers, and 0-d tensors (parts at the seal)
        self.custom: Optional[dict[str, float]] = None
        self.custom_dev: Optional[dict[str, torch.Tensor]] = None
        # the loop's reports of step signals (agent/owners.py, LOOP_REPORTS) during the step: each goes to
        # its signal's owner when the step ends
        self.reported: Optional[dict[str, Any]] = None
        self.scaler_active = False   # a loss scaler scaled this step (its overflow is stored, a NaN grad is its)
        self.nan_replay: Optional[dict] = None   # the NaN replay's finding for this step (agent/capture/replay.py)
        # remediation cooled this step's update by this factor (agent/rewinder.py): the LR's owner applies it
        self.lr_factor: Optional[float] = None
        self.parts: list[tuple[str, torch.Tensor]] = []
        # "layers.<stat>" part -> the layers (parameters, modules) its values belong to, where not all in order
        self.index: dict[str, list[int]] = {}
        self.layout: list[tuple[str, int]] = []
        self.vector: Optional[torch.Tensor] = None
        self.event = None
        self.stream = None   # the training thread's CUDA stream, for a record sealed by the sender thread
        # host values the sender thread computes when it reads the record: name -> (function, argument)
        self.later: Optional[dict[str, tuple[Any, Any]]] = None

    def add_later(self, key: str, compute: Any, argument: Any) -> None:
        """A host value ``compute(argument)`` worked out on the sender thread (:meth:`read`), off the
        training thread's step: ``argument`` must be a snapshot nothing changes afterwards."""
        if self.later is None:
            self.later = {}
        self.later[key] = (compute, argument)

    def take_loss(self) -> Any:
        """The step's loss, and the two sums forgotten: the one choice between them, made here only.

        The loss the loop logged (``monitor.log(loss=...)``) wins: it is the loss as the loop sees it,
        while a GradScaler's ``scale()`` may be given something else (several losses, an auxiliary
        term); without a logged loss, the sum of what ``scale()`` was given. None: neither.
        """
        loss = self.logged_loss if self.logged_loss is not None else self.scaled_loss
        self.logged_loss = self.scaled_loss = None
        return loss

    def keep_custom(self, key: str, value: Any) -> None:
        """A custom scalar of the step (``custom:<key>`` on the wire): a float, or a 0-d tensor (a part at
        the seal, read with the others)."""
        if isinstance(value, torch.Tensor):
            if self.custom_dev is None:
                self.custom_dev = {}
            self.custom_dev[key] = value
        else:
            if self.custom is None:
                self.custom = {}
            self.custom[key] = value

    def hold_report(self, key: str, value: Any) -> None:
        """The loop's report of a step signal during the step, for its owner at the step's end (the last one wins)."""
        if self.reported is None:
            self.reported = {}
        self.reported[key] = value

    def add(self, key: str, tensor: torch.Tensor, index: Optional[list[int]] = None) -> None:
        """A 0-d or 1-d tensor (a higher-dimensional one is flattened). ``index``: for a per-layer part that
        holds only some layers, the layer of each value (the others go out "not measured")."""
        if tensor.__class__ is not torch.Tensor:
            # a DTensor part would make the whole vector a DTensor (a wrapper without storage: its bytes
            # read as garbage) or fail the concatenation: keep what this rank holds, no collective
            dtensor = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)
            if dtensor is not None and isinstance(tensor, dtensor):
                tensor = tensor._local_tensor
        self.parts.append((key, tensor if tensor.dim() < 2 else tensor.reshape(-1)))
        if index is not None:
            self.index[key] = index

    def seal_unless_cpu(self) -> None:
        """The sealer's seal: a record whose parts all lie in CPU memory is left for :meth:`read` to
        seal on the sender thread (they are final values already, and a concatenation on the training
        thread cost ~40 us a step of the overhead bench: the first torch call after a step's work runs
        with cold caches); one with device parts is sealed now, behind the training thread's work."""
        for _, t in self.parts:
            if not t.is_cpu:
                self.seal()
                return

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
        parts = self.parts
        try:
            # One op for the usual record (every part on one device): hstack makes 0-d parts 1-d,
            # concatenates and promotes mixed dtypes; it always allocates a new vector.
            vec = torch.hstack([t for _, t in parts])
        except RuntimeError:   # parts on different devices
            self._seal_by_device()
            return
        if vec.requires_grad:
            vec = vec.detach()
        if vec.dtype != torch.float32:
            vec = vec.float()
        self.layout = [(key, t.numel()) for key, t in parts]
        device = vec.device
        if device.type == "cpu":
            self.vector = vec
        else:
            self.vector = self._to_host(vec, device)
        self.parts = []

    def _to_host(self, vec: torch.Tensor, device: torch.device) -> torch.Tensor:
        pinned = torch.empty(vec.shape, dtype=vec.dtype, device="cpu", pin_memory=device.type == "cuda")
        pinned.copy_(vec, non_blocking=True)
        if device.type == "cuda":
            self.event = torch.cuda.Event()
            self.event.record(torch.cuda.current_stream(device))
        return pinned

    def _seal_by_device(self) -> None:
        by_device: dict[torch.device, list[tuple[str, torch.Tensor]]] = {}
        for key, t in self.parts:
            by_device.setdefault(t.device, []).append((key, t))
        layout: list[tuple[str, int]] = []
        host_vectors = []
        for device, items in by_device.items():
            flat = [_flat32(t) for _, t in items]
            layout.extend((key, f.numel()) for (key, _), f in zip(items, flat))
            vec = torch.cat(flat) if len(flat) > 1 else flat[0].clone()
            host_vectors.append(vec if device.type == "cpu" else self._to_host(vec, device))
        self.layout = layout
        self.vector = host_vectors[0] if len(host_vectors) == 1 else host_vectors
        self.parts = []

    def read(self) -> "StepValues":
        """Sender thread only: wait for the copy, then take the vector's float32 bytes (a record left
        unsealed, :meth:`seal_unless_cpu`, is sealed here); the :meth:`add_later` host values are
        computed too."""
        later, self.later = self.later, None
        for key, (compute, argument) in (later or {}).items():
            try:
                self.host[key] = compute(argument)
            except Exception:  # noqa: BLE001 - the value is left out; the step's other numbers still go
                pass
        if self.parts:
            self.seal()
        if self.vector is None:
            return StepValues(b"", {})
        if self.event is not None:
            # Poll instead of synchronize(): never a blocking CUDA call, and the GIL is free meanwhile.
            while not self.event.query():
                time.sleep(0.0005)
        vectors = self.vector if isinstance(self.vector, list) else [self.vector]
        chunks = [_host_bytes(v) for v in vectors]
        raw = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        where: dict[str, tuple[int, int]] = {}
        pos = 0
        for key, n in self.layout:
            where[key] = (pos, n)
            pos += n
        return StepValues(raw, where)


class StepValues:
    """A sealed record's numbers: little-endian float32 bytes and where each key's values lie.

    >>> v = StepValues(struct.pack("<3f", 2.0, 0.5, 1.5), {"loss": (0, 1), "grad_norms": (1, 2)})
    >>> v.scalar("loss"), v.floats("grad_norms"), v.scalar("lr"), len(v.f32("grad_norms"))
    (2.0, [0.5, 1.5], None, 8)
    """

    __slots__ = ("raw", "where")

    def __init__(self, raw: bytes, where: dict[str, tuple[int, int]]):
        self.raw = raw
        self.where = where

    def __contains__(self, key: str) -> bool:
        return key in self.where

    def keys(self):
        return self.where.keys()

    def scalar(self, key: str) -> Optional[float]:
        """The key's first value as a Python float, None when the record has no such part."""
        at = self.where.get(key)
        if at is None or not at[1]:
            return None
        return _F32.unpack_from(self.raw, 4 * at[0])[0]

    def floats(self, key: str) -> Optional[list[float]]:
        """The key's values as Python floats (only where a step needs them one by one)."""
        at = self.where.get(key)
        if at is None:
            return None
        return list(struct.unpack_from(f"<{at[1]}f", self.raw, 4 * at[0]))

    def f32(self, key: str) -> Optional[bytes]:
        """The key's values as little-endian float32 bytes, as they are (the compact wire form)."""
        at = self.where.get(key)
        if at is None:
            return None
        return self.raw[4 * at[0]:4 * (at[0] + at[1])]


_F32 = struct.Struct("<f")


def cpu_bytes(t: torch.Tensor) -> bytes:
    """A CPU tensor's memory as bytes (native byte order), copied out in one go.

    ``ctypes.string_at`` reads the tensor's memory directly: torch tensors do not export the
    buffer protocol, and going through numpy would make it a dependency of the agent (an
    agent-only install has none).

    >>> cpu_bytes(torch.tensor([1, 2, 255], dtype=torch.uint8))
    b'\\x01\\x02\\xff'
    """
    if not t.is_contiguous():
        t = t.contiguous()
    return ctypes.string_at(t.data_ptr(), t.numel() * t.element_size())


def _host_bytes(v: torch.Tensor) -> bytes:
    """A float32 CPU tensor's values as little-endian bytes."""
    raw = cpu_bytes(v)
    if sys.byteorder != "little":
        a = array("f")
        a.frombytes(raw)
        a.byteswap()
        raw = a.tobytes()
    return raw


def _flat32(t: torch.Tensor) -> torch.Tensor:
    if t.requires_grad:
        t = t.detach()
    if t.dim() != 1:
        t = t.reshape(-1)
    return t if t.dtype == torch.float32 else t.to(torch.float32)


def finite(x: Optional[float]) -> bool:
    return x is not None and math.isfinite(x)
