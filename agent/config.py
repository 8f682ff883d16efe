"""Agent settings: one dataclass, filled from arguments and ``GRADWATCH_*`` variables.

Leaf module: imports only the standard library.

Every field can be set three ways, strongest first: a keyword argument to
``agent.attach(...)``, the environment variable ``GRADWATCH_<FIELD>`` (upper
case), the default below. Bad values raise ``ValueError`` with a message that
says what to fix, at attach time, before training starts.

Example::

    >>> cfg = AgentConfig.from_sources({"project": "nlp", "activations_every": 0}, env={})
    >>> cfg.project, cfg.activations_every
    ('nlp', 0)
"""
from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Mapping, Optional

DEFAULT_SERVER = "http://127.0.0.1:8470"
MODES = ("online", "offline", "disabled")


def default_run_name(clock=time.time) -> str:
    return time.strftime("run-%Y%m%d-%H%M%S", time.localtime(clock())) + f"-{os.getpid()}"


def default_spool_dir() -> str:
    return str(Path(os.path.expanduser("~")) / ".cache" / "gradwatch" / "spool")


@dataclass
class AgentConfig:
    """Everything the agent can be told.

    Sampling intervals are in optimizer steps; ``0`` turns a collector off,
    ``1`` runs it every step.
    """

    server: str = DEFAULT_SERVER
    project: str = "default"
    run: str = field(default_factory=default_run_name)
    token: Optional[str] = None
    mode: str = "online"                 # online | offline (spool only) | disabled
    # delivery
    flush_interval: float = 0.5          # seconds between batches
    live_flush_interval: float = 0.1     # ... while a dashboard page is watching the run (the server says so)
    max_batch_steps: int = 500           # a batch is shipped when it holds this many steps
    queue_size: int = 10_000             # steps held in memory before the sender; more are dropped and counted
    spool_dir: str = field(default_factory=default_spool_dir)
    spool_max_mb: float = 512.0          # on-disk spool bound; batches beyond it are dropped and counted
    crash_tail: bool = True              # journal each step locally before its batch (agent/tail.py): a
                                         # SIGKILLed process loses at most its last step
    crash_tail_fsync: bool = False       # fsync the journal after each write (survives a machine crash too)
    http_timeout: float = 5.0            # seconds per POST
    exit_timeout: float = 5.0            # seconds to flush at interpreter exit / close()
    seal_grace: float = 0.2              # seconds an ended step stays open for post-step values (EMA
                                         # update, monitor.log) before the sender thread seals and sends it
    # collectors
    grad_norms: bool = True              # per-parameter grad norms every step (one fused norm)
    weights_every: int = 100             # weight norms and update ratio ||dθ||/||θ||
    activations_every: int = 200         # activation mean/std/absmax/non-finite per module (100: +0.5 % a step)
    inputs_every: int = 10               # non-finite values in the input batch
    ema_every: int = 10                  # EMA divergence
    bn_every: int = 100                  # BatchNorm running-stat norms
    nan_hunt: bool = True                # after a non-finite loss/grad, hook every step until the origin is found
    nan_hunt_steps: int = 50             # give up hunting after this many steps
    nan_replay: bool = True              # replay a skipped NaN step with every module hooked (docs/nan-origin.md)
    nan_guard: bool = False              # no scaler: check the grad norm before each optimizer step (one sync
                                         # per step) and replay a non-finite one before the weights move
    memory: bool = True                  # CUDA peak allocated per step
    resume_rng: bool = True              # hash the RNG state at attach and every step end, for G6 (docs/resume.md);
                                         # the HF / Lightning callbacks turn it off (they restore the RNG later)
    batch_size: Optional[int] = None     # samples per optimizer step (inferred from the input when None)
    tokens_per_step: Optional[int] = None  # tokens per optimizer step (inferred from integer 2-D input when None)
    # alerts in the loop (docs/alerts-in-the-loop.md)
    loop_alerts: bool = True             # each batch asks for the run's new alerts: monitor.alerts(), on_alert=
    # rank 0 prints one line at attach (where the run can be seen) and each new alert of the run to stderr, as
    # `gradwatch demo` does; GRADWATCH_ANNOUNCE=0 (or announce=False) keeps the agent quiet (issue 42)
    announce: bool = True
    skip_spikes: bool = False            # skip an update whose grad norm is > skip_sigma σ above the mean of
    skip_sigma: float = 6.0              # the last skip_window accepted steps (and, without a GradScaler,
    skip_window: int = 128               # a non-finite one): on the device, no sync
    # configuration advice at step 0 (docs/early-warning-advice.md)
    setup_advice: bool = True            # send the run's setup once (precision, clipping and its order, EMA
                                         # decay, cosine floor) for the server's notes H5-H9; no per-step cost
    # early warning, attention and output logits (H2, H3; agent/collectors/early_logits.py)
    # the run's max logit is sampled every step while it grows (>= 10 and >= 1.5x one interval earlier), which
    # carries H2's and H12's lead time. Every 25 (issue 41, was 50): replayed on the early-warning benchmark's
    # tuning half (bench/early_warning/replay.py --cadence) it notices the growth as early as sampling every step
    # does (H12's median lead 53 -> 56, p25 36, the same controls warned), and it is the widest interval that does;
    # a sampled step costs the attention measurement alone (no other collector samples at 25, 75, ...): +0.09 ms
    # a step on the reference loop against every 50, side by side (docs/early-warning.md, "Cost and cadence")
    attn_logits_every: int = 25          # per attention module, the max attention logit q·k·scale
    output_logits_every: int = 50        # the output's max logit and mean log Z (H3's drift is slow)
    attention_modules: Optional[str] = None   # attention the agent cannot see where it is computed (an external
                                         # kernel): "name[:heads], ..." (fnmatch patterns), docs/signals.md
    # early warning H1 / H4 (docs/early-warning-adam.md): cadences measured with bench/agent_overhead.py
    adam_every: int = 20                 # Adam's g² / v̂ per parameter; 1 gives H1 its full 1-8 step lead (~2 % of a
                                         # CPU step measured, over the 1.03x budget with the rest: not the default)
    linear_every: int = 10               # output RMS of every nn.Linear module (watched on those steps only)

    def __post_init__(self) -> None:
        problems = []
        if not isinstance(self.server, str) or not self.server.startswith(("http://", "https://")):
            problems.append(f"server={self.server!r}: give an http:// or https:// URL, e.g. {DEFAULT_SERVER}")
        for name in ("project", "run"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value.strip() or len(value) > 200:
                problems.append(f"{name}={value!r}: give a non-empty name of at most 200 characters")
        if self.mode not in MODES:
            problems.append(f"mode={self.mode!r}: use one of {', '.join(MODES)}")
        for name in ("flush_interval", "live_flush_interval", "http_timeout", "exit_timeout"):
            if not getattr(self, name) > 0:
                problems.append(f"{name}={getattr(self, name)!r}: must be a positive number of seconds")
        if not (isinstance(self.seal_grace, (int, float)) and self.seal_grace >= 0):
            problems.append(f"seal_grace={self.seal_grace!r}: must be >= 0 seconds (0.2 is the default)")
        for name in ("max_batch_steps", "queue_size"):
            if getattr(self, name) < 1:
                problems.append(f"{name}={getattr(self, name)!r}: must be at least 1")
        if self.spool_max_mb < 0:
            problems.append(f"spool_max_mb={self.spool_max_mb!r}: must be >= 0 (0 disables the spool)")
        for name in cadences():
            if not (isinstance(getattr(self, name), int) and getattr(self, name) >= 0):
                problems.append(f"{name}={getattr(self, name)!r}: use 0 to turn it off, or a positive step interval")
        if self.nan_hunt_steps < 0:
            problems.append(f"nan_hunt_steps={self.nan_hunt_steps!r}: use 0 to turn it off, or a positive step interval")
        if not (isinstance(self.skip_sigma, (int, float)) and self.skip_sigma > 0):
            problems.append(f"skip_sigma={self.skip_sigma!r}: must be a positive number of standard deviations")
        if not (isinstance(self.skip_window, int) and self.skip_window >= 8):
            problems.append(f"skip_window={self.skip_window!r}: must be an integer of at least 8 steps (128 is "
                            f"the default)")
        for name in ("batch_size", "tokens_per_step"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                problems.append(f"{name}={value!r}: must be a positive integer or None (inferred)")
        for item in (self.attention_modules or "").split(","):   # agent/collectors/early_logits.py reads it
            heads = item.partition(":")[2].strip()
            if item.strip() and (not item.partition(":")[0].strip() or (heads and not (heads.isdigit() and int(heads) > 0))):
                problems.append(f"attention_modules entry {item.strip()!r}: write NAME or NAME:HEADS (a module name "
                                f"or fnmatch pattern, a positive head count), e.g. blocks.*.attn:8")
        if problems:
            raise ValueError("gradwatch agent configuration: " + "; ".join(problems))
        self.server = self.server.rstrip("/")

    @property
    def spool_max_bytes(self) -> int:
        return int(self.spool_max_mb * 1024 * 1024)

    @classmethod
    def every_step(cls, **overrides: Any) -> "AgentConfig":
        """Every collector on, every step (what the benchmark calls "full")."""
        return cls.from_sources({**EVERY_STEP, **overrides})

    @classmethod
    def from_sources(cls, arguments: Mapping[str, Any], env: Optional[Mapping[str, str]] = None) -> "AgentConfig":
        """Arguments win over ``GRADWATCH_<FIELD>`` variables, which win over defaults."""
        env = os.environ if env is None else env
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(arguments) - set(known))
        if unknown:
            raise ValueError(
                f"gradwatch agent configuration: unknown setting(s) {', '.join(unknown)}; "
                f"known settings are {', '.join(sorted(known))}"
            )
        values: dict[str, Any] = {}
        for name, f in known.items():
            if arguments.get(name) is not None:
                values[name] = arguments[name]
                continue
            raw = env.get("GRADWATCH_" + name.upper())
            if raw is None or raw == "":
                continue
            values[name] = _parse(name, f, raw)
        return cls(**values)

    def public(self) -> dict:
        """The settings as sent in ``meta.config`` (without the token)."""
        out = dataclasses.asdict(self)
        out.pop("token", None)
        return out



def cadences() -> tuple[str, ...]:
    """The sampling intervals, in steps: every ``*_every`` setting of :class:`AgentConfig` (one name per
    collector's cadence; a new one is a new field, with no list to edit)."""
    return tuple(f.name for f in fields(AgentConfig) if f.name.endswith("_every"))


# The sampling intervals that put every collector on every step (``AgentConfig.every_step``, the
# benchmark's "agent-full" mode).
EVERY_STEP: Mapping[str, int] = dict.fromkeys(cadences(), 1)

def _parse(name: str, f: dataclasses.Field, raw: str) -> Any:
    kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
    try:
        if "bool" in kind:
            low = raw.strip().lower()
            if low in ("1", "true", "yes", "on"):
                return True
            if low in ("0", "false", "no", "off"):
                return False
            raise ValueError(raw)
        if "int" in kind:
            return int(raw)
        if "float" in kind:
            return float(raw)
    except ValueError:
        raise ValueError(
            f"gradwatch agent configuration: GRADWATCH_{name.upper()}={raw!r} is not a valid {kind}"
        ) from None
    return raw
