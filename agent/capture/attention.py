"""Attention logits where attention is computed: a torch function mode for one forward.

Name lists miss someone's model (issue 33: ``self.h`` / ``self.dh``, GPT-NeoX's fused
``query_key_value``, a ``to_qkv`` with einsum and a learned temperature), so the agent does not look
for attention by attribute names. On a sampled step's first training forward it enters
:class:`AttentionLogitMode`, a :class:`torch.overrides.TorchFunctionMode`, and sees the three ways
PyTorch code computes attention:

* ``softmax`` over the last dimension of a 4-D ``[batch, heads, query, key]`` tensor
  (``F.softmax``, ``torch.softmax``, ``Tensor.softmax``, ``nn.Softmax``): **the logits are the
  softmax's input**, whatever made it (an explicit ``q @ kᵀ / √d``, an einsum, a learned
  temperature, rotary embeddings applied before, an additive position bias such as T5's or ALiBi,
  the mask added as ``finfo.min`` or ``-inf``);
* ``F.scaled_dot_product_attention(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa)``:
  the fused kernel never shows its logits, so they are recomputed from its own ``q`` and ``k``
  (after any rotary embedding, since those are the tensors it was given): ``q·kᵀ·scale`` with its
  ``scale`` argument (else ``1/√E``), the key heads repeated for grouped-query attention, a float
  ``attn_mask`` added, the entries a boolean ``attn_mask`` or ``is_causal`` masks left out;
* ``F.multi_head_attention_forward`` (``nn.MultiheadAttention``, ``nn.Transformer*Layer``): per head
  ``q·kᵀ/√head_dim`` from its in-projection, ``bias_k`` / ``add_zero_attn`` keys, ``attn_mask`` and
  ``key_padding_mask`` applied as it applies them.

* ``softmax`` over the last dimension of a 3-D ``[batch·heads, query, key]`` tensor **computed from a
  batched product of two activations**: ``torch.bmm`` / ``torch.baddbmm`` (fairseq's
  ``MultiheadAttention``, older Megatron, many research codebases), or a ``matmul`` / ``@`` / ``einsum``
  of 3-D tensors giving a 3-D result. A 3-D softmax alone cannot be told from a classifier's, so the
  mode follows the products' outputs (:meth:`AttentionLogitMode._follow`, by object, weakly held)
  through the shape and value operations attention code applies between the product and the softmax
  (``view`` / ``reshape`` / ``transpose`` to 4-D and back, ``masked_fill``, an additive mask or bias,
  ``*`` / ``/`` by a scale, ``float()`` / ``.to``, ``torch.where``): the softmax's input is the logits,
  as for the 4-D case (the scaling folded into q, baddbmm's ``alpha`` and its additive ``input``, the
  mask: whatever the model fed its softmax). A product with a parameter as an operand (a batched
  linear layer: ``torch.bmm(x, w.expand(...))``, ``w.repeat(...)``, ``torch.baddbmm(b, x, w)``; a
  parameter only reshaped, copied or cast, read from the autograd graph) is not followed, nor is a
  product whose output is never softmaxed over its last dimension (the second bmm of attention,
  ``probs @ v``, or any other use): only a softmax makes a product attention.

A softmax over any other shape or dimension is not attention and passes untouched (a 3-D softmax over
a tensor no followed product made, a classifier's say, is not seen), with one exception:

* ``softmax`` over the last dimension of a 2-D ``[tokens, experts]`` or 3-D ``[batch, seq, experts]`` tensor (a
  3-D one no followed product made) of at most :data:`MAX_EXPERTS` columns, **whose output the same forward routes
  by** (``topk``, ``max`` or ``argmax`` called on it, or on a cast or copy of it: :data:`ROUTER_CASTS`), is a
  **mixture of experts' router** (Switch, Mixtral, Qwen-MoE, OLMoE, DeepSeek-V2: ``softmax(router(x), dim=-1)``
  over the flattened tokens, then the top experts; Hugging Face's Switch Transformers: over ``[batch, seq,
  experts]``, ``.to(input_dtype)``, then ``argmax``). It is not attention; its figure, :func:`router_logit_spread`
  (the largest spread of one token's logits, max - min: what decides how one-hot its routing is), goes to the
  mode's ``router`` callback, credited to a module as attention is, once the routing call is seen. A classifier's
  probabilities that nothing routes by are not taken; one whose own forward takes the ``argmax`` of its
  probabilities (a head returning its predictions) looks like a router and is taken as one, under that module's
  name. Not seen: a softmax over the top-k logits only (no routing call follows it), a routing call on
  probabilities changed by arithmetic first (``probs * mask``), and a sigmoid router (DeepSeek-V3: ``sigmoid`` of
  the logits, a bias added, then ``topk``), whose saturation a spread would not describe. Seen again: a model that
  softmaxes and routes every layer's router logits a second time in its own forward, for a load-balancing loss
  (Hugging Face's Mixtral, Qwen-MoE and OLMoE with ``output_router_logits=True``: layer by layer, or all layers at
  once). Those figures are the layers' spreads again; the agent credits them to no module (the root is not a
  watched module), so they leave the step's figure, the largest, as it was.

The value is the **max over every unmasked logit** of the call (all samples, heads, query and key
positions), kept as a 0-d tensor on the device (no host sync); a masked entry (``-inf``, or a
``finfo.min`` fill) never wins a max. It is **credited to the innermost module** of the watched
model whose ``forward`` is on the Python stack at the call: the frames are walked up from the call
to the first one whose ``self`` is one of the watched modules (``nn.Softmax`` wrappers skipped, so a
``self.softmax = nn.Softmax(-1)`` credits its attention module). A helper function called with the
module as an argument (Hugging Face's ``eager_attention_forward(module, q, k, v, ...)``) is seen
through: its caller's frame holds the module as ``self``.

Cost: only while the mode is on (the sampled forward): every torch call of that forward passes
through :meth:`AttentionLogitMode.__torch_function__` (a dict look-up and the call), the attention
calls add one ``amax`` (softmax) or one batched ``q·kᵀ`` in chunks of at most :data:`CHUNK_LOGITS`
logits (SDPA, MHA), and one short frame walk each; a 3-D product adds a parameter test and a weak
reference to its output, and the shape and value operations a dict test while any product is followed
(none otherwise). An SDPA call whose ``q`` and ``k`` autograd keeps
anyway is scored when the forward is over (:meth:`AttentionLogitMode.leave`), the products one after
another rather than each between the model's own work, with its caches cold (2.5 -> 1.8 ms a sampled
forward of the overhead bench's 12-block model). Nothing on other steps.

Within the mode's handler the mode is off (PyTorch pops it), so the logits' own computation is not
seen again, and neither are the calls a handled Python function makes inside it.
"""
from __future__ import annotations

import inspect
import math
import sys
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from gradwatch.agent.capture.shards import local_tensor

import weakref

# one chunk of recomputed logits holds at most this many (64 MB in float32)
CHUNK_LOGITS = 1 << 24
# the q and k tensors of SDPA calls held until the forward is over, at most (AttentionLogitMode._defer)
DEFER_BYTES = 64 << 20
# how far up the Python stack a call's module is looked for
MAX_FRAMES = 64
# 3-D products (and what they became) followed in one forward, at most: past it the dead ones are dropped,
# and if all are alive nothing new is followed (a model with more products than this a forward is not one
# whose 3-D attention this can promise to see)
MAX_FOLLOWED = 4096
# the widest softmax taken for a router (experts per layer; Switch-C has 2048)
MAX_EXPERTS = 2048
# What a router's probabilities may pass through, by name, between the softmax and the routing call: casts and
# copies only (an arithmetic result, ``probs * mask`` say, is no longer the router's own distribution)
ROUTER_CASTS = frozenset(("to", "float", "half", "bfloat16", "double", "type", "type_as", "clone", "contiguous"))

# What a call is, by the function object PyTorch hands the mode. Another library may have wrapped one of
# these (a profiler's pass-through around F.scaled_dot_product_attention, installed before or after this
# import): torch then hands over the original or the wrapper, so both are matched — the functions as
# imported here and as they are now, unwrapped through ``__wrapped__`` — and, last, by the name of torch's
# own function. (tests/agent/test_attention_zoo.py, the pass-through wrapper cases.)
_KINDS = {"softmax": "softmax", "special_softmax": "softmax", "scaled_dot_product_attention": "sdpa",
          "multi_head_attention_forward": "mha",
          # batched products whose 3-D output may be attention scores (followed to a softmax)
          "bmm": "product", "baddbmm": "product", "matmul": "product", "__matmul__": "product",
          "__rmatmul__": "product", "einsum": "product"}
# What attention code does to the scores between the product and the softmax: the result of one of these
# with a followed tensor among its first three arguments is followed too (by name: the function and the
# Tensor method share it; the in-place forms return the tensor itself, already followed)
# The routing calls: a kept softmax output (2-D or 3-D) passed to one of these is a router's (by name, as above)
_KINDS.update({name: "route" for name in ("topk", "max", "argmax")})
_KINDS.update({name: "carry" for name in (
    "view", "reshape", "view_as", "reshape_as", "transpose", "permute", "contiguous", "unsqueeze", "squeeze",
    "float", "half", "bfloat16", "double", "to", "type", "type_as", "clone",
    "masked_fill", "where", "add", "sub", "mul", "div", "true_divide", "clamp", "clamp_min", "clamp_max",
    "__add__", "__radd__", "__iadd__", "__sub__", "__isub__", "__mul__", "__rmul__", "__imul__",
    "__truediv__", "__itruediv__", "__getitem__", "masked_fill_", "add_", "sub_", "mul_", "div_")})
_ORIGINALS = {inspect.unwrap(f): kind for f, kind in (
    (F.softmax, "softmax"), (torch.softmax, "softmax"), (torch.Tensor.softmax, "softmax"),
    (torch.special.softmax, "softmax"), (torch._C._nn.scaled_dot_product_attention, "sdpa"),
    (F.scaled_dot_product_attention, "sdpa"), (F.multi_head_attention_forward, "mha"))}
# multi_head_attention_forward's parameters, in order (torch 2.x), for when the function here is a wrapper
# that hides its signature ((*args, **kwargs), installed before this import without functools.wraps)
_MHA_PARAMETERS = ("query", "key", "value", "embed_dim_to_check", "num_heads", "in_proj_weight", "in_proj_bias",
                   "bias_k", "bias_v", "add_zero_attn", "dropout_p", "out_proj_weight", "out_proj_bias", "training",
                   "key_padding_mask", "need_weights", "attn_mask", "use_separate_proj_weight", "q_proj_weight",
                   "k_proj_weight", "v_proj_weight", "static_k", "static_v", "average_attn_weights", "is_causal")
_MHA_DEFAULTS = {"training": True, "key_padding_mask": None, "need_weights": True, "attn_mask": None,
                 "use_separate_proj_weight": False, "q_proj_weight": None, "k_proj_weight": None,
                 "v_proj_weight": None, "static_k": None, "static_v": None, "average_attn_weights": True,
                 "is_causal": False}


def _mha_signature() -> inspect.Signature:
    sig = inspect.signature(inspect.unwrap(F.multi_head_attention_forward))
    if "query" in sig.parameters:
        return sig
    kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
    return inspect.Signature([inspect.Parameter(n, kind, default=_MHA_DEFAULTS.get(n, inspect.Parameter.empty))
                              for n in _MHA_PARAMETERS])


_MHA_SIGNATURE = _mha_signature()
_seen_kinds: dict[Any, Optional[str]] = {}


def call_kind(func: Callable) -> Optional[str]:
    """"softmax", "sdpa", "mha", "product" (a batched product: torch.bmm, baddbmm, matmul, einsum),
    "carry" (an operation the scores pass through on their way to the softmax), "route" (``topk``, ``max``,
    ``argmax``: a router's choice of experts) or None for the function a torch function mode is handed
    (cached).

    >>> call_kind(torch.softmax), call_kind(F.scaled_dot_product_attention), call_kind(torch.baddbmm)
    ('softmax', 'sdpa', 'product')
    >>> call_kind(torch.Tensor.masked_fill), call_kind(torch.exp)
    ('carry', None)
    """
    try:
        return _seen_kinds[func]
    except (KeyError, TypeError):
        pass
    kind = None
    try:
        for f in (func, inspect.unwrap(func)):
            kind = _ORIGINALS.get(f) or {F.softmax: "softmax", F.scaled_dot_product_attention: "sdpa",
                                         F.multi_head_attention_forward: "mha"}.get(f) or \
                _KINDS.get(getattr(f, "__name__", None))
            if kind:
                break
    except Exception:  # noqa: BLE001 - an odd callable (unhashable, a broken __wrapped__) is not attention
        kind = None
    try:
        if len(_seen_kinds) > 4096:
            _seen_kinds.clear()
        _seen_kinds[func] = kind
    except TypeError:
        pass
    return kind


def _dim_arg(func: Callable, args: tuple, kwargs: dict) -> Any:
    """The ``dim`` of a softmax call, in any of its spellings."""
    if "dim" in kwargs:
        return kwargs["dim"]
    return args[1] if len(args) > 1 else None


# autograd nodes that only move, copy or cast their input (the walk of _is_parameter goes through them)
_SHAPE_NODES = frozenset(("ViewBackward", "UnsafeViewBackward", "TransposeBackward", "PermuteBackward",
                          "ExpandBackward", "RepeatBackward", "CloneBackward", "ToCopyBackward", "UnsqueezeBackward",
                          "SqueezeBackward", "ReshapeAliasBackward", "AsStridedBackward", "SliceBackward",
                          "SelectBackward", "TBackward", "AliasBackward"))


def _is_parameter(t: torch.Tensor) -> bool:
    """Whether ``t`` is a parameter, or a parameter only moved, copied or cast (``w.expand(...)``,
    ``w.repeat(...)``, ``w.transpose(...)``, an autocast copy): read from ``t``'s autograd graph, at
    most 8 nodes up. A parameter that does not require grad, copied by ``repeat``, is not recognised
    (no graph): its product counts as one of activations.

    >>> w = torch.nn.Parameter(torch.ones(2, 3)); x = torch.ones(2, 3, requires_grad=True)
    >>> _is_parameter(w.repeat(4, 1, 1).transpose(1, 2)), _is_parameter(x.transpose(0, 1)), _is_parameter(w * 2)
    (True, False, False)
    """
    if isinstance(t, torch.nn.Parameter) or isinstance(t._base, torch.nn.Parameter):
        return True
    fn = t.grad_fn
    for _ in range(8):
        if fn is None:
            return False
        name = type(fn).__name__
        if name == "AccumulateGrad":
            return isinstance(getattr(fn, "variable", None), torch.nn.Parameter)
        if name.rstrip("0123456789") not in _SHAPE_NODES:
            return False
        inputs = [f for f, _ in fn.next_functions if f is not None]
        if len(inputs) != 1:
            return False
        fn = inputs[0]
    return False


def _product_operands(func: Callable, args: tuple, kwargs: dict) -> tuple:
    """The two factors of a batched product call (``baddbmm``'s ``batch1`` / ``batch2``, not its added
    ``input``; an einsum's operands)."""
    name = getattr(func, "__name__", "")
    if name == "einsum":
        ops = args[1:] if len(args) > 1 else ()
        return tuple(ops[0]) if len(ops) == 1 and isinstance(ops[0], (list, tuple)) else ops
    if name == "baddbmm":
        return args[1:3] if len(args) >= 3 else (kwargs.get("batch1"), kwargs.get("batch2"))
    return args[:2] if len(args) >= 2 else tuple(args) + tuple(kwargs.get(n) for n in ("mat2", "other"))


def softmax_logit_max(x: torch.Tensor) -> torch.Tensor:
    """The largest logit a softmax sees: the max of its input (masked entries are ``-inf`` or a
    ``finfo.min`` fill and never win).

    >>> softmax_logit_max(torch.tensor([[[[1.0, -float("inf")], [3.0, 2.0]]]])).item()
    3.0
    """
    return x.detach().amax().float()


def router_logit_spread(x: torch.Tensor) -> torch.Tensor:
    """A router's figure: over its tokens (rows), the largest spread of one token's logits, max - min over
    the experts (a row holding a non-finite logit, a masked expert say, is left out). A softmax is unchanged
    by a shift of a row, so the spread, not the level, says how one-hot a token's routing is: at a spread s,
    the top expert's probability is at least e^s / (e^s + n - 1) for n experts. One pass over the logits
    (``aminmax``), no host sync.

    >>> router_logit_spread(torch.tensor([[1.0, 3.0, 2.0], [0.0, 9.0, -1.0], [0.0, 50.0, -float("inf")]])).item()
    10.0
    """
    lo, hi = torch.aminmax(x.detach(), dim=-1)
    d = hi.float() - lo.float()
    return torch.where(torch.isfinite(d), d, torch.zeros_like(d)).amax()


def _chunks(per_item: int) -> int:
    """How many batch rows of ``per_item`` logits each one chunk holds."""
    return max(1, CHUNK_LOGITS // max(1, per_item))


def _batch_slice(t: Optional[torch.Tensor], lo: int, hi: int, batch: int, lead: int) -> Optional[torch.Tensor]:
    """``t``'s rows ``lo:hi`` of the leading (batch) dimension when it has one of size ``batch`` at the
    front of a ``lead + 2``-dim shape; else ``t`` itself (it broadcasts)."""
    if t is None or t.dim() < lead + 2 or t.shape[0] != batch or batch == 1:
        return t
    return t[lo:hi]


_CAUSAL: dict[tuple, torch.Tensor] = {}


def _above_diagonal(L: int, S: int, device: torch.device) -> torch.Tensor:
    """The entries SDPA's ``is_causal`` hides (True above the diagonal, top-left aligned), cached by shape."""
    key = (L, S, str(device), "bool")
    t = _CAUSAL.get(key)
    if t is None:
        if len(_CAUSAL) > 32:
            _CAUSAL.clear()
        t = _CAUSAL[key] = torch.ones(L, S, dtype=torch.bool, device=device).triu(1)
    return t


def _causal_additive(L: int, S: int, device: torch.device) -> torch.Tensor:
    """:func:`_above_diagonal` as a float32 addend (``-inf`` above the diagonal, ``0`` elsewhere), cached:
    adding it leaves every kept logit bit for bit as it was and costs a fifth of a boolean
    ``masked_fill_`` on CPU (3 against 17 us on the overhead bench's 4 x 4 x 32 x 32 scores)."""
    key = (L, S, str(device), "add")
    t = _CAUSAL.get(key)
    if t is None:
        t = torch.zeros(L, S, device=device).masked_fill_(_above_diagonal(L, S, device), -math.inf)
        _CAUSAL[key] = t
    return t


def _causal_max(s: torch.Tensor, L: int, S: int) -> torch.Tensor:
    """max of the scores ``s`` ``[..., L, S]`` left of the causal diagonal (``s`` may be overwritten).

    On CPU the cached ``-inf`` addend is added (:func:`_causal_additive`; a host read is free there):
    only a non-finite score above the diagonal (``+inf`` or NaN, which the addend turns into NaN)
    makes the max NaN, and then the entries are masked the exact way, as on a GPU, where a boolean
    ``masked_fill_`` is one kernel like the addition."""
    if s.device.type == "cpu":
        top = s.add(_causal_additive(L, S, s.device)).amax()
        if not math.isnan(top.item()):
            return top
    return s.masked_fill_(_above_diagonal(L, S, s.device), -math.inf).amax()


def _autocast_on(device_type: str) -> bool:
    """Whether autocast is on for ``device_type`` (a cheap test: entering a disabling ``torch.autocast``
    context costs more than the products it guards on a small model)."""
    try:
        return torch.is_autocast_enabled(device_type)
    except TypeError:   # torch < 2.4: no device argument
        return torch.is_autocast_enabled() if device_type == "cuda" else torch.is_autocast_cpu_enabled()


def scores_max(q: torch.Tensor, k: torch.Tensor, scale: float, mask: Optional[torch.Tensor] = None,
               causal: bool = False) -> torch.Tensor:
    """max over the unmasked entries of ``q·kᵀ·scale (+ mask)`` for ``q`` ``[..., L, E]`` and ``k``
    ``[..., S, E]`` with the same leading shape (or broadcastable), in float32, in chunks along the
    first dimension of at most :data:`CHUNK_LOGITS` logits. ``mask``: boolean (True: kept) or
    additive, broadcastable to ``[..., L, S]``; ``causal``: entries above the diagonal left out
    (top-left aligned, as SDPA's ``is_causal``).

    >>> q = torch.tensor([[[1.0, 0.0], [0.0, 2.0]]]); k = torch.tensor([[[3.0, 0.0], [0.0, 1.0]]])
    >>> scores_max(q, k, 1.0).item(), scores_max(q, k, 1.0, causal=True).item()
    (3.0, 3.0)
    >>> scores_max(q, k, 0.5, mask=torch.tensor([[False, True], [True, True]])).item()
    1.0
    """
    L, S = q.shape[-2], k.shape[-2]
    lead = q.dim() - 2
    batch = q.shape[0] if lead >= 1 else 1
    additive = mask is not None and mask.dtype != torch.bool
    # logits one batch row holds, from the shapes alone (no indexing op)
    per = _chunks(q.numel() // max(1, batch * q.shape[-1]) * S if lead >= 1 else 1)
    no_autocast = _autocast_on(q.device.type)   # products in float32, not in the autocast dtype
    out = []
    for lo in range(0, batch, per):
        hi = min(batch, lo + per)
        whole = lo == 0 and hi == batch
        qs = q if whole or lead < 1 else q[lo:hi]
        ks = k if whole or not (lead >= 1 and k.shape[0] == batch and batch > 1) else k[lo:hi]
        if no_autocast:
            with torch.autocast(q.device.type, enabled=False):
                s = torch.matmul(qs.float(), ks.float().transpose(-2, -1))
        else:
            s = torch.matmul(qs.float(), ks.float().transpose(-2, -1))
        m = mask if whole else _batch_slice(mask, lo, hi, batch, lead)
        if additive:
            s.mul_(scale).add_(m.float())
        elif m is not None:
            s.masked_fill_(~m, -math.inf)
        top = _causal_max(s, L, S) if causal else s.amax()
        # without an additive mask the scale (> 0) is applied to the max alone: one pass less over the logits
        out.append(top if additive else top * scale)
    return out[0] if len(out) == 1 else torch.stack(out).amax()


def sdpa_logit_max(query: torch.Tensor, key: torch.Tensor, value: Any = None, attn_mask: Any = None,
                   dropout_p: float = 0.0, is_causal: bool = False, scale: Optional[float] = None,
                   enable_gqa: bool = False, **_: Any) -> torch.Tensor:
    """The largest logit ``F.scaled_dot_product_attention`` computes for these arguments (the same
    signature): ``q·kᵀ·scale`` with the key heads repeated for grouped-query attention."""
    q, k = local_tensor(query).detach(), local_tensor(key).detach()
    if q.dim() >= 3 and k.dim() >= 3 and k.shape[-3] != q.shape[-3] and q.shape[-3] % k.shape[-3] == 0:
        k = k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)
    s = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    mask = local_tensor(attn_mask).detach() if isinstance(attn_mask, torch.Tensor) else None
    return scores_max(q, k, s, mask, bool(is_causal))


def mha_logit_max(*args: Any, **kwargs: Any) -> Optional[torch.Tensor]:
    """The largest logit ``F.multi_head_attention_forward`` computes for these arguments (its
    signature): per head ``q·kᵀ/√head_dim``, the queries and keys from its in-projection (packed or
    separate weights), ``bias_k`` and ``add_zero_attn``'s extra keys, ``attn_mask`` (boolean True:
    masked, as nn.MultiheadAttention reads it; or additive), ``key_padding_mask`` the same, and
    ``is_causal`` without a mask a causal one."""
    a = _MHA_SIGNATURE.bind(*args, **kwargs)
    a.apply_defaults()
    p = a.arguments
    # called under no_grad (AttentionLogitMode._measure), on the tensors themselves: torch's in-projection
    # packs the GEMMs by their identity (query is key is value: one GEMM), so these stay the same objects
    query, key, value = (local_tensor(p[n]) for n in ("query", "key", "value"))
    unbatched = query.dim() == 2                           # (L, E)
    H = int(p["num_heads"])
    E = query.shape[-1]
    d = E // H
    b = p["in_proj_bias"]
    # as multi_head_attention_forward projects: the same kernels on the same layouts, so the same rounding
    # under autocast; torch's own helpers where this version has them
    packed, separate = getattr(F, "_in_projection_packed", None), getattr(F, "_in_projection", None)
    if not p["use_separate_proj_weight"] and packed is not None:
        q, k, _ = packed(query, key, value, local_tensor(p["in_proj_weight"]), None if b is None else local_tensor(b))
    else:
        if p["use_separate_proj_weight"]:
            wq, wk, wv = (local_tensor(p[n]) for n in ("q_proj_weight", "k_proj_weight", "v_proj_weight"))
        else:
            wq, wk, wv = local_tensor(p["in_proj_weight"]).chunk(3)
        bq, bk, bv = local_tensor(b).chunk(3) if b is not None else (None, None, None)
        if separate is not None:
            q, k, _ = separate(query, key, value, wq, wk, wv, bq, bk, bv)
        else:
            q, k = F.linear(query, wq, bq), F.linear(key, wk, bk)
    if unbatched:
        q, k = q.unsqueeze(1), k.unsqueeze(1)
    L, N = q.shape[0], q.shape[1]
    if p["static_k"] is not None:
        k = local_tensor(p["static_k"])                            # (N·H, S, d)
    else:
        if p["bias_k"] is not None:
            k = torch.cat([k, local_tensor(p["bias_k"]).expand(1, N, E).to(k.dtype)])
        k = k.reshape(k.shape[0], N * H, d).transpose(0, 1)       # (N·H, S, d)
    if p["add_zero_attn"]:
        k = torch.cat([k, k.new_zeros(k.shape[0], 1, d)], dim=1)
    S = k.shape[1]
    q = q.reshape(L, N * H, d).transpose(0, 1).reshape(N, H, L, d)
    k = k.reshape(N, H, S, d)
    mask = _mha_mask(p["attn_mask"], p["key_padding_mask"], N, H, L, S, bool(p["is_causal"]), q.device)
    return scores_max(q, k, 1.0 / math.sqrt(d), mask)


def _mha_mask(attn_mask: Any, key_padding_mask: Any, N: int, H: int, L: int, S: int, causal: bool,
              device: torch.device) -> Optional[torch.Tensor]:
    """nn.MultiheadAttention's masks as one additive float mask ``[N, H, L, S]`` (-inf where masked);
    keys added by ``bias_k`` / ``add_zero_attn`` (columns past the masks' width) are never masked."""
    out: Optional[torch.Tensor] = None

    def additive(m: torch.Tensor) -> torch.Tensor:
        m = local_tensor(m).detach()
        if m.dtype == torch.bool:
            return torch.zeros(m.shape, device=m.device).masked_fill(m, -math.inf)
        return m.float()

    def pad(m: torch.Tensor) -> torch.Tensor:
        return F.pad(m, (0, S - m.shape[-1])) if m.shape[-1] < S else m

    if isinstance(attn_mask, torch.Tensor):
        m = pad(additive(attn_mask))
        out = m.reshape(N, H, L, S) if m.dim() == 3 else m          # (N·H, L, S) or (L, S)
    elif causal:
        out = torch.zeros(L, S, device=device).masked_fill(_above_diagonal(L, S, device), -math.inf)
    if isinstance(key_padding_mask, torch.Tensor):
        kp = pad(additive(key_padding_mask))
        kp = kp.reshape(N, 1, 1, S) if kp.dim() == 2 else kp.reshape(1, 1, 1, S)
        out = kp if out is None else out + kp
    return out


def credited_module(frame: Any, owners: dict[int, int]) -> Optional[int]:
    """The position (``owners[id(module)]``) of the innermost watched module whose method is running in
    ``frame`` or a frame above it: the first frame whose ``self`` is a watched module."""
    f = frame
    for _ in range(MAX_FRAMES):
        if f is None:
            return None
        code = f.f_code
        if code.co_argcount and code.co_varnames[0] == "self":
            where = owners.get(id(f.f_locals.get("self")))
            if where is not None:
                return where
        f = f.f_back
    return None


class AttentionLogitMode(TorchFunctionMode):
    """Sees the attention calls of one forward (see the module docstring) and hands each one's max
    logit to ``found(position, value)`` (``position``: the credited module's, from ``owners``), or
    to ``found(None, value)`` when no watched module holds the call. ``failed(exc)``: the measurement
    raised; the call itself still runs and returns as it would have. ``router(position, value)``, when
    given, receives each router call's :func:`router_logit_spread` the same way.

    Entered by a forward pre-hook and left by the forward's post-hook (and, should the forward
    raise, at the step's end): :meth:`leave` pops it only if it is still on the mode stack."""

    def __init__(self, owners: dict[int, int], found: Callable[[Optional[int], torch.Tensor], None],
                 failed: Callable[[BaseException], None],
                 router: Optional[Callable[[Optional[int], torch.Tensor], None]] = None):
        super().__init__()
        self.owners, self.found, self.failed, self.router = owners, found, failed, router
        self.active = False
        # SDPA calls scored when the mode is left: (args, kwargs, credited position, q, k, their versions)
        self.deferred: list[tuple] = []
        self.deferred_bytes = 0
        # 3-D batched products' outputs and what they became, this forward: id -> weak reference
        self.followed: dict[int, Any] = {}
        # 2-D and 3-D softmaxes' outputs (and their casts), this forward, until a routing call on one makes it
        # a router's: id -> (weak reference, credited position, its spread)
        self.routers: dict[int, tuple] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        kind = call_kind(func)
        if kind is None:
            return func(*args, **kwargs)
        if kind == "carry":
            out = func(*args, **kwargs)
            if self.followed and out is not None:
                self._carry(args, out)
            if self.routers and out is not None:
                self._carry_router(func, args, out)
            return out
        if kind == "product":
            out = func(*args, **kwargs)
            self._follow(func, args, kwargs, out)
            return out
        if kind == "route":
            if self.routers:
                self._routed(args[0] if args else kwargs.get("input"))
            return func(*args, **kwargs)
        if kind == "softmax":
            x = args[0] if args else kwargs.get("input")
            dim = _dim_arg(func, args, kwargs)
            if isinstance(x, torch.Tensor):
                if x.dim() == 4 and dim in (-1, 3):
                    self._measure(softmax_logit_max, (local_tensor(x),), {})
                elif x.dim() == 3 and dim in (-1, 2) and self._is_followed(x):
                    self._measure(softmax_logit_max, (local_tensor(x),), {})
                elif (x.dim() in (2, 3) and dim in (-1, x.dim() - 1) and self.router is not None
                      and 2 <= x.shape[-1] <= MAX_EXPERTS):
                    out = func(*args, **kwargs)
                    self._maybe_router(x, out)
                    return out
        elif kind == "sdpa":
            if not self._defer(args, kwargs):
                self._measure(sdpa_logit_max, args, kwargs)
        elif kind == "mha":
            self._measure(mha_logit_max, args, kwargs)
        return func(*args, **kwargs)

    def _is_followed(self, t: Any) -> bool:
        ref = self.followed.get(id(t))
        return ref is not None and ref() is t

    def _keep(self, out: torch.Tensor) -> None:
        if len(self.followed) >= MAX_FOLLOWED:
            self.followed = {i: r for i, r in self.followed.items() if r() is not None}
            if len(self.followed) >= MAX_FOLLOWED:
                return
        self.followed[id(out)] = weakref.ref(out)

    def _follow(self, func: Callable, args: tuple, kwargs: dict, out: Any) -> None:
        """Follow a batched product's 3-D output (both factors 3-D activations, neither a parameter) to
        see whether a softmax over its last dimension comes of it: attention scores then."""
        try:
            if not isinstance(out, torch.Tensor) or out.dim() != 3 or not out.is_floating_point():
                return
            ops = _product_operands(func, args, kwargs)
            if len(ops) != 2 or not all(isinstance(t, torch.Tensor) and t.dim() == 3 and not _is_parameter(t)
                                        for t in ops):
                return
            self._keep(out)
        except Exception as e:  # noqa: BLE001 - never hurt the host: the product's result is returned as is
            self.failed(e)

    def _carry(self, args: tuple, out: Any) -> None:
        """``out`` came of a followed tensor (one of the call's first three arguments): follow it too."""
        try:
            if not isinstance(out, torch.Tensor) or self._is_followed(out):
                return
            for a in args[:3]:
                if isinstance(a, torch.Tensor) and self._is_followed(a):
                    self._keep(out)
                    return
        except Exception as e:  # noqa: BLE001 - never hurt the host
            self.failed(e)

    def _maybe_router(self, x: torch.Tensor, out: Any) -> None:
        """A 2-D or 3-D softmax's spread, kept with its output until a routing call on that output (or on a cast
        of it) makes it a router's (:meth:`_routed`)."""
        try:
            if not isinstance(out, torch.Tensor) or len(self.routers) >= MAX_FOLLOWED:
                return
            # two frames up: past __torch_function__ (whose self is this mode) to the caller of the torch call
            position = credited_module(sys._getframe(2), self.owners)
            with torch.no_grad():
                value = router_logit_spread(local_tensor(x))
            self.routers[id(out)] = (weakref.ref(out), position, value)
        except Exception as e:  # noqa: BLE001 - never hurt the host: the softmax's result is returned as is
            self.failed(e)

    def _carry_router(self, func: Callable, args: tuple, out: Any) -> None:
        """A cast or copy of a kept router output (``softmax(..., dtype=...).to(input_dtype)``, Hugging Face's
        Switch Transformers) is kept with the same figure: the routing call may come on it."""
        try:
            if (not args or getattr(func, "__name__", None) not in ROUTER_CASTS or not isinstance(out, torch.Tensor)
                    or out is args[0] or len(self.routers) >= MAX_FOLLOWED):
                return
            entry = self.routers.get(id(args[0]))
            if entry is not None and entry[0]() is args[0]:
                self.routers[id(out)] = (weakref.ref(out),) + entry[1:]
        except Exception as e:  # noqa: BLE001 - never hurt the host
            self.failed(e)

    def _routed(self, t: Any) -> None:
        """A routing call on ``t``: if ``t`` is a kept softmax's output (or a cast of it), it was a router's."""
        entry = self.routers.get(id(t))
        if entry is not None and entry[0]() is t:
            del self.routers[id(t)]
            self.router(entry[1], entry[2])

    def _measure(self, how: Callable, args: tuple, kwargs: dict) -> None:
        try:
            # two frames up: past __torch_function__ (whose self is this mode) to the caller of the torch call
            self._score(how, args, kwargs, credited_module(sys._getframe(2), self.owners))
        except Exception as e:  # noqa: BLE001 - never hurt the host: the attention call goes on
            self.failed(e)

    def _score(self, how: Callable, args: tuple, kwargs: dict, position: Optional[int]) -> None:
        with torch.no_grad():
            value = how(*args, **kwargs)
        if value is not None:
            self.found(position, value)

    def _defer(self, args: tuple, kwargs: dict) -> bool:
        """Keep an SDPA call to be scored when the forward is over (:meth:`leave`), where its ``q·kᵀ``
        products run one after another: interleaved with the model's own work each one ran with cold
        caches (106 against 28 us a call on the overhead bench's model). Only where autograd keeps
        ``q`` and ``k`` anyway (both require grad, grad mode on): no memory is held longer that the
        backward would not hold, and a tensor changed in place since the call (its version moved; the
        backward would refuse it too) is not scored. Under activation checkpointing autograd does
        not keep them: what is held for later is bounded by :data:`DEFER_BYTES`, past which a call is
        scored at once."""
        q = args[0] if args else kwargs.get("query")
        k = args[1] if len(args) > 1 else kwargs.get("key")
        if not (isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and q.requires_grad
                and k.requires_grad and torch.is_grad_enabled()):
            return False
        size = q.numel() * q.element_size() + k.numel() * k.element_size()
        if self.deferred_bytes + size > DEFER_BYTES:
            return False
        try:
            position = credited_module(sys._getframe(2), self.owners)
        except Exception:  # noqa: BLE001 - scored at once then, the way it fails there
            return False
        self.deferred.append((args, kwargs, position, q, k, q._version, k._version))
        self.deferred_bytes += size
        return True

    def score_deferred(self) -> None:
        """Score the SDPA calls kept by :meth:`_defer` (outside the mode: these calls are not seen)."""
        deferred, self.deferred, self.deferred_bytes = self.deferred, [], 0
        for args, kwargs, position, q, k, q_version, k_version in deferred:
            if q._version != q_version or k._version != k_version:
                continue   # changed in place after the call: these are not the logits it computed
            try:
                self._score(sdpa_logit_max, args, kwargs, position)
            except Exception as e:  # noqa: BLE001 - never hurt the host
                self.failed(e)
                return

    def enter(self) -> None:
        if not self.active:
            self.__enter__()
            self.active = True

    def leave(self) -> None:
        """Pop the mode (once), then score the deferred SDPA calls; a mode pushed above it meanwhile
        (the user's own) stays in place."""
        if self.active:
            self.active = False
            try:
                self.__exit__(None, None, None)
            except Exception:  # noqa: BLE001 - never hurt the host
                pass
        self.followed = {}
        self.routers = {}
        if self.deferred:
            self.score_deferred()
