"""The rule interface: one class per rule, declared once, evaluated on whole batches.

A rule class declares its spec as class attributes (``id``, ``name``, ``severity``,
``checklist``, ``fires_when``, ``diagnosis``, named ``actions``, typed ``params``, the step keys
it ``needs``) and its ``kind``:

- ``"batch"``: ``evaluate(batch, state, cfg) -> Outcome`` over one rank's batch;
- ``"cross_rank"``: ``evaluate(mine, others, states, cfg)`` over this rank's and the other ranks'
  values at the same steps (the engine reads those);
- ``"timer"``: ``scan(...)`` run periodically, not on data.

``@register`` puts the class in the registry (``server.rules.registry``); the engine, the
catalogue, the settings and the CLI read the registry and know no rule by name. ``state`` is the
rule's JSON memory for one (run, rank), kept in ``rule_states`` between batches; a rule bumps its
``state_version`` when it changes what it keeps there (an older state is then started afresh).
"""
from __future__ import annotations

import base64
import math
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Callable, ClassVar, Mapping, Optional

import numpy as np

from gradwatch.server.rules.batch import Batch, Context, layer_list
from gradwatch.server.rules.spec import Hit, Param, RuleSpec
from gradwatch.server.rules.stats import MAD_TO_SIGMA, enc, num

KINDS = ("batch", "cross_rank", "timer")


@dataclass
class Outcome:
    """A batch's verdicts: ``clear[i]`` the condition is clear at step i; ``hits[i]`` it holds there;
    neither: nothing to say at that step. ``before``: hits from events, fed before the steps."""

    clear: np.ndarray
    hits: dict[int, Hit] = field(default_factory=dict)
    before: list[tuple[int, Hit]] = field(default_factory=list)

    @classmethod
    def quiet(cls, n: int) -> "Outcome":
        return cls(np.zeros(n, dtype=bool))


class Rule:
    """Base of every rule. Subclasses set the declarations below; ``spec`` is made from them."""

    id: ClassVar[str] = ""
    name: ClassVar[str] = ""
    # one of spec.FAMILIES: what the alert is grouped and routed by (its ``family`` label), the runs list's
    # early-warning badge (H) and the rank a cross-rank alert names (F); the id starts with it by convention
    family: ClassVar[str] = ""
    severity: ClassVar[str] = "warning"
    checklist: ClassVar[str] = "—"
    fires_when: ClassVar[str] = ""
    diagnosis: ClassVar[str] = ""
    actions: ClassVar[Mapping[str, str]] = MappingProxyType({})
    params: ClassVar[Mapping[str, Param]] = MappingProxyType({})
    needs: ClassVar[tuple[str, ...]] = ()          # step keys; "layers.<stat>" for per-layer arrays
    kind: ClassVar[str] = "batch"
    state_version: ClassVar[int] = 1
    # event kinds whose latest data the engine keeps per run and hands to this rule (ctx.remembered)
    # and attaches to its open alert (``late_evidence``)
    evidence_events: ClassVar[tuple[str, ...]] = ()
    # the condition on several ranks of one run is one incident: a rank that hits it while another
    # rank's alert of this rule is open joins that alert (its ranks listed, the earliest one leading)
    # instead of opening its own (docs/rules.md, "Several ranks")
    one_alert_across_ranks: ClassVar[bool] = False
    # a critical alert of this rule gets rollback advice: the last checkpoint at or before its first
    # anomalous step and the batches to skip (server/forensics/rollback.py, docs/checkpoints.md)
    rollback_advice: ClassVar[bool] = False
    # what the failure is called where forensics tells what came before it ("96 steps before the NaN
    # loss"); empty: "the <name with spaces>" (server/forensics/precursors.py)
    failure_noun: ClassVar[str] = ""
    # its place in the catalogue and in the engine's pass (the plug-in loader's order, agent/plugins.py:
    # by order, then name): the id unless the rule declares one (compared as strings: ... H1, H10, H11, H2 ...)
    order: ClassVar[str] = ""
    spec: ClassVar[RuleSpec]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "order" not in vars(cls):
            cls.order = cls.id

    @classmethod
    def make_spec(cls) -> RuleSpec:
        return RuleSpec(id=cls.id, name=cls.name, family=cls.family, severity=cls.severity, checklist=cls.checklist,
                        fires_when=cls.fires_when, diagnosis=cls.diagnosis,
                        named_actions=MappingProxyType(dict(cls.actions)),
                        param_specs=MappingProxyType(dict(cls.params)), kind=cls.kind, needs=tuple(cls.needs),
                        params={k: p.default for k, p in cls.params.items()},
                        one_alert_across_ranks=cls.one_alert_across_ranks,
                        rollback_advice=cls.rollback_advice)

    def applies(self, ctx: Context) -> bool:
        """Whether the batch holds anything this rule reads (a rule whose signals are absent from a
        batch is skipped without touching its state)."""
        return any(key in ctx.present for key in self.needs)

    def late_evidence(self, ctx: Context) -> dict[str, Any]:
        """Evidence from this batch's events for the rule's open alert."""
        return {}


class BatchRule(Rule):
    kind = "batch"

    def evaluate(self, batch: Batch, state: dict, cfg: dict) -> Outcome:
        raise NotImplementedError


class CrossRankRule(Rule):
    """Compares the ranks' values at the same steps; the verdicts may go on any rank. The engine hands
    it only the steps this batch completed (every other rank of the run has sent them), so each step
    is judged once, on the whole picture (``engine._cross_rank``)."""

    kind = "cross_rank"

    def evaluate(self, steps: np.ndarray, mine: dict[str, np.ndarray], others: dict[int, dict[str, np.ndarray]],
                 state_of: Callable[[int], dict], cfg: dict) -> list[tuple[int, int, Any]]:
        """[(rank, step, Hit | False)] in step order. ``mine`` also holds ``rank``, ``world_size`` and
        ``run_meta`` (what the agents said about the run, ``Context.run_meta``)."""
        raise NotImplementedError


class TimerRule(Rule):
    """Evaluated by a periodic scan (``server.rules.engine.scan_timer_rules``), not on data."""

    kind = "timer"

    def applies(self, ctx: Context) -> bool:
        return False

    def period(self, timeouts: list[float]) -> float:
        """How often the scan should look, given this rule's smallest configured timeout."""
        return max(0.2, min(5.0, min(timeouts) / 4))

    def candidates(self, session, *, now: float, smallest_timeout: float) -> list:
        """[(run, project name)] worth checking now (a cheap query: the scan runs every ``period``)."""
        raise NotImplementedError

    def check(self, session, run, cfg: dict, now: float):
        """(step, Hit) when the rule's condition holds for ``run``, else None."""
        raise NotImplementedError

    def alert_rank(self, hit: Hit) -> int:
        """The rank the alert names (its ``rank`` column); its lifecycle is kept on rank 0's state."""
        return 0

    def fired(self, run) -> None:
        """The alert was raised (F2 marks the run stalled)."""

    def revive(self, session, run, rank: int, lifecycle: Callable[[], dict], cfg: dict, now: float) -> bool:
        """Data arrived from ``rank`` (already written): whether the open alert resolves. ``lifecycle()``
        reads the alert's lifecycle state (``firing``, ``alert_id``) when the rule needs it."""
        return False


# --------------------------------------------------------------------------- helpers the rules share


def streaks(flag: np.ndarray, carry: int = 0) -> np.ndarray:
    """The length of the run of True ending at each position (0 where False); ``carry``: the run that
    was going on before the first position."""
    n = len(flag)
    idx = np.arange(n)
    last_false = np.maximum.accumulate(np.where(flag, -1, idx)) if n else idx
    out = idx - last_false
    out = np.where(last_false < 0, out + carry, out)
    out[~flag] = 0
    return out


def chunks_of(buf: list, values: list, size: int):
    """Append ``values`` to ``buf`` a chunk at a time: yields (the chunk, where in ``values`` its new values
    start and end) at each chunk of ``size`` that completes; ``buf`` keeps what is left over."""
    pos = 0
    while len(buf) + len(values) - pos >= size:
        end = pos + size - len(buf)
        chunk = buf + values[pos:end]
        buf.clear()
        yield chunk, pos, end
        pos = end
    buf.extend(values[pos:])


def pack_f8(arr) -> str:
    """float64 values -> base64 of their little-endian bytes: a compact, exact JSON string."""
    return base64.b64encode(np.ascontiguousarray(arr, dtype="<f8").tobytes()).decode("ascii")


def unpack_f8(raw) -> np.ndarray:
    """The inverse of ``pack_f8``; a plain JSON list is read as it is."""
    if isinstance(raw, str):
        return np.frombuffer(base64.b64decode(raw), dtype="<f8").copy()
    return np.asarray(raw if raw is not None else [], dtype=np.float64)


def medians(w: np.ndarray) -> np.ndarray:
    """The median of each row: the middle order statistics (for a finite row, ``stats.median``'s bits)."""
    n = w.shape[1]
    mid = n // 2
    if n % 2:
        return np.partition(w, mid, axis=1)[:, mid]
    p = np.partition(w, (mid - 1, mid), axis=1)
    return 0.5 * (p[:, mid - 1] + p[:, mid])


def mads(w: np.ndarray, med: np.ndarray) -> np.ndarray:
    """The MAD (scaled to a standard deviation) of each row around its median ``med``."""
    return MAD_TO_SIGMA * medians(np.abs(w - med[:, None]))


def window_slices(arr: np.ndarray, lo: np.ndarray, hi: np.ndarray):
    """The slices arr[lo[i]:hi[i]] as matrices, one per length: [(which slices, one slice a row)]."""
    lengths = hi - lo
    if not len(lengths):
        return []
    if lengths.min() == lengths.max():
        return [(slice(None), arr[lo[:, None] + np.arange(int(lengths[0]))])]
    return [(rows, arr[lo[rows][:, None] + np.arange(n)])
            for n in np.unique(lengths).tolist() for rows in [np.flatnonzero(lengths == n)]]


def name_of(names: list[str], i: int) -> str:
    return names[i] if 0 <= i < len(names) else f"#{i}"


def top_grad_norms(ctx: Context, st: dict, k: int = 5) -> Optional[list[list]]:
    """Top-k parameters by grad norm at this step: the agent's event, else the per-layer stats."""
    ev = ctx.events.get("top_grad_norms", {}).get(st["step"])
    if ev and ev.get("params"):
        return [[str(p[0]), enc(num(p[1]))] for p in ev["params"][:k]]
    values = layer_list(st, "grad_norm")
    if not values:
        return None
    pairs = []
    for i, v in enumerate(values):
        x = num(v)
        if x is None:
            continue
        pairs.append((math.inf if not math.isfinite(x) else x, i, x))
    pairs.sort(reverse=True)
    return [[name_of(ctx.param_names, i), enc(x)] for _, i, x in pairs[:k]]


NAN_EVIDENCE = ("nan_origin", "top_grad_norms")


def nan_late_evidence(ctx: Context) -> dict[str, Any]:
    """The NaN origin (the run's latest) and this batch's top grad norms, for an open NaN / explosion alert."""
    out: dict[str, Any] = {}
    if ctx.events.get("nan_origin") and ctx.remembered.get("nan_origin"):
        out["nan_origin"] = ctx.remembered["nan_origin"]
    tops = ctx.events.get("top_grad_norms")
    if tops:
        out["top_grad_norms"] = [[str(p[0]), enc(num(p[1]))] for p in (tops[max(tops)].get("params") or [])[:5]]
    return out
