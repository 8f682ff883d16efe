"""The signal table: every number gradwatch records, declared once.

The agent (what goes on the wire), the server (validation, storage, NaN
encoding, queries, rules' inputs) and the dashboard (run-page panels,
heatmaps, the compare page) all read these declarations; none of them keeps
its own list. Leaf module: standard library only, so a monitoring host
without torch imports it too.

Three kinds of signal:

- :class:`StepSignal` — one number per optimizer step and rank (``loss``,
  ``grad_norm`` …). Its ``id`` is its permanent storage slot: the bit of the
  ``steps.nan_mask`` column (for the first 14, which have columns of their
  own), the column of the step rollup blobs, the slot in ``steps.extra``
  (for every later one). Ids are never reused or renumbered; a new signal
  takes the next free id and needs no migration: rows and rollups written
  before it simply hold no value for it ("not measured").
- :class:`LayerStat` — one number per parameter tensor, module or BatchNorm
  layer, stored as a packed float32 array per step (``layers.<name>`` on the
  wire); stored by name, so a new one needs no migration either.
- :class:`EventKind` — discrete events (``nan_origin`` …).

Adding a per-step scalar end to end (docs/architecture.md, "Adding a
signal"): declare it here, and have a collector in the agent add a part of the
same name to the step record (``record.add("my_signal", tensor)``). The
server then accepts, stores, rolls up and serves it, the dashboard charts it
in the declared panel, and rules can read ``step["my_signal"]``.

>>> step_signal("grad_norm").id, step_signal("grad_norm").kind
(1, 'float')
>>> [s.name for s in STEP_SIGNALS if s.kind == "bool"]
['clipped', 'overflow', 'skipped_update']
>>> layer_stat("act_std").over
'modules'
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

Kind = Literal["float", "count", "bool"]
# how the pieces of one parameter, each measured by the rank holding it, combine into the full parameter's
# value (and the parameters' values into a step total): l2, the root of the sum of squares (norms); sum
# (counts); max (largest values)
Combine = Literal["l2", "sum", "max"]
Draw = Literal["line", "dash", "flag"]
Over = Literal["params", "modules", "bn"]
# what a non-finite value of a step signal makes its step (agent/wire.py): critical (sent at once, the top grad
# norms and the NaN-origin hunt) always, or only when no loss scaler is active on it (an overflow it skips)
Critical = Literal["nonfinite", "nonfinite_without_scaler"]
# the NaN-origin hunt's reading of a per-layer statistic (agent/wire.py): "activation", the first module in
# forward order whose value is non-finite or above 0; "grad", the parameters whose value is non-finite (the
# last of them in forward order is the origin; a critical step's largest ones go out as top_grad_norms)
HuntRole = Literal["activation", "grad"]


@dataclass(frozen=True)
class Panel:
    """A run-page chart. Its lines and flags are the step signals that name it (in id order)."""
    key: str
    title: str
    log_y: bool = False
    smoothed: bool = False          # draw an EMA-smoothed copy of the first line too
    include_zero: bool = False      # absolute quantities: a constant LR reads as a level, not as noise
    headline: bool = False          # drawn first, before the rest of the page loads


@dataclass(frozen=True)
class StepSignal:
    """A per-step scalar."""
    name: str
    id: int                 # permanent storage slot (see the module docstring); never reuse one
    kind: Kind              # float: any float, NaN / ±Inf kept; count: an int >= 0; bool
    unit: str
    meaning: str
    column: bool = False    # has its own `steps` column (the signals from before this table)
    panel: Optional[str] = None     # key of the run-page panel it is drawn in (None: not charted)
    label: str = ""                 # its legend name in that panel
    draw: Draw = "line"             # line; dash (a reference line); flag (markers where a bool is true)
    marker: str = "triangle-down"   # a flag's marker symbol
    scale: float = 1.0              # display scale (bytes -> GiB)
    compare: Optional[str] = None   # title on the compare page (None: not compared)
    per_rank: Optional[str] = None  # title of its all-ranks overlay and rank × step heatmap (None: neither)
    # a sharded run's combined row (rank -1) holds it: the dashboard reads it there, not on rank 0
    combined: bool = False
    # What a non-finite value means for this signal, in words (docs/signals.md).
    nonfinite: str = "kept: NaN and ±Inf are stored, charted on the NaN rug and read by the rules"
    # derived: the record parts it is computed from, in one process, by agent/derived.py's function of its name
    derived_from: tuple[str, ...] = ()
    # a sharded run's per-rank form: the record part this signal carries on such a run (a rank's own value
    # of its pieces, sent under this signal's name instead of the part's; "Sharded runs" below)
    pieces_of: Optional[str] = None
    # a non-finite value makes the step critical (Critical above; read from its per-rank form on a sharded run)
    critical: Optional[Critical] = None


@dataclass(frozen=True)
class LayerStat:
    """A per-layer statistic: one float32 per parameter tensor, module or BatchNorm layer."""
    name: str
    over: Over                      # which of the run's name lists indexes the array
    unit: str
    meaning: str
    heatmap: Optional[str] = None   # run-page heatmap title (None: no heatmap)
    combined: bool = False          # a sharded run's combined row (rank -1) holds it (server/storage/ranks.py)
    derived_from: tuple[str, ...] = ()   # as StepSignal.derived_from
    # a sharded run's per-rank form ("Sharded runs" below): the record part ("layers.<x>") whose values of
    # this rank's pieces it carries; how the server combines the pieces of a parameter; and the step part
    # that is its total over the parameters (combined the same way), if any
    pieces_of: Optional[str] = None
    combine: Optional[Combine] = None
    total: Optional[str] = None
    # how the NaN-origin hunt reads it (HuntRole above; from its per-rank form on a sharded run)
    nan_hunt: Optional[HuntRole] = None


@dataclass(frozen=True)
class EventKind:
    name: str
    meaning: str


GIB = 1.0 / (1 << 30)

PANELS: tuple[Panel, ...] = (
    Panel("loss", "Loss", smoothed=True, headline=True),
    Panel("grad_norm", "Grad norm (pre-clip, unscaled)", log_y=True, headline=True),
    Panel("loss_scale", "Loss scale (log)", log_y=True, headline=True),
    Panel("lr", "Learning rate", include_zero=True),
    Panel("ema_divergence", "EMA divergence ‖θ_ema − θ‖ / ‖θ‖", log_y=True),
    Panel("throughput", "Throughput", include_zero=True),
    Panel("step_time", "Step time (s)", include_zero=True),
    Panel("memory", "Device memory, peak (GiB)", include_zero=True),
    Panel("grad_zero_fraction", "Gradient elements exactly zero (share, after unscale)", include_zero=True),
)

# ---- early warning, attention and output logits (H2, H3: agent/collectors/early_logits.py)
PANELS += (
    Panel("early_logits", "Attention and output logits (max; output mean log Z)"),
)

STEP_SIGNALS: tuple[StepSignal, ...] = (
    StepSignal("loss", 0, "float", "", "the step's loss (summed over its micro-batches)", column=True,
               panel="loss", label="loss", compare="Loss", per_rank="Loss per rank",
               nonfinite="an incident: a NaN / Inf loss raises A1 (critical)", critical="nonfinite"),
    StepSignal("grad_norm", 1, "float", "", "global L2 norm of the gradients, unscaled and before clipping",
               column=True, panel="grad_norm", label="grad norm", compare="Grad norm (pre-clip)",
               per_rank="Grad norm per rank", combined=True,
               nonfinite="with a GradScaler: an fp16 overflow the scaler skips (A5); without one: A2 (critical)",
               critical="nonfinite_without_scaler"),
    StepSignal("clip_max_norm", 2, "float", "", "the max_norm passed to clip_grad_norm_", column=True,
               panel="grad_norm", label="clip max_norm", draw="dash", combined=True),
    StepSignal("clipped", 3, "bool", "", "the pre-clip norm exceeded max_norm", column=True,
               panel="grad_norm", label="clipped step", draw="flag", marker="circle-open", combined=True,
               derived_from=("grad_norm", "clip_max_norm")),
    StepSignal("loss_scale", 4, "float", "", "the loss scale used for this step: a GradScaler's before update(), or one "
               "reported by monitor.log(loss_scale=...) (DeepSpeed fp16)",
               column=True, panel="loss_scale", label="loss scale", compare="Loss scale (log)"),
    StepSignal("overflow", 5, "bool", "", "the scaler found inf/NaN grads and skipped optimizer.step()",
               column=True, panel="loss_scale", label="overflow (skipped step)", draw="flag"),
    StepSignal("overflow_count", 6, "count", "steps", "skipped steps so far in this process", column=True),
    StepSignal("lr", 7, "float", "", "learning rate of param group 0", column=True, panel="lr", label="lr",
               compare="Learning rate"),
    StepSignal("step_time", 8, "float", "s", "seconds between the ends of this step and the previous one",
               column=True, panel="step_time", label="step time", per_rank="Step time per rank (s)"),
    StepSignal("samples_per_s", 9, "float", "1/s", "samples per second", column=True, panel="throughput",
               label="samples/s", compare="Throughput (samples/s)"),
    StepSignal("tokens_per_s", 10, "float", "1/s", "tokens per second", column=True, panel="throughput",
               label="tokens/s"),
    StepSignal("mem_peak", 11, "float", "bytes", "CUDA peak allocated bytes since the previous step",
               column=True, panel="memory", label="peak allocated", scale=GIB),
    StepSignal("ema_divergence", 12, "float", "", "‖θ_ema − θ‖ / ‖θ‖ over all parameters (sampled)",
               column=True, panel="ema_divergence", label="EMA divergence", compare="EMA divergence",
               combined=True, derived_from=("ema_diff", "ema_ref")),
    StepSignal("input_nonfinite", 13, "count", "values", "non-finite values in the batch fed to the model (sampled)",
               column=True, nonfinite="a count; any value above 0 raises A4"),
    # ---- signals declared after these have no column of their own: stored in `steps.extra` by id
    StepSignal("grad_zero_fraction", 14, "float", "", "share of gradient elements that are exactly zero after "
               "unscale, over all parameters (sampled; the fp16 underflow of the checklist's section 2.1)",
               panel="grad_zero_fraction", label="zero grad elements", combined=True,
               derived_from=("grad_zero_count", "numel")),
    StepSignal("grad_norm_local", 15, "float", "", "L2 norm of the gradient elements this rank holds, unscaled "
               "and before clipping (sharded parameters: FSDP / DTensor); the server combines the ranks' "
               "per-parameter norms into the global grad_norm of the combined row (rank -1)",
               nonfinite="kept: a non-finite shard makes the global grad norm non-finite", pieces_of="grad_norm"),
    # a resume's G6 compares the RNG state after loading a checkpoint with this value of the step before it
    StepSignal("rng_hash", 16, "count", "", "CRC-32 of the torch CPU (and CUDA, once initialised) RNG state at "
               "the step's end, where a checkpoint is usually saved (docs/resume.md)"),
    StepSignal("skipped_update", 17, "bool", "", "the opt-in skip_spikes guard undid this step's optimizer update "
               "(grad norm > skip_sigma σ above its recent mean, or non-finite without a GradScaler; "
               "docs/alerts-in-the-loop.md)",
               panel="grad_norm", label="update skipped (guard)", draw="flag", marker="x"),
    # F3 under DDP: the all-reduce makes every rank's step time the slowest one's, but the time before the
    # forward (data loader, host work) stays each rank's own (docs/rules.md, F3)
    StepSignal("data_time", 19, "float", "s", "seconds from the end of the previous step to this step's first "
               "training forward: the data loader and whatever else the loop does between steps (host clock)",
               panel="step_time", label="data time (before forward)", per_rank="Data time per rank (s)"),
)

# ---- early warning, attention and output logits (H2, H3: agent/collectors/early_logits.py)
STEP_SIGNALS += (
    StepSignal("attn_logit_max", 20, "float", "", "largest attention logit over the attention modules: every "
               "unmasked logit their softmax sees (scaled_dot_product_attention's recomputed from its q and k; "
               "sampled)",
               panel="early_logits", label="max attention logit"),
    StepSignal("output_logit_max", 21, "float", "", "largest logit of the model's output (a distribution over "
               ">= 2 classes; sampled)", panel="early_logits", label="max output logit"),
    StepSignal("output_log_z", 22, "float", "", "mean over positions of the output's log Z = logsumexp over "
               "its classes (z-loss holds it near 0; sampled)", panel="early_logits", label="mean log Z"),
)

# ---- a step signal added as docs/architecture.md's "Adding a signal" says: this declaration and its
# collector, agent/collectors/grad_presence.py; its run-page panel, as "Adding a panel" says: the Panel
# and panel= on the signal
PANELS += (Panel("params_without_grad", "Trainable parameters without a gradient (tensors)", include_zero=True),)
STEP_SIGNALS += (
    StepSignal("params_without_grad", 23, "count", "tensors", "trainable parameter tensors whose .grad is None "
               "at the optimizer step: they took no part in the backward (an unused branch, a stray .detach(); "
               "sampled with weights_every; sharded runs: not measured)",
               panel="params_without_grad", label="without .grad"),
)

LAYER_STATS: tuple[LayerStat, ...] = (
    LayerStat("grad_norm", "params", "", "per-parameter grad norm (unscaled, pre-clip)",
              heatmap="Per-parameter grad norm (log10)", combined=True, nan_hunt="grad"),
    LayerStat("weight_norm", "params", "", "per-parameter weight norm ‖θ‖ (sampled)",
              heatmap="Per-parameter weight norm (log10)", combined=True),
    LayerStat("update_ratio", "params", "", "per-parameter ‖Δθ‖ / ‖θ‖ of this step's update (sampled)",
              combined=True, derived_from=("layers.update_norm", "layers.weight_norm")),
    LayerStat("grad_zero_fraction", "params", "", "per-parameter share of gradient elements exactly zero after "
              "unscale (sampled)", combined=True, derived_from=("layers.grad_zero_count", "layers.numel")),
    # sharded runs: what one rank measures of its pieces of each parameter, and how the server combines the
    # pieces ("Sharded runs" below): norms as the root of the sum of squares, counts added
    LayerStat("grad_norm_local", "params", "", "per-parameter grad norm over this rank's shard (sharded runs)",
              pieces_of="layers.grad_norm", combine="l2", total="grad_norm"),
    LayerStat("weight_norm_local", "params", "", "per-parameter weight norm over this rank's shard (sharded "
              "runs, sampled)", pieces_of="layers.weight_norm", combine="l2"),
    LayerStat("update_norm_local", "params", "", "per-parameter ‖Δθ‖ over this rank's shard (sharded runs, "
              "sampled)", pieces_of="layers.update_norm", combine="l2"),
    # sharded runs, with the EMA: its divergence's numerator and denominator per parameter piece
    LayerStat("ema_diff_local", "params", "", "per-parameter ‖θ_ema − θ‖ over this rank's shard (sharded runs, "
              "sampled with the EMA divergence)", pieces_of="layers.ema_diff", combine="l2", total="ema_diff"),
    LayerStat("ema_ref_local", "params", "", "per-parameter ‖θ‖ over this rank's shard, the EMA divergence's "
              "denominator (sharded runs, sampled with it)", pieces_of="layers.ema_ref", combine="l2",
              total="ema_ref"),
    # sharded runs: the gradient elements exactly zero, counted, and the elements of each piece
    LayerStat("grad_zero_count_local", "params", "elements", "per-parameter count of gradient elements exactly "
              "zero after unscale in this rank's shard (sharded runs, sampled)",
              pieces_of="layers.grad_zero_count", combine="sum", total="grad_zero_count"),
    LayerStat("numel_local", "params", "elements", "per-parameter element count of this rank's shard (sharded "
              "runs, sampled with grad_zero_count_local)", pieces_of="layers.numel", combine="sum", total="numel"),
    LayerStat("act_mean", "modules", "", "mean of each module's output (sampled)"),
    LayerStat("act_std", "modules", "", "standard deviation of each module's output (sampled)",
              heatmap="Per-module activation std (log10)"),
    LayerStat("act_absmax", "modules", "", "max |x| of each module's output (sampled)"),
    LayerStat("act_nonfinite", "modules", "values", "non-finite values in each module's output (sampled)",
              nan_hunt="activation"),
    LayerStat("bn_mean_norm", "bn", "", "norm of each BatchNorm layer's running mean (sampled)"),
    LayerStat("bn_var_norm", "bn", "", "norm of each BatchNorm layer's running variance (sampled)"),
)

# ---- early warning, attention logits (H2: agent/collectors/early_logits.py)
LAYER_STATS += (
    LayerStat("attn_logit_max", "modules", "", "per attention module (the innermost module computing it), its "
              "largest unmasked attention logit over the forward (null for other modules; sampled)",
              heatmap="Per-module max attention logit (log10)"),
)

EVENT_KINDS: tuple[EventKind, ...] = (
    EventKind("nan_origin", "the first module whose activation or gradient went non-finite"),
    EventKind("nan_origin_not_found", "the NaN-origin hunt gave up after nan_hunt_steps steps"),
    EventKind("top_grad_norms", "the largest per-parameter grad norms of a critical step"),
    EventKind("dropped", "steps the agent dropped (queue or spool full, batch rejected), with the reason"),
    EventKind("checkpoint", "a checkpoint was saved: its path, at the step the run resumes from "
                            "(monitor.checkpoint, the HF and Lightning callbacks; docs/checkpoints.md)"),
    EventKind("resume_state", "what the training state looked like at attach (scaler, optimizer, EMA, BatchNorm, "
                              "LR, RNG): the server adds the stored state before it (G1-G6, docs/resume.md)"),
    EventKind("steps_already_stored", "steps a batch numbered like stored ones, not written (the server's word; "
                                      "docs/resume.md)"),
)

# configuration advice at step 0 (agent/setup.py; rules H5-H9, docs/early-warning-advice.md)
EVENT_KINDS += (
    EventKind("attention_coverage", "the modules whose attention logits the agent measures (the first sampled "
                                    "step, and again whenever the set grows)"),
    EventKind("run_setup", "the run's setup, once per process with its first step: device and native bf16, "
                           "autocast dtype, GradScaler, Transformer or not, clip_grad_norm_ calls and the scaler "
                           "stage at them, EMA decay, a cosine schedule's base and final LRs (H5-H9), the LRs "
                           "param group 0 was configured with (H10)"),
)

# ---- issue 18, early warning H1 / H4 (docs/early-warning-adam.md): Adam's second moment going stale, and
# the output RMS of the linear layers. Appended here so that each early-warning family stays one block.
PANELS += (Panel("adam_g2_over_v", "Adam: largest per-parameter mean(g²) / mean(v̂) (stale second moment)",
                 log_y=True),)
STEP_SIGNALS += (
    StepSignal("adam_g2_over_v_max", 18, "float", "", "the largest per-parameter mean(g²) / (mean(v̂) + ε²) of the "
               "step: g the unscaled, clipped gradient Adam is about to use, v̂ its bias-corrected second moment "
               "from before the step (AdamW's optimizer state; H1 adam_stale)",
               panel="adam_g2_over_v", label="max over parameters",
               nonfinite="kept: an fp16 overflow the scaler skips reads as NaN here (H1 leaves those steps out)"),
)
LAYER_STATS += (
    LayerStat("adam_g2_over_v", "params", "", "per-parameter mean(g²) / (mean(v̂) + ε²): this step's squared "
              "gradient (unscaled, clipped) over Adam's bias-corrected second moment from before the step "
              "(every adam_every steps; H1)", heatmap="Per-parameter Adam g² / v̂ (log10)"),
    LayerStat("linear_out_rms", "modules", "", "output RMS ‖y‖ / √n of each nn.Linear module's forward "
              "(every linear_every steps; other modules: not measured; H4)"),
)

# ---- a sharded signal added as docs/architecture.md's "Adding a signal" says, in two files: these declarations
# (the signal, its per-layer statistic and their per-rank form) and its collector, agent/collectors/grad_absmax.py;
# the server combines the ranks' pieces from the per-rank form alone (server/storage/ranks.py)
STEP_SIGNALS += (
    StepSignal("grad_absmax", 24, "float", "", "largest |g| of any gradient element after unscale, as the "
               "optimizer uses it (after clipping; sampled with weights_every): fp16 overflows where it times "
               "the loss scale passes 65504", combined=True,
               nonfinite="kept: a non-finite gradient element makes it non-finite"),
)
LAYER_STATS += (
    LayerStat("grad_absmax", "params", "", "per-parameter largest |g| of a gradient element after unscale "
              "(sampled with weights_every)", combined=True),
    LayerStat("grad_absmax_local", "params", "", "per-parameter largest |g| over this rank's shard (sharded runs, "
              "sampled)", pieces_of="layers.grad_absmax", combine="max", total="grad_absmax"),
)

# ---- early warning, a mixture of experts' router (H14: agent/collectors/early_logits.py, measured by the attention
# logits' mode in the same sampled forward)
STEP_SIGNALS += (
    StepSignal("router_logit_spread", 25, "float", "", "largest spread (max - min over the experts) of one token's "
               "router logits, over the routers: a 2-D or 3-D softmax over the last dimension inside the model that "
               "the forward routes by (Switch, Mixtral), whose routing turns one-hot as it grows (sampled with "
               "attn_logits_every)",
               panel="early_logits", label="max router logit spread"),
)
LAYER_STATS += (
    LayerStat("router_logit_spread", "modules", "", "per module computing a router (the innermost module holding "
              "the softmax), the largest spread of one token's router logits over the forward (null for other "
              "modules; sampled with attn_logits_every)"),
)

_BY_NAME = {s.name: s for s in STEP_SIGNALS}
_LAYER_BY_NAME = {s.name: s for s in LAYER_STATS}
_PANEL_BY_KEY = {p.key: p for p in PANELS}

STEP_SIGNAL_NAMES: tuple[str, ...] = tuple(s.name for s in STEP_SIGNALS)
COLUMN_SIGNALS: tuple[StepSignal, ...] = tuple(s for s in STEP_SIGNALS if s.column)
EXTRA_SIGNALS: tuple[StepSignal, ...] = tuple(s for s in STEP_SIGNALS if not s.column)
# the first `steps.extra` slot: extra signal `s` sits at index s.id - EXTRA_BASE
EXTRA_BASE = len(COLUMN_SIGNALS)
# one column per id in every step rollup blob
ROLLUP_WIDTH = max(s.id for s in STEP_SIGNALS) + 1


# ---- the names a step record's parts and host values take (agent/record.py, agent/collectors/): the
# table's own. A step signal's name ("loss"), "layers." + a per-layer statistic's ("layers.grad_norm"),
# or an input of a derived signal ("ema_diff"). agent/wire.py puts each on the wire by these
# declarations alone; a collector declares the names it writes (``Collector.emits``), checked at attach.
LAYER_PART_PREFIX = "layers."
# custom scalars (monitor.log) travel as "custom:<key>" parts: names of the user's, not of this table
CUSTOM_PART_PREFIX = "custom:"


# ---- Sharded runs (FSDP / DTensor): every rank holds a piece of each sharded parameter and measures only
# its pieces (a collective to combine them in the training job is one the agent must never add). A
# collector writes the table's names whatever the sharding, through :func:`per_rank`: on a sharded run a
# part that a per-rank form declares (``pieces_of``) goes out under that form's name instead. The server
# combines a step's ranks from these declarations alone (server/storage/ranks.py): each per-rank statistic's
# distinct pieces into the full parameters' values of its part (``combine``), their totals over the
# parameters into step parts (``total``), the combined row's derived signals from those by agent/derived.py,
# and any other signal of the combined row (``combined``) from rank 0, the same on every rank (clip_max_norm).
# A derived value whose inputs a sharded rank sends in their per-rank form is left to the combined row.
PER_RANK: dict[str, str] = {d.pieces_of: (LAYER_PART_PREFIX if isinstance(d, LayerStat) else "") + d.name
                            for d in (*STEP_SIGNALS, *LAYER_STATS) if d.pieces_of}
PIECES: tuple[LayerStat, ...] = tuple(s for s in LAYER_STATS if s.combine)


def per_rank(part: str, sharded: bool) -> str:
    """The name a collector's record part ``part`` (the table's name) takes: on a sharded run, the per-rank
    form the table declares for it, if any.

    >>> per_rank("layers.grad_norm", True), per_rank("layers.grad_norm", False), per_rank("loss", True)
    ('layers.grad_norm_local', 'layers.grad_norm', 'loss')
    """
    return PER_RANK.get(part, part) if sharded else part


def derived_inputs() -> tuple[str, ...]:
    """The record parts that only feed derived signals (they do not go on the wire themselves)."""
    seen: dict[str, None] = {}
    for d in (*STEP_SIGNALS, *LAYER_STATS):
        seen.update(dict.fromkeys(d.derived_from))
    return tuple(n for n in seen if not is_record_signal(n))


def is_record_signal(name: str) -> bool:
    """A record part name that goes on the wire as it is: a measured (not derived) step signal, or
    "layers." + a measured per-layer statistic."""
    if name.startswith(LAYER_PART_PREFIX):
        stat = _LAYER_BY_NAME.get(name[len(LAYER_PART_PREFIX):])
        return stat is not None and not stat.derived_from
    s = _BY_NAME.get(name)
    return s is not None and not s.derived_from


def unknown_record_names(names) -> list[str]:
    """Those of ``names`` that no step record may hold: neither a measured signal of this table nor an
    input of a derived one (see :func:`is_record_signal`, :func:`derived_inputs`), nor a custom scalar.

    >>> unknown_record_names(["loss", "layers.grad_norm", "ema_diff", "custom:acc", "grad_norms", "clipped"])
    ['grad_norms', 'clipped']
    """
    inputs = derived_inputs()
    return [n for n in names if not is_record_signal(n) and n not in inputs and n not in PER_RANK
            and not n.startswith(CUSTOM_PART_PREFIX)]


def step_signal(name: str) -> StepSignal:
    """The declaration of a per-step signal; ``KeyError`` naming the known ones when there is none."""
    try:
        return _BY_NAME[name]
    except KeyError:
        raise KeyError(f"unknown step signal {name!r}: one of {', '.join(STEP_SIGNAL_NAMES)}") from None


def is_step_signal(name: str) -> bool:
    return name in _BY_NAME


def layer_stat(name: str) -> Optional[LayerStat]:
    """The declaration of a per-layer statistic, or None for a name the table does not know (an agent
    may send statistics of its own: they are stored and indexed by parameter name)."""
    return _LAYER_BY_NAME.get(name)


def panel(key: str) -> Panel:
    return _PANEL_BY_KEY[key]


def panel_signals(key: str) -> tuple[StepSignal, ...]:
    """The step signals drawn in one panel, in id order."""
    return tuple(s for s in STEP_SIGNALS if s.panel == key)


def _check() -> None:
    """The table's own invariants, checked at import: a broken declaration fails every process at once."""
    ids = [s.id for s in STEP_SIGNALS]
    if len(set(ids)) != len(ids):
        raise ValueError(f"step signal ids must be unique: {ids}")
    if len(_BY_NAME) != len(STEP_SIGNALS) or len(_LAYER_BY_NAME) != len(LAYER_STATS):
        raise ValueError("signal names must be unique")
    if [s.id for s in COLUMN_SIGNALS] != list(range(len(COLUMN_SIGNALS))):
        raise ValueError("the column signals hold ids 0..13, in order (their nan_mask bits)")
    if any(s.id < EXTRA_BASE for s in EXTRA_SIGNALS):
        raise ValueError("an extra signal's id must come after every column signal's")
    for s in STEP_SIGNALS:
        if s.panel is not None and s.panel not in _PANEL_BY_KEY:
            raise ValueError(f"signal {s.name!r} names an unknown panel {s.panel!r}")
        if s.draw == "flag" and s.kind != "bool":
            raise ValueError(f"signal {s.name!r}: only a bool signal can be drawn as a flag")
    for p in PANELS:
        if not any(s.draw == "line" for s in panel_signals(p.key)):
            raise ValueError(f"panel {p.key!r} needs at least one signal drawn as a line")
    for d in (*STEP_SIGNALS, *LAYER_STATS):
        if any(n.startswith(LAYER_PART_PREFIX) != isinstance(d, LayerStat) for n in d.derived_from):
            raise ValueError(f"{d.name!r}: a per-layer statistic derives from \"layers.\" parts, a step signal "
                             "from step parts")
        if d.pieces_of is not None and d.pieces_of.startswith(LAYER_PART_PREFIX) != isinstance(d, LayerStat):
            raise ValueError(f"{d.name!r}: a per-layer statistic is the per-rank form of a \"layers.\" part, a "
                             "step signal of a step part")
    for role in ("activation", "grad"):
        if sum(1 for s in LAYER_STATS if s.nan_hunt == role) != 1:
            raise ValueError(f"one per-layer statistic is the NaN-origin hunt's {role!r} reading")
    if len(PER_RANK) != sum(1 for d in (*STEP_SIGNALS, *LAYER_STATS) if d.pieces_of):
        raise ValueError("a record part has one per-rank form")
    totals = {s.total for s in PIECES if s.total}
    for s in LAYER_STATS:
        if (s.combine is not None) != (s.pieces_of is not None) or (s.total and not s.combine):
            raise ValueError(f"{s.name!r}: a per-rank statistic declares pieces_of and combine (total with them)")
        if s.combine and s.over != "params":
            raise ValueError(f"{s.name!r}: only a per-parameter statistic is measured in pieces")
        if s.combined and not (s.derived_from or LAYER_PART_PREFIX + s.name in PER_RANK):
            raise ValueError(f"{s.name!r}: a combined per-layer statistic is some per-rank statistic's part, or "
                             "derived from such parts")
        if s.combined and any(n not in PER_RANK for n in s.derived_from):
            raise ValueError(f"{s.name!r}: its combined value derives from parts the ranks send in pieces")
    for sig in STEP_SIGNALS:
        if sig.combined and sig.derived_from and any(n not in totals and not is_step_signal(n)
                                                     for n in sig.derived_from):
            raise ValueError(f"{sig.name!r}: its combined value derives from step totals or step signals")


_check()
