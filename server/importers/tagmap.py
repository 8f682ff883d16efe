"""Which logged scalar becomes which gradwatch signal.

The defaults cover the names the common trainers and loggers write (HF Trainer,
Lightning, DeepSpeed, Megatron, torchtitan, nanoGPT-style loops); ``--map
TAG=SIGNAL`` adds or overrides one (``--map TAG=`` leaves a tag out). Signal
names are checked against the signal table (agent/signals.py), never a list of
their own. Standard library only: the CLI builds a map before any reader is
imported.

>>> m = TagMap.build(["train/loss=grad_norm"])
>>> m.signal("train/loss"), m.signal("train/learning_rate"), m.signal("epoch")
('grad_norm', 'lr', None)
"""
from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field
from typing import Optional

# tag -> signal. Exact names first; a tag matching no exact name is tried against the patterns.
DEFAULT_TAGS: dict[str, str] = {
    # loss
    "loss": "loss",
    "train/loss": "loss",
    "train_loss": "loss",
    "train_loss_step": "loss",           # Lightning, self.log("train_loss", on_step=True, on_epoch=True)
    "training_loss": "loss",
    "train/loss_step": "loss",
    "Loss/train": "loss",                # the PyTorch TensorBoard tutorial's name
    "loss/train": "loss",
    "lm loss": "loss",                   # Megatron-LM
    "Train/Samples/train_loss": "loss",  # DeepSpeed monitor
    "loss_metrics/global_avg_loss": "loss",   # torchtitan
    # grad norm (pre-clip: what HF Trainer, Lightning and Megatron log)
    "grad_norm": "grad_norm",
    "train/grad_norm": "grad_norm",
    "grad-norm": "grad_norm",            # Megatron-LM
    "gradient_norm": "grad_norm",
    "train/gradient_norm": "grad_norm",
    "grad_norm/total": "grad_norm",
    "grad_2.0_norm_total": "grad_norm",  # Lightning's grad_norm(model, norm_type=2) utility
    # learning rate
    "lr": "lr",
    "learning_rate": "lr",
    "train/learning_rate": "lr",
    "train/lr": "lr",
    "learning-rate": "lr",               # Megatron-LM
    "Train/Samples/lr": "lr",            # DeepSpeed monitor
    # loss scale
    "loss_scale": "loss_scale",
    "train/loss_scale": "loss_scale",
    "scaler/scale": "loss_scale",
    "grad_scaler/scale": "loss_scale",
    "amp/loss_scale": "loss_scale",
    "loss-scale": "loss_scale",          # Megatron-LM
    "Train/Samples/loss_scale": "loss_scale",   # DeepSpeed monitor
    # throughput, step time
    "samples_per_second": "samples_per_s",
    "samples_per_sec": "samples_per_s",
    "train/samples_per_sec": "samples_per_s",
    "tokens_per_second": "tokens_per_s",
    "tokens_per_sec": "tokens_per_s",
    "train/tokens_per_sec": "tokens_per_s",
    "step_time": "step_time",
    "train/step_time": "step_time",
}

# Lightning's LearningRateMonitor writes lr-<Optimizer> (lr-Adam, lr-AdamW …), and lr-<Optimizer>/pg<N> for
# several param groups: gradwatch's lr is param group 0's, so only the plain name (or pg1, Lightning's first
# group when there are several) is taken.
DEFAULT_PATTERNS: tuple[tuple[str, str], ...] = (
    ("lr-*/pg1", "lr"),
    ("lr-*", "lr"),
)


def _is_pattern_hit(tag: str, pattern: str) -> bool:
    # "lr-*" must not swallow "lr-Adam/pg2": a pattern without a "/" matches tags without one
    if "/" not in pattern and "/" in tag:
        return False
    return fnmatch.fnmatchcase(tag, pattern)


class MapError(ValueError):
    """A bad ``--map`` argument; the message says what is accepted."""


@dataclass
class TagMap:
    exact: dict[str, Optional[str]] = field(default_factory=lambda: dict(DEFAULT_TAGS))
    patterns: tuple[tuple[str, str], ...] = DEFAULT_PATTERNS
    overrides: set[str] = field(default_factory=set)      # tags named by --map: they win a signal first

    @classmethod
    def build(cls, overrides: list[str] = ()) -> "TagMap":
        """The defaults plus ``TAG=SIGNAL`` overrides; ``TAG=`` drops a tag the defaults would map."""
        from gradwatch.agent.signals import STEP_SIGNAL_NAMES, is_step_signal

        m = cls()
        for item in overrides or ():
            tag, sep, signal = item.partition("=")
            tag, signal = tag.strip(), signal.strip()
            if not sep or not tag:
                raise MapError(f"--map {item!r}: expected TAG=SIGNAL, e.g. --map train/ce=loss "
                               f"(TAG= to leave a tag out)")
            if signal and not is_step_signal(signal):
                raise MapError(f"--map {item!r}: unknown signal {signal!r}; one of {', '.join(STEP_SIGNAL_NAMES)}")
            m.exact[tag] = signal or None
            m.overrides.add(tag)
        return m

    def signal(self, tag: str) -> Optional[str]:
        if tag in self.exact:
            return self.exact[tag]
        for pattern, signal in self.patterns:
            if _is_pattern_hit(tag, pattern):
                return signal
        return None

    def resolve(self, tags: list[str]) -> tuple[dict[str, str], list[str]]:
        """(tag -> signal for the tags taken, tags left out). When several tags map to one signal (a run
        that logs both ``loss`` and ``train/loss``), the first in the defaults' order wins, an override
        before any default, and the others are left out: a step has one value per signal."""
        wanted = {t: self.signal(t) for t in tags}
        order = {t: i for i, t in enumerate(DEFAULT_TAGS)}

        def precedence(tag: str) -> tuple:
            # --map's tags, then the defaults in their order, then pattern matches (alphabetically)
            return (tag not in self.overrides, order.get(tag, len(order)), tag)

        by_signal: dict[str, str] = {}
        for tag in sorted((t for t, s in wanted.items() if s), key=precedence):
            by_signal.setdefault(wanted[tag], tag)
        mapped = {tag: signal for signal, tag in by_signal.items()}
        left = sorted(t for t in tags if t not in mapped)
        return dict(sorted(mapped.items(), key=lambda kv: kv[1])), left

