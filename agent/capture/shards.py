"""Which part of each parameter this rank holds, and the local tensors to measure.

Leaf module: imports torch only, and reads host-side metadata only (DTensor
placements and device-mesh coordinates, FSDP1 handles and process-group
ranks): nothing here issues a collective or reads a device value.

A parameter's layout is ``(index, count)``: the full parameter is cut into
``count`` disjoint pieces and this rank holds piece ``index`` (``count == 1``:
the whole parameter, replicated or single-process; ``count == 0``: a layout
whose norms cannot be combined, e.g. a ``Partial`` placement). Ranks that
hold the same index hold the same elements (replicas, as in HSDP's replicate
dimension), so the server takes one of them; pieces with different indices
are disjoint, so their sums of squares add up to the full parameter's.

>>> p = torch.nn.Parameter(torch.ones(3))
>>> shard_layout(torch.nn.Linear(1, 1), [p]) is None     # nothing sharded: the single-process path
True
"""
from __future__ import annotations

import sys
from typing import Optional, Sequence

import torch


def dtensor_class():
    """torch's DTensor class if anything imported it, else None: a tensor can only be a DTensor once its
    module is loaded, and importing it here would cost every attach ~0.5 s (measured on CPU)."""
    module = sys.modules.get("torch.distributed.tensor")
    return getattr(module, "DTensor", None)


def _dtensor_layout(p) -> tuple[int, int]:
    from torch.distributed.tensor.placement_types import Partial, Replicate, Shard
    mesh = p.device_mesh
    coord = mesh.get_coordinate()   # this rank's place in the mesh: host metadata
    if coord is None:
        return 0, 0
    index, count = 0, 1
    for dim, placement in enumerate(p.placements):
        if isinstance(placement, Shard):   # _StridedShard too: still disjoint pieces
            size = mesh.size(dim)
            index, count = index * size + coord[dim], count * size
        elif isinstance(placement, Partial) or not isinstance(placement, Replicate):
            return 0, 0
    return index, count


def _fsdp1_handles(model: torch.nn.Module) -> list:
    """The flat-parameter handles of the model's FSDP1 (``FullyShardedDataParallel``) units."""
    module = sys.modules.get("torch.distributed.fsdp")   # only a job that imported FSDP can use it
    FullyShardedDataParallel = getattr(module, "FullyShardedDataParallel", None)
    if FullyShardedDataParallel is None:
        return []
    handles = (getattr(m, "_handle", None) for m in model.modules() if isinstance(m, FullyShardedDataParallel))
    return [h for h in handles if h is not None]


def forward_swaps_weights(model: torch.nn.Module) -> bool:
    """Whether the model's forward and backward swap its parameters' storage while they run: a sharded
    FSDP1 unit points its flat parameter (and the original parameters viewing into it) at the gathered
    full tensor, then back at this rank's shard. Another thread reading the weights during a forward then
    reads the wrong tensors (measured: the EMA worker thread, descheduled into the next forward, found
    the flat parameter at its full 467 elements instead of the 234 of its shard, and the step lost its
    EMA divergence). FSDP2 keeps its sharded DTensors and gathers into other tensors: False."""
    return any(h.uses_sharded_strategy for h in _fsdp1_handles(model))


def _fsdp1_layouts(model: torch.nn.Module) -> dict[int, tuple[int, int]]:
    """FSDP1 (``FullyShardedDataParallel``): the flat parameter, and with ``use_orig_params=True`` the
    original parameters viewing into it, hold this rank's piece of its process group's shards."""
    out: dict[int, tuple[int, int]] = {}
    for handle in _fsdp1_handles(model):
        if handle.uses_sharded_strategy:
            group = handle.process_group
            layout = (torch.distributed.get_rank(group), torch.distributed.get_world_size(group))
        else:
            layout = (0, 1)
        flat = handle.flat_param
        out[id(flat)] = layout
        for p in list(getattr(flat, "_params", None) or ()) + list(getattr(flat, "_shared_params", None) or ()):
            out[id(p)] = layout
    return out


def shard_layout(model: torch.nn.Module, params: Sequence[torch.Tensor]) -> Optional[list[tuple[int, int]]]:
    """Each parameter's ``(index, count)``, or None when no parameter is sharded and none is a DTensor
    (single process, DDP): the agent then measures exactly as it always did."""
    initialised = torch.distributed.is_available() and torch.distributed.is_initialized()
    fsdp1 = _fsdp1_layouts(model) if initialised else {}
    DTensor = dtensor_class()
    layouts = []
    local = False
    for p in params:
        if DTensor is not None and isinstance(p, DTensor):
            layouts.append(_dtensor_layout(p))
            local = True
        else:
            layouts.append(fsdp1.get(id(p), (0, 1)))
    if not local and all(c == 1 for _, c in layouts):
        return None
    return layouts


def local_tensor(t):
    """The tensor this rank holds: a DTensor's local shard (no communication), anything else as it is."""
    if t.__class__ is torch.Tensor or t.__class__ is torch.nn.Parameter:
        return t
    DTensor = dtensor_class()
    if DTensor is not None and isinstance(t, DTensor):
        return t._local_tensor
    return t


def local_tensors(tensors: Sequence) -> list:
    return [local_tensor(t) for t in tensors]


def local_grads(params: Sequence[torch.Tensor]) -> list:
    """The parameters' grads as local tensors (None where a parameter has no grad). A rank that holds
    no element of a parameter (FSDP1 with ``use_orig_params``: an empty piece, and no grad) measures
    its empty piece, norm 0, so the server sees every piece reported."""
    out = []
    for p in params:
        g = p.grad
        if g is None:
            mine = local_tensor(p)
            out.append(mine.detach() if mine.numel() == 0 else None)
        else:
            out.append(local_tensor(g))
    return out
