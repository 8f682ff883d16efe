"""The ground-truth precursor: the true max attention logit of every attention call of a forward, recorded
by a TorchFunctionMode of this benchmark's own (independent of gradwatch's agent/capture/attention.py).

Seen: a softmax over the last dimension of a tensor of 3 or more dimensions (its input is the logits;
HF eager, hand-written 4-D, fairseq-style 3-D after bmm/baddbmm, einsum), and
``scaled_dot_product_attention`` (q·kᵀ·scale recomputed, grouped-query heads repeated, its boolean or
float mask applied), and ``multi_head_attention_forward`` (``nn.MultiheadAttention``: q and k projected
from ``in_proj_weight``, per head, its ``attn_mask`` or causal mask applied). The value of a call is the max over its finite entries.
Not attention: a softmax called by a module whose class name ends in ``Router`` (Hugging Face's Switch Transformers
softmaxes its router logits over ``[batch, seq, experts]``); it goes to :meth:`TrueLogits.router_call`, which
``router.py`` records.
"""
from __future__ import annotations

import math
import sys

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

_SOFTMAX = {F.softmax, torch.softmax, torch.Tensor.softmax}


def called_by_router(frame, depth: int = 8) -> bool:
    """Whether a module whose class name ends in ``Router`` (Hugging Face's router classes) has its ``forward`` among
    the ``depth`` frames from ``frame`` up: by the benchmark's knowledge of the models it builds."""
    for _ in range(depth):
        if frame is None:
            return False
        owner = frame.f_locals.get("self")
        if owner is not None and type(owner).__name__.endswith("Router"):
            return True
        frame = frame.f_back
    return False


def _max_finite(x: torch.Tensor) -> float:
    x = x.detach().float()
    x = x[torch.isfinite(x)]
    return float(x.max()) if x.numel() else math.nan


class TrueLogits(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.values: list[float] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _SOFTMAX:
            x = args[0]
            dim = kwargs.get("dim", args[1] if len(args) > 1 else None)
            if isinstance(x, torch.Tensor) and x.dim() >= 3 and dim in (-1, x.dim() - 1):
                if called_by_router(sys._getframe(1)):
                    self.router_call(x.detach().reshape(-1, x.shape[-1]))
                else:
                    self.note(x.detach())
        elif func is F.scaled_dot_product_attention:
            self.note(self._sdpa(*args, **kwargs))
        elif func is F.multi_head_attention_forward:
            self.note(self._mha(*args, **kwargs))
        return func(*args, **kwargs)

    def router_call(self, logits: torch.Tensor) -> None:
        """A router's softmax over 3 or more dimensions (its logits, flattened to ``[tokens, experts]``): not
        attention, so not recorded here; ``router.py``'s subclass records it."""

    def note(self, scores: torch.Tensor) -> None:
        """One attention call's scores (the softmax's input, masked entries -inf): its max is recorded.
        A subclass records more of the same scores (precursors.py)."""
        self.values.append(_max_finite(scores))

    @staticmethod
    def _sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False, **_):
        with torch.no_grad():
            q, k = q.detach().float(), k.detach().float()
            if k.shape[-3] != q.shape[-3] and q.dim() >= 3:
                k = k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)
            s = (q @ k.transpose(-2, -1)) * (scale if scale is not None else q.shape[-1] ** -0.5)
            if is_causal:
                L, S = s.shape[-2], s.shape[-1]
                s = s.masked_fill(~torch.ones(L, S, dtype=torch.bool).tril(), float("-inf"))
            if attn_mask is not None:
                s = s.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool else s + attn_mask
            return s

    @staticmethod
    def _mha(query, key, value, embed_dim_to_check, num_heads, in_proj_weight, in_proj_bias, *rest,
             attn_mask=None, is_causal=False, **kw):
        with torch.no_grad():
            E = query.shape[-1]
            w = in_proj_weight.detach().float()
            b = in_proj_bias.detach().float() if in_proj_bias is not None else torch.zeros(3 * E)
            q = F.linear(query.detach().float(), w[:E], b[:E])          # (L, N, E)
            k = F.linear(key.detach().float(), w[E:2 * E], b[E:2 * E])  # (S, N, E)
            L, N, S, dh = q.shape[0], q.shape[1], k.shape[0], E // num_heads
            q = q.reshape(L, N * num_heads, dh).transpose(0, 1)
            k = k.reshape(S, N * num_heads, dh).transpose(0, 1)
            s = (q @ k.transpose(-2, -1)) * dh ** -0.5
            if attn_mask is not None:
                s = s.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool else s + attn_mask
            elif is_causal:
                s = s.masked_fill(~torch.ones(L, S, dtype=torch.bool).tril(), float("-inf"))
            return s

    def take(self) -> list[float]:
        out, self.values = self.values, []
        return out
