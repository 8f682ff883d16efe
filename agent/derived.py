"""Signals computed from other measured values, each by one function.

A derived signal is computed where its inputs come together: for one process in the sender thread
(:mod:`agent.wire`, from the step record's parts), for a sharded run on the server, once a step's last
rank arrived (:mod:`server.storage.ranks`, from the ranks' combined pieces). Both call the functions here, so
the two can never disagree on an edge (a zero or a non-finite norm). The signal table
(:mod:`agent.signals`) names each derived signal's per-process inputs (``derived_from``);
:data:`DERIVE` maps the signal to its function.

Leaf module: standard library only, so the server imports it where torch is not installed.
"""
from __future__ import annotations

import math
import struct
from typing import Callable, Optional, Sequence, Union


def clipped(grad_norm: Optional[float], max_norm: Optional[float]) -> Optional[bool]:
    """Whether ``clip_grad_norm_`` scaled the gradients: the pre-clip norm exceeded ``max_norm``.

    None when either is unknown, or the norm is NaN (nothing can be said of a NaN norm; an infinite
    one did exceed it).

    >>> clipped(2.0, 1.0), clipped(0.5, 1.0), clipped(math.inf, 1.0), clipped(math.nan, 1.0), clipped(None, 1.0)
    (True, False, True, None, None)
    """
    if grad_norm is None or max_norm is None or math.isnan(grad_norm):
        return None
    return bool(grad_norm > max_norm)


def ema_divergence(diff_norm: Optional[float], weight_norm: Optional[float]) -> Optional[float]:
    """‖θ_ema − θ‖ / ‖θ‖ over the parameters the EMA holds, from the two norms.

    NaN when ‖θ‖ is 0 or NaN (a ratio to nothing is no number); None when either norm is unknown.

    >>> ema_divergence(1.0, 4.0), ema_divergence(1.0, 0.0), ema_divergence(None, 4.0)
    (0.25, nan, None)
    """
    if diff_norm is None or weight_norm is None:
        return None
    return diff_norm / weight_norm if weight_norm else math.nan


def update_ratios(update_norms: Sequence[float], weight_norms: Sequence[float]) -> list[float]:
    """Per parameter ‖Δθ‖ / ‖θ‖ of the step's update, from each parameter's two norms.

    A parameter whose weights are all zero reads 0 when it did not move, +Inf when it did; a NaN norm
    gives NaN.

    >>> update_ratios([1.0, 0.0, 2.0, 1.0], [4.0, 0.0, 0.0, math.nan])
    [0.25, 0.0, inf, nan]
    """
    return [u / w if w else (0.0 if u == 0 else math.inf) for u, w in zip(update_norms, weight_norms)]


_F32 = struct.Struct("<f")


def share(part: Union[None, float, Sequence[Optional[float]]],
          whole: Union[None, float, Sequence[Optional[float]]]):
    """``part`` of ``whole`` elements as a share: of two counts (the model's), or elementwise of two
    sequences of counts (per parameter, a list). 0 of 0 elements is no share, and neither is a count not
    measured (None or NaN, the wire's "not measured" read back): None.

    A float32 number, as the counts are (one process counts on the device in float32, and the ranks send
    float32 arrays): a share computed from them is the same number in one process and on a sharded run's
    combined row.

    >>> share(1.0, 4.0), share(0.0, 0.0), share(None, 4.0), share([1.0, 0.0, 2.0], [3.0, 0.0, math.nan])
    (0.25, None, None, [0.3333333432674408, None, None])
    """
    if isinstance(part, (list, tuple)) or isinstance(whole, (list, tuple)):
        return [share(p, w) for p, w in zip(part or (), whole or ())]
    if part is None or whole is None or not whole or math.isnan(whole) or math.isnan(part):
        return None
    return _F32.unpack(_F32.pack(part / whole))[0]


# derived signal (a step signal or a per-layer statistic of the table) -> the function computing it from its
# inputs, in the order of its ``derived_from``. A name that is both (grad_zero_fraction) has one function,
# taking the step's numbers or the per-layer sequences.
DERIVE: dict[str, Callable] = {
    "clipped": clipped,
    "ema_divergence": ema_divergence,
    "update_ratio": update_ratios,
    "grad_zero_fraction": share,
}
