"""The faults planted in the generated runs: one class each (see ``tests/rules/generator.py``). A method named
after a value bends it: ``curve`` / ``loss`` (the curve's shape, then events on top of it), ``grad_level`` /
``grad_norm``, ``overflow`` / ``overflow_counted`` / ``nan`` (whether step i is one), ``lr``,
``input_nonfinite``, ``clipped``, ``ema``, ``layer_grad_norm``, per-element plants (``weight_drift``,
``update_factor``, ``act_factor``, ``bn_shift``: {index: value}), the other channels' arrays by their wire
names, and ``record`` / ``sent`` (the step as sent).

A new rule's fault is a class here (after the others: a fault plans, and bends a value, in declaration
order), ``random = False`` unless it should join the random runs (which moves every rule's golden digest),
on the channel whose generator it draws from. Its rule's row in ``tests/rules/runs.py`` names it."""
from __future__ import annotations

import math

from tests.rules.generator import LAYERS, MODULES, Fault, fault, segment

# ----------------------------------------------------------------- the main channel (the run's generator)


@fault
class NanLoss(Fault):
    name = "nan_loss"

    def plan(self):
        self.steps = {self.rng.randrange(self.run.n) for _ in range(self.rng.randint(1, 4))}

    def nan(self, i):
        return i in self.steps


@fault
class NanTail(Fault):
    name = "nan_tail"

    def plan(self):
        self.seg = (self.rng.randrange(self.run.n // 3, self.run.n), self.run.n)

    def nan(self, i):
        return self.inside(i)


@fault
class GnSpike(Fault):
    name = "gn_spike"

    def plan(self):
        rng = self.rng
        # some far above the 10x limit, some right at it
        self.spikes = {rng.randrange(self.run.n): rng.choice([rng.uniform(9.0, 11.0), rng.uniform(11, 200)])
                       for _ in range(rng.randint(2, 8))}

    def grad_norm(self, i, gn):
        return gn * self.spikes.get(i, 1.0)


@fault
class GnDecline(Fault):
    name = "gn_decline"

    def plan(self):
        self.seg = self.segment(150, 400)

    def grad_level(self, i, level):
        a, b = self.seg
        if a <= i < b:
            return self.run.gn0 * 1e-3 ** ((i - a) / (b - a))
        if i >= b:
            return self.run.gn0 * 1e-3 * (1 if i % 97 else 30)
        return level


@fault
class GnNonfiniteNoScaler(GnSpike):
    name = "gn_nonfinite_no_scaler"
    refuses = ("amp",)

    def plan(self):
        self.spikes = {self.rng.randrange(self.run.n): math.inf for _ in range(self.rng.randint(1, 3))}
        for f in self.run.faults:     # with gn_spike: the non-finite spikes replace its finite ones
            if type(f) is GnSpike:
                f.spikes = {}


@fault
class OverflowStorm(Fault):
    name = "overflow_storm"
    needs = ("amp",)

    def plan(self):
        self.seg = self.segment(3, 40)

    def overflow(self, i):
        return self.inside(i)

    overflow_counted = overflow


@fault
class Vanish(Fault):
    name = "vanish"

    def plan(self):
        self.seg = self.segment(5, 60)

    def grad_norm(self, i, gn):
        return 1e-9 if self.inside(i) else gn


@fault
class Plateau(Fault):
    """The loss does not decrease: no decay and no floor (noise about its start)."""
    name = "plateau"
    shape = {"decay_p": 0.0, "floor": 0.0}


@fault
class ScaleCollapse(Fault):
    """The scale halves again and again and never grows back (and overflows nowhere else)."""
    name = "scale_collapse"
    needs = ("amp", "held_scale")

    def plan(self):
        a, b = self.segment(10, 400)
        self.halve_at = set(range(a, b, self.rng.choice([1, 3, 20, 150])))

    def overflow(self, i):
        return i in self.halve_at


@fault
class LrZero(Fault):
    name = "lr_zero"

    def plan(self):
        self.seg = self.segment(1, 40)

    def lr(self, i, lr):
        return 0.0 if self.inside(i) else lr


@fault
class LrJump(Fault):
    """The LR x10 over a stretch: a jump up, then back down. H10's own runs only."""
    name = "lr_jump"
    random = False

    def plan(self):
        self.seg = self.segment(1, 40)

    def lr(self, i, lr):
        return lr * 10.0 if self.inside(i) else lr


@fault
class Dead(Fault):
    """A few episodes of parameters without gradients (0.0, or null: no .grad), some long enough to fire."""
    name = "dead"
    needs = ("layers",)

    def plan(self):
        rng = self.rng
        self.episodes = [(*self.segment(5, 150), rng.sample(range(LAYERS), rng.randint(1, 4)), rng.random() < 0.5)
                         for _ in range(rng.randint(2, 5))]
        self.forever = rng.sample(range(LAYERS), 1) if rng.random() < 0.3 else []

    def layer_grad_norm(self, i, values):
        for k in self.forever:
            values[k] = None
        for a, b, layers_off, as_null in self.episodes:
            if a <= i < b:
                for k in layers_off:
                    values[k] = None if as_null else 0.0
        return values


@fault
class Oscillate(Fault):
    name = "oscillate"

    def plan(self):
        self.seg = self.segment(100, 600)

    def curve(self, i, loss):
        return loss * (1.0 + 0.8 * (-1) ** i) if self.inside(i) else loss


@fault
class ClipSaturation(Fault):
    name = "clip_saturation"

    def plan(self):
        rng = self.rng
        self.bursts = [self.segment(*rng.choice([(3, 30), (30, 400)])) for _ in range(rng.randint(1, 4))]
        self.run.clip = self.run.clip or 1.0

    def clipped(self, i, clipped):
        return self.rng.random() < 0.7 if any(a <= i < b for a, b in self.bursts) else clipped


@fault
class LossSpike(Fault):
    name = "loss_spike"

    def plan(self):
        rng = self.rng
        self.spikes = {}
        for _ in range(rng.randint(1, 5)):
            s = rng.randrange(self.run.n)
            for k in range(rng.choice([1, 1, 2, 6])):
                # some just above a spike limit (a few % over a quiet loss), some far above it
                self.spikes[s + k] = rng.choice([rng.uniform(1.03, 1.12), rng.uniform(1.05, 1.5), rng.uniform(2, 50)])

    def loss(self, i, loss):
        return loss * self.spikes.get(i, 1.0)


@fault
class LateDivergence(Fault):
    name = "late_divergence"
    shape = {"schedule": "cosine_to_zero"}

    def plan(self):
        self.seg = (self.rng.randrange(self.run.n // 2, 3 * self.run.n // 4), self.run.n)

    def curve(self, i, loss):
        return loss * (1.0 + 0.002 * (i - self.seg[0])) if self.inside(i) else loss


@fault
class Ema(Fault):
    name = "ema"
    needs = ("ema",)

    def plan(self):
        self.seg = self.segment(60, 200)
        self.spikes = {self.rng.randrange(self.run.n) for _ in range(self.rng.randint(1, 4))}

    def ema(self, i, ema):
        if self.inside(i):
            ema = self.run.ema0 * (0.05 if i % 2 else 2.2)
        if i in self.spikes:
            ema *= self.rng.choice([2.5, 3.5, 20.0])
        return ema


@fault
class LayerFaults(Fault):
    """BatchNorm variance drift, an activation jump, weight growth, high update ratios; dense statistics."""
    name = "layer_faults"

    def plan(self):
        self.bn_drift = self.segment(10, 300)
        self.act_jump = self.segment(1, 200)
        self.weight_growth = self.segment(300, 800)
        self.update_high = self.segment(150, 400)
        self.run.stats_every = self.rng.choice([1, 10])

    def weight_drift(self, i):
        return {k: 1.02 for k in range(0, LAYERS, 3)} if self.inside(i, self.weight_growth) else {}

    def update_factor(self, i):
        return {k: 30 for k in range(LAYERS)} if self.inside(i, self.update_high) else {}

    def act_factor(self, i):
        return {3: 15} if self.inside(i, self.act_jump) else {}

    def bn_shift(self, i):
        a = self.bn_drift[0]
        return {k: 20 * (i - a) / 300 for k in range(2)} if self.inside(i, self.bn_drift) else {}


@fault
class BadInputs(Fault):
    name = "bad_inputs"

    def input_nonfinite(self, i, value):
        if (self.run.first + i) % 10 == 0 or i % 3 == 0:
            return 3 if self.rng.random() < 0.05 else 0
        return value


@fault
class Gaps(Fault):
    """Missing and non-finite values, a NaN LR while the LR (and its peak) still grows, a step sent twice."""
    name = "gaps"
    shape = {"warmup": 300}

    def record(self, i, st):
        rng, rate = self.rng, self.run.gap_rate
        for key in ("loss", "grad_norm", "lr", "loss_scale", "overflow", "clipped", "ema_divergence"):
            if rng.random() < rate:
                st[key] = None
        if rng.random() < rate / 2:
            st["loss"] = math.nan
        if rng.random() < rate / 2:
            st["lr"] = math.nan
        if rng.random() < rate / 2:
            st["loss_scale"] = math.inf
        if rng.random() < rate / 4:
            st["overflow"] = True            # a skipped step whose grad norm is finite
        return st

    def sent(self, i, records):
        # the same step twice in a row, as a resend can deliver it
        return records + [dict(records[-1])] if self.rng.random() < 0.01 else records


# ----------------------------------------------------------------- the other channels (generators of their own)


@fault
class GradUnderflow(Fault):
    """B6: a few parameters' zero share jumps (fp16 underflow)."""
    name = "grad_underflow"
    channel = "zeros"
    random = False

    def plan(self):
        rng, run = self.rng, self.run
        length = rng.randint(10, 300)
        a = rng.randint(min(run.earliest, run.n // 4), max(run.calm, run.n - length - 1))
        self.seg = (a, a + length)
        self.layers = [k for k in range(LAYERS) if self.ch.levels[k] < 0.1][: rng.randint(1, 6)]

    def grad_zero_fraction(self, i, zeros):
        if self.inside(i):
            for k in self.layers:
                zeros[k] = self.rng.choice([self.rng.uniform(0.45, 0.55), self.rng.uniform(0.8, 1.0)])
        return zeros


@fault
class AdamStale(Fault):
    """H1: Adam's g² / v̂ past its ratio on one to three parameters."""
    name = "adam_stale"
    channel = "early"
    random = False

    def plan(self):
        rng = self.rng
        # some just around the default ratio of 100, some far past it
        self.stale = {rng.randrange(self.run.n): (rng.sample(range(LAYERS), rng.randint(1, 3)),
                                                  rng.choice([rng.uniform(60, 160), rng.uniform(1e3, 1e6)]))
                      for _ in range(rng.randint(1, 5))}

    def adam_g2_over_v(self, i, ratios):
        for k in self.stale.get(i, ((), 1.0))[0]:
            ratios[k] *= self.stale[i][1]
        return ratios


@fault
class LinearGrowth(Fault):
    """H4: one to three Linear layers' output RMS growing geometrically."""
    name = "linear_growth"
    channel = "early"
    random = False

    def plan(self):
        self.seg = self.segment(40, 300)
        self.growing = self.rng.sample(range(MODULES), self.rng.randint(1, 3))
        self.rate = self.rng.choice([1.01, 1.03, 1.08])

    def linear_out_rms(self, i, rms):
        if self.inside(i):
            for k in self.growing:
                rms[k] *= self.rate ** (i - self.seg[0])
        return rms


@fault
class AttnGrowth(Fault):
    """H2 / H12 / H13: one or two modules' attention logits growing geometrically."""
    name = "attn_growth"
    channel = "logits"
    random = False

    def plan(self):
        self.seg = self.segment(40, 300)
        self.growing = self.rng.sample(range(MODULES), self.rng.randint(1, 2))
        self.rate = self.rng.choice([1.02, 1.05, 1.15])

    def attn_logit_max(self, i, logits):
        if self.inside(i):
            for k in self.growing:
                logits[k] *= self.rate ** (i - self.seg[0])
        return logits


@fault
class RouterGrowth(Fault):
    """H14: one router's logit spread growing geometrically."""
    name = "router_growth"
    channel = "router"
    random = False

    def plan(self):
        self.seg = self.segment(40, 300)
        self.growing = self.rng.choice(self.ch.routers)
        self.rate = self.rng.choice([1.02, 1.05, 1.15])

    def router_logit_spread(self, i, spread):
        if self.inside(i) and spread[self.growing] is not None:
            spread[self.growing] *= self.rate ** (i - self.seg[0])
        return spread


@fault
class LogzDrift(Fault):
    """H3: the output's log Z drifting linearly."""
    name = "logz_drift"
    channel = "logits"
    random = False

    def plan(self):
        self.seg = self.segment(40, 300)
        self.rate = self.rng.choice([-1.0, 0.3, 2.0])

    def output_log_z(self, i, z):
        return z + self.rate * (i - self.seg[0]) if self.inside(i) else z


@fault
class MemLeak(Fault):
    """D4: the peak device memory rising over a stretch, then staying up."""
    name = "mem_leak"
    channel = "memory"
    random = False
    needs = ("memory",)

    def plan(self):
        run = self.run
        self.seg = segment(self.rng, run.n, 30 if run.short else 200, 70 if run.short else run.n - 60,
                           earliest=run.earliest)
        self.rate = self.rng.choice([2e-4, 1e-3, 5e-3])      # per step: +10 %, +50 %, +250 % over 500 steps

    def mem_peak(self, i, held):
        a, b = self.seg
        return held * (1 + self.rate * (min(i, b) - a)) if i >= a else held
