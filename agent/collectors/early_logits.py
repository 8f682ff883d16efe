"""Early-warning logits: each attention module's largest attention logit, and the output's logits.

Both move before a divergence (Wortsman et al. 2023, arXiv:2309.14322; docs/early-warning-logits.md):
without qk-layernorm at a high learning rate the largest attention logit q·k/√d grows until the
softmax turns one-hot (rule H2); without z-loss the output logits' log-partition log Z drifts away
from 0 until bf16 rounds away their differences (rule H3).

The attention logits are measured where attention is computed, whatever the model's attribute names
(:mod:`agent.capture.attention`): on a sampled step's first training forward a torch function mode
sees every 4-D softmax over its last dimension (its input is the logits), every
``scaled_dot_product_attention`` (``q·kᵀ·scale`` recomputed from its own q and k: after rotary,
grouped-query heads repeated, its ``scale`` and masks honoured) and every ``multi_head_attention_forward``,
and credits each to the innermost watched module on the call stack. The value is the max over every
unmasked logit of the forward (all samples, heads and positions).

Attention computed outside PyTorch's functions (an external flash-attention kernel) is not seen; such
modules can be named with ``attach(..., attention_modules="blocks.*.attn:8")`` (module names, fnmatch
patterns, an optional ``:heads``) and are then read from their projections (:func:`find_attention`:
``nn.MultiheadAttention``; child Linears ``q_proj``/``k_proj``, ``query``/``key``, ``wq``/``wk``,
``to_q``/``to_k``, ``q_lin``/``k_lin``; a fused ``c_attn``, ``qkv``, ``Wqkv``, ``qkv_proj``; the head
count from ``num_heads``, ``n_head``, ... or ``:heads``; qk-layernorm children ``q_norm``/``k_norm``):
an approximation — the first sample's first :data:`MAX_POSITIONS` positions, no mask, no rotary. A
named module the mode does see keeps the mode's exact value.

The output: the model's output tensor (or ``output.logits``, ``output["logits"]``) when its last
dimension has at least 2 classes: its max logit and the mean over positions of log Z = logsumexp.

Cost on a sampled step: every torch call of the first forward passes through the mode (a dict
look-up), each attention call adds one ``amax`` or one chunked ``q·kᵀ``, and one logsumexp over the
output; nothing on other steps (the mode and the hooks exist only during sampled forwards).
"""
from __future__ import annotations

import fnmatch
import math
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn.functional as F

from gradwatch.agent.capture.attention import AttentionLogitMode
from gradwatch.agent.setup import transformer_part
from gradwatch.agent.collectors.base import Collector, OneForwardHooks, scatter_measured

# positions of the first sample whose pairs are scored (128² pairs per head)
MAX_POSITIONS = 128
PAIRS = (("q_proj", "k_proj"), ("query", "key"), ("wq", "wk"), ("to_q", "to_k"), ("q_lin", "k_lin"))
NORMS = (("q_norm", "k_norm"), ("q_layernorm", "k_layernorm"), ("q_ln", "k_ln"))
FUSED = ("c_attn", "qkv", "Wqkv", "qkv_proj")
HEAD_ATTRS = ("num_heads", "n_head", "n_heads", "heads", "num_attention_heads", "nhead")


@dataclass
class Site:
    """One attention module: where its queries and keys come from."""
    name: str                       # the attention module's name (the evidence's module)
    index: int                      # its place in the run's module list
    kind: str                       # "mha" | "pair" | "fused"
    heads: int
    scale: Optional[float]          # None: 1/sqrt(head_dim)
    q: torch.nn.Module              # the module whose output (input, for "mha") gives the queries
    k: Optional[torch.nn.Module]    # ... the keys ("pair"); None otherwise


def _int_attr(m: torch.nn.Module, names) -> Optional[int]:
    for a in names:
        v = getattr(m, a, None)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    return None


def _heads(m: torch.nn.Module, width: Optional[int]) -> Optional[int]:
    h = _int_attr(m, HEAD_ATTRS)
    if h is None and width:
        d = _int_attr(m, ("head_dim", "attention_head_size", "d_head"))
        if d and width % d == 0:
            h = width // d
    return h


def _scale(m: torch.nn.Module) -> Optional[float]:
    for a in ("scaling", "scale"):
        v = getattr(m, a, None)
        if isinstance(v, float) and v > 0:
            return v
    return None


def _out_features(m: Optional[torch.nn.Module]) -> Optional[int]:
    """A projection's output width: an ``nn.Linear``, or transformers' ``Conv1D`` (GPT-2's ``c_attn``)."""
    if isinstance(m, torch.nn.Linear):
        return m.out_features
    nf = getattr(m, "nf", None)
    if type(m).__name__ == "Conv1D" and isinstance(nf, int):
        return nf
    return None


def _site_of(name: str, m: torch.nn.Module, heads: Optional[int], index: int) -> Optional[Site]:
    """The site of one module when it has a recognised form (``heads``: the user's count, else read)."""
    if isinstance(m, torch.nn.MultiheadAttention):
        return Site(name, index, "mha", heads or m.num_heads, None, m, None)
    children = dict(m.named_children())
    for qn, kn in PAIRS:
        q, k = children.get(qn), children.get(kn)
        if isinstance(q, torch.nn.Linear) and isinstance(k, torch.nn.Linear):
            h = heads or _heads(m, q.out_features)
            if h is None or q.out_features % h:
                return None
            for nq, nk in NORMS:   # qk-layernorm: the logits are those of the normalised queries and keys
                if isinstance(children.get(nq), torch.nn.Module) and isinstance(children.get(nk), torch.nn.Module):
                    q, k = children[nq], children[nk]
                    break
            return Site(name, index, "pair", h, _scale(m), q, k)
    for fn in FUSED:
        lin = children.get(fn)
        width = _out_features(lin)
        if width and width % 3 == 0:
            h = heads or _heads(m, width // 3)
            if h is None or (width // 3) % h:
                return None
            for nq, nk in NORMS:
                if isinstance(children.get(nq), torch.nn.Module) and isinstance(children.get(nk), torch.nn.Module):
                    return Site(name, index, "pair", h, _scale(m), children[nq], children[nk])
            return Site(name, index, "fused", h, _scale(m), lin, None)
    return None


def parse_attention_modules(spec: Optional[str]) -> list[tuple[str, Optional[int]]]:
    """``"blocks.*.attn:8, enc.mha"`` -> [("blocks.*.attn", 8), ("enc.mha", None)].

    >>> parse_attention_modules("blocks.*.attn:8, enc.mha")
    [('blocks.*.attn', 8), ('enc.mha', None)]
    """
    out: list[tuple[str, Optional[int]]] = []
    for item in (spec or "").split(","):
        item = item.strip()
        if not item:
            continue
        pattern, _, heads = item.partition(":")
        if heads and not (heads.isdigit() and int(heads) > 0):
            raise ValueError(f"attention_modules entry {item!r}: write NAME or NAME:HEADS with HEADS a positive "
                             f"integer, e.g. blocks.*.attn:8")
        out.append((pattern.strip(), int(heads) if heads else None))
    return out


def find_attention(model: torch.nn.Module, module_names: list[str], named: Optional[str] = None) -> list[Site]:
    """The attention modules the user names in ``named`` (``attention_modules``, see the module
    docstring) in a form read from their projections, in module order, each with its place in
    ``module_names``; no name, no site. A named fused Linear
    (a module of its own) reads its head count from its parent or the ``:heads`` given.

    >>> model = torch.nn.Sequential(torch.nn.MultiheadAttention(8, 2))
    >>> [(s.name, s.kind, s.heads) for s in find_attention(model, ["0"], "0")], find_attention(model, ["0"])
    ([('0', 'mha', 2)], [])
    """
    position = {n: i for i, n in enumerate(module_names)}
    mods = dict(model.named_modules())
    wanted = parse_attention_modules(named)
    sites: list[Site] = []
    taken: set[int] = set()          # ids of q-source modules already in a site
    for name, m in model.named_modules():
        heads = next((h for pat, h in wanted if fnmatch.fnmatchcase(name, pat)), None)
        if not any(fnmatch.fnmatchcase(name, pat) for pat, _ in wanted):
            continue        # only the modules the user names: the rest are seen where attention is computed
        site = None
        if isinstance(m, torch.nn.Linear):
            parent = mods.get(name.rsplit(".", 1)[0] if "." in name else "")
            h = heads or (_heads(parent, m.out_features // 3) if parent is not None else None)
            if h and m.out_features % 3 == 0 and (m.out_features // 3) % h == 0:
                site = Site(name, -1, "fused", h, _scale(parent) if parent is not None else None, m, None)
        else:
            site = _site_of(name, m, heads, -1)
        if site is None or id(site.q) in taken:
            continue
        # the attention module's own place; a root-level attention (no name) takes its q source's
        site.index = position.get(name, position.get(_name_of(model, site.q), -1))
        if site.index < 0:
            continue
        taken.add(id(site.q))
        sites.append(site)
    return sites


def _name_of(model: torch.nn.Module, target: torch.nn.Module) -> str:
    return next((n for n, m in model.named_modules() if m is target), "")


def _tokens(x: torch.Tensor, heads: int) -> Optional[torch.Tensor]:
    """A projection's (or norm's) output -> (positions, width) of the first sample, width = heads × head_dim.

    (b, t, c) and (t, c); a per-head norm's (b, t, h, d), or (b, h, t, d) when dim 1 is the heads."""
    if x.dim() == 4:
        if x.shape[2] != heads and x.shape[1] == heads:
            x = x.transpose(1, 2)
        x = x[0].reshape(x.shape[1], -1)
    elif x.dim() == 3:
        x = x[0]
    elif x.dim() != 2:
        return None
    return x[:MAX_POSITIONS]


def _mha_qk(m: torch.nn.MultiheadAttention, args: tuple, kwargs: dict):
    """The queries and keys an ``nn.MultiheadAttention`` makes of its inputs, first sample only."""
    query = kwargs.get("query", args[0] if len(args) > 0 else None)
    key = kwargs.get("key", args[1] if len(args) > 1 else None)
    if not isinstance(query, torch.Tensor) or not isinstance(key, torch.Tensor):
        return None
    if query.dim() == 3:
        query, key = (query[0], key[0]) if m.batch_first else (query[:, 0], key[:, 0])
    e = m.embed_dim
    if m._qkv_same_embed_dim:
        wq, wk = m.in_proj_weight[:e], m.in_proj_weight[e:2 * e]
    else:
        wq, wk = m.q_proj_weight, m.k_proj_weight
    b = m.in_proj_bias
    bq, bk = (b[:e], b[e:2 * e]) if b is not None else (None, None)
    return F.linear(query[:MAX_POSITIONS], wq, bq), F.linear(key[:MAX_POSITIONS], wk, bk)


# one batched matmul scores at most this many logits (modules × heads × positions²): 16 MB in fp32
_CHUNK_LOGITS = 1 << 22


def max_logits(pairs: list, heads: int) -> torch.Tensor:
    """Per module, max over heads and (query, key) pairs of q·k (unscaled), for several modules whose q and
    k have the same shapes, in a few batched kernels instead of a few per module (the hooks' cost is per
    kernel launch, not per flop). A pair is (q, k), each (positions, heads·head_dim; fewer key heads for
    grouped-query attention), or (qkv, None): a fused projection's [q | k | v] output, split here.

    >>> q = torch.tensor([[1.0, 0.0], [0.0, 2.0]]); k = torch.tensor([[3.0, 0.0], [0.0, 1.0]])
    >>> max_logits([(q, k), (q, 2 * k)], heads=1).tolist()
    [3.0, 6.0]
    """
    fused = pairs[0][1] is None
    t, width = pairs[0][0].shape
    if fused:
        width //= 3
    d = width // heads
    kv = heads if fused else pairs[0][1].shape[1] // d
    per = max(1, _CHUNK_LOGITS // (heads * t * t))
    out = []
    for lo in range(0, len(pairs), per):
        chunk = pairs[lo:lo + per]
        n = len(chunk)
        if fused:
            x = torch.stack([p[0] for p in chunk]).float().view(n, t, 3, heads, d)
            q, k = x[:, :, 0].transpose(1, 2), x[:, :, 1].transpose(1, 2)
        else:
            q = torch.stack([p[0] for p in chunk]).float().view(n, t, heads, d).transpose(1, 2)
            k = torch.stack([p[1] for p in chunk]).float().view(n, -1, kv, d).transpose(1, 2)
        if kv != heads:
            k = k.repeat_interleave(heads // kv, dim=1)
        out.append(torch.matmul(q, k.transpose(2, 3)).view(n, -1).amax(dim=1))
    return out[0] if len(out) == 1 else torch.cat(out)


# Denser sampling while the max attention logit grows (see AttentionLogits): past BOOST_FLOOR and BOOST_GROWTH
# times its value one interval earlier, every step is sampled for the next BOOST_INTERVALS intervals.
BOOST_FLOOR = 10.0
BOOST_GROWTH = 1.5
BOOST_INTERVALS = 2


class AttentionLogits(OneForwardHooks):
    """Per attention module, the max attention logit (``layers.attn_logit_max``) and its max over the
    modules (``attn_logit_max``), every ``attn_logits_every`` steps, measured where attention is
    computed (:class:`~agent.capture.attention.AttentionLogitMode`, on for the sampled step's first
    forward only).

    Modules named in ``attention_modules`` whose attention the mode does not see (a kernel outside
    PyTorch's functions) are read from their projections instead (:func:`find_attention`: the
    first sample's first :data:`MAX_POSITIONS` positions, no mask, no rotary: an approximation).

    Coverage: the first sampled step carries an ``attention_coverage`` event naming the modules
    measured (and again whenever that set grows), so the run says which attention it watches.

    Cadence for lead time: a logit that grows fast would need several samples, tens of steps apart,
    before rule H2 can call it sustained. So while the run's max logit is at least
    :data:`BOOST_FLOOR` and :data:`BOOST_GROWTH` times its value one interval (``attn_logits_every``
    steps) before, every step is sampled for the next :data:`BOOST_INTERVALS` intervals: H2 then
    confirms a growth within a few steps of noticing it. The training thread reads the sampled values
    without a sync: on the CPU they are host values already; on a GPU each is copied to pinned memory
    behind a CUDA event and read once the event has passed (:meth:`due` polls it)."""

    name = "attn_logits"
    order = 110
    every = "attn_logits_every"
    emits = ("attn_logit_max", "layers.attn_logit_max", "router_logit_spread", "layers.router_logit_spread")

    def __init__(self, watched, guards):
        super().__init__(watched, guards)
        self.sites: list[Site] = []
        named = getattr(watched.config, "attention_modules", None)
        if self.interval > 0 and named:
            self.sites = find_attention(watched.model, [n for n, _ in watched.modules], named)
        self.qk: dict[int, tuple[torch.Tensor, Optional[torch.Tensor]]] = {}   # site position -> (q, k)
        self.partial: dict[int, tuple[bool, torch.Tensor]] = {}       # site position -> its q or k, until the other
        self.scales = [s.scale for s in self.sites]
        # a named site gives way to the mode's exact value at its own module or its parent (a named fused Linear)
        position = {n: i for i, (n, _) in enumerate(watched.modules)}
        self.site_owners = [{s.index, position.get(s.name.rpartition(".")[0], s.index)} for s in self.sites]
        # the watched modules a call is credited to (nn.Softmax wrappers: their parent is the attention)
        owners = {id(m): i for i, (_, m) in enumerate(watched.modules) if not isinstance(m, torch.nn.Softmax)}
        self.mode = AttentionLogitMode(owners, self._found, self._failed, self._router)
        self.found: dict[int, torch.Tensor] = {}        # module position -> max logit, this forward
        self.routers: dict[int, torch.Tensor] = {}      # module position -> router logit spread, this forward
        self.unplaced_routers: list[torch.Tensor] = []   # routers in no watched module's forward
        self.unplaced: list[torch.Tensor] = []           # calls in no watched module's forward (the root's own)
        self.reported: Optional[set[int]] = None         # module positions named in a coverage event so far
        self.looks_like = transformer_part(watched.model, [])   # whether the model looks like a Transformer
        self.sampled = False                             # a sampled forward ran this step
        self.boost_until = -1                            # sample every step up to this step
        self.history: list[tuple[int, float]] = []       # (step, run-level max logit) read back, recent ones
        self.pending: list[tuple[int, torch.Tensor, Any]] = []   # (step, host copy, CUDA event) not read yet

    def due(self, step: int) -> bool:
        if self.pending:
            self._read_back()
        return super().due(step) or (self.interval > 0 and step <= self.boost_until)

    def _read_back(self) -> None:
        """Read the sampled maxima whose copies have landed (never waits), oldest first."""
        while self.pending:
            step, host, event = self.pending[0]
            if event is not None and not event.query():
                return
            self.pending.pop(0)
            self._observe(step, float(host))

    def _observe(self, step: int, value: float) -> None:
        before = [v for s, v in self.history if s <= step - self.interval]
        self.history = [(s, v) for s, v in self.history if s > step - 2 * self.interval] + [(step, value)]
        if before and math.isfinite(value) and value >= BOOST_FLOOR and value >= BOOST_GROWTH * before[-1]:
            self.boost_until = step + BOOST_INTERVALS * self.interval

    def _keep_for_boost(self, step: int, top: torch.Tensor) -> None:
        if top.device.type == "cpu":
            self._observe(step, float(top))
        elif top.device.type == "cuda" and len(self.pending) < 64:
            host = torch.empty((), dtype=top.dtype, pin_memory=True)
            host.copy_(top, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            self.pending.append((step, host, event))

    def wanted(self) -> bool:
        return self.interval > 0

    def on_first_forward(self, step, args, kwargs) -> None:
        handles = [self.watched.model.register_forward_hook(self._leave, always_call=True)]
        for i, s in enumerate(self.sites):
            if s.kind == "mha":
                handles.append(s.q.register_forward_pre_hook(self._mha_hook(i), with_kwargs=True))
            elif s.kind == "fused":
                handles.append(s.q.register_forward_hook(self._fused_hook(i)))
            else:
                handles.append(s.q.register_forward_hook(self._pair_hook(i, True)))
                handles.append(s.k.register_forward_hook(self._pair_hook(i, False)))
        self.hook_this_forward(handles)
        self.sampled = True
        self.mode.enter()

    def _leave(self, module, args, output):
        self.mode.leave()      # always_call: a forward that raises leaves the mode too
        return None

    def _found(self, position: Optional[int], value: torch.Tensor) -> None:
        _keep_max(self.found, self.unplaced, position, value)

    def _router(self, position: Optional[int], value: torch.Tensor) -> None:
        _keep_max(self.routers, self.unplaced_routers, position, value)

    def _failed(self, e: BaseException) -> None:
        self.mode.leave()
        self.guards.failed(self.name, e)

    def forward_returned(self) -> None:
        self.mode.leave()
        self.partial = {}   # a q without its k (or a k without its q) in that forward: nothing to score

    def _active(self, i: int) -> bool:
        return i not in self.qk and self.name not in self.guards.disabled

    def _mha_hook(self, i: int):
        def hook(module, args, kwargs):
            if self._active(i):
                with self.guards.guard(self.name), torch.no_grad():
                    qk = _mha_qk(module, args, kwargs)
                    if qk is not None:
                        self.qk[i] = qk
            return None
        return hook

    def _fused_hook(self, i: int):
        def hook(module, args, output):
            if self._active(i) and isinstance(output, torch.Tensor) and output.dim() in (2, 3):
                with self.guards.guard(self.name):   # a view; scored (under no_grad) at the step's end
                    self.qk[i] = (output[0, :MAX_POSITIONS] if output.dim() == 3 else output[:MAX_POSITIONS], None)
            return None
        return hook

    def _pair_hook(self, i: int, is_q: bool):
        def hook(module, args, output):
            if self._active(i) and isinstance(output, torch.Tensor):
                with self.guards.guard(self.name):
                    x = _tokens(output, self.sites[i].heads)
                    if x is None:
                        return None
                    other = self.partial.pop(i, None)   # (is_q, x) of the one of the two that ran first
                    if other is None or other[0] == is_q:
                        self.partial[i] = (is_q, x)
                    else:
                        self.qk[i] = (x, other[1]) if is_q else (other[1], x)
            return None
        return hook

    def _named_values(self, qk: dict, seen: dict) -> dict[int, torch.Tensor]:
        """The named sites' max logits from their projections (module position -> 0-d tensor), for the
        sites where the mode saw no attention (``seen``: its module positions)."""
        groups: dict[tuple, list[int]] = {}
        for i, (q, k) in qk.items():
            if not self.site_owners[i].isdisjoint(seen):
                continue
            groups.setdefault((tuple(q.shape), None if k is None else tuple(k.shape), q.dtype, q.device,
                               self.sites[i].heads), []).append(i)
        out: dict[int, torch.Tensor] = {}
        for key, members in groups.items():
            values = max_logits([qk[i] for i in members], key[-1])
            for k, i in enumerate(members):
                q, kk = qk[i]
                scale = self.scales[i] if self.scales[i] is not None else \
                    1.0 / math.sqrt(q.shape[1] // (1 if kk is not None else 3) // self.sites[i].heads)
                out[self.sites[i].index] = values[k] * scale
        return out

    def end_step(self, step, rec) -> None:
        self.mode.leave()
        found, self.found = self.found, {}
        unplaced, self.unplaced = self.unplaced, []
        qk, self.qk = self.qk, {}
        sampled, self.sampled = self.sampled, False
        routers, self.routers = self.routers, {}
        unplaced_routers, self.unplaced_routers = self.unplaced_routers, []
        if not self.guards.on(self.name):
            return
        if routers or unplaced_routers:
            with self.guards.guard(self.name), torch.no_grad():
                self._add_max(rec, "router_logit_spread", routers, unplaced_routers)
        if sampled and self.reported is None and not (found or unplaced or qk):
            self._coverage(rec, set())          # the first sampled forward saw no attention: said, never silent
        if not (found or unplaced or qk):
            return
        with self.guards.guard(self.name), torch.no_grad():
            if qk:
                found.update(self._named_values(qk, found))
            order, top = self._add_max(rec, "attn_logit_max", found, unplaced)
            self._keep_for_boost(step, top.detach())
            if self.reported is None or not self.reported.issuperset(order):
                self._coverage(rec, (self.reported or set()) | set(order))

    def _add_max(self, rec, name: str, per_module: dict[int, torch.Tensor],
                 unplaced: list[torch.Tensor]) -> tuple[list[int], torch.Tensor]:
        """Step signal ``name``, the max over ``per_module``'s values and the ``unplaced`` ones (calls in no
        watched module's forward), and ``layers.<name>``, each module's; returns the module positions, in
        order, and the max."""
        order = sorted(per_module)
        parts = [per_module[i] for i in order] + unplaced
        device = parts[0].device
        values = torch.stack([p.to(device) for p in parts])
        top = values.amax()
        rec.add(name, top)
        if order:
            rec.add(f"layers.{name}", scatter_measured(values[:len(order)], order, len(self.watched.modules)))
        return order, top

    def _coverage(self, rec, positions: set[int]) -> None:
        """The ``attention_coverage`` event: the modules measured so far, and whether the model looks like
        a Transformer (agent/setup.py's test, so rule H11 can say when none is measured)."""
        self.reported = positions
        names = [self.watched.modules[i][0] for i in sorted(positions)]
        rec.host.setdefault("events", []).append(
            {"kind": "attention_coverage",
             "data": {"measured": names, "count": len(names), "named": [s.name for s in self.sites],
                      "transformer": self.looks_like["transformer"], "attention_like": self.looks_like["attention"]}})

    def detach(self) -> None:
        self.mode.leave()
        super().detach()


def _keep_max(kept: dict[int, torch.Tensor], unplaced: list[torch.Tensor], position: Optional[int],
              value: torch.Tensor) -> None:
    """One call's value: into ``kept`` as its module's max so far, or onto ``unplaced`` (no watched module)."""
    if position is None:
        unplaced.append(value)
        return
    prev = kept.get(position)
    kept[position] = value if prev is None else torch.maximum(prev, value.to(prev.device))


def output_logits(output: Any) -> Optional[torch.Tensor]:
    """The logits in a model's output: the tensor, ``.logits`` or ``["logits"]``, when its last dimension
    holds at least 2 classes (a floating tensor); else None.

    >>> output_logits(torch.zeros(2, 5)).shape, output_logits(torch.zeros(4, 1))
    (torch.Size([2, 5]), None)
    """
    t = output
    if not isinstance(t, torch.Tensor):
        t = getattr(output, "logits", None)
        if t is None and isinstance(output, dict):
            t = output.get("logits")
    if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dim() >= 1 and t.shape[-1] >= 2 \
            and t.numel() > 0:
        return t
    return None


class OutputLogits(Collector):
    """The output's max logit (``output_logit_max``) and mean log Z (``output_log_z``), every
    ``output_logits_every`` steps."""

    name = "output_logits"
    order = 120
    every = "output_logits_every"
    emits = ("output_logit_max", "output_log_z")

    def __init__(self, watched, guards):
        super().__init__(watched, guards)
        self.handle: Any = None
        self.stats: Optional[tuple[torch.Tensor, torch.Tensor]] = None

    def wanted(self) -> bool:
        return self.interval > 0

    def on_first_forward(self, step, args, kwargs) -> None:
        if self.handle is None:
            self.handle = self.watched.model.register_forward_hook(self._on_output)

    def _on_output(self, module, args, output):
        handle, self.handle = self.handle, None
        if handle is not None:
            handle.remove()
        if self.name in self.guards.disabled:
            return None
        with self.guards.guard(self.name), torch.no_grad():
            t = output_logits(output)
            if t is not None:
                x = t.detach().float()
                self.stats = (x.amax(), x.logsumexp(-1).mean())
        return None

    def end_step(self, step, rec) -> None:
        stats, self.stats = self.stats, None
        if stats is not None and self.guards.on(self.name):
            rec.add("output_logit_max", stats[0])
            rec.add("output_log_z", stats[1])

    def detach(self) -> None:
        if self.handle is not None:
            try:
                self.handle.remove()
            except Exception:  # noqa: BLE001
                pass
            self.handle = None
