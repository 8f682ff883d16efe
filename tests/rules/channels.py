"""The healthy run, channel by channel (see ``tests/rules/generator.py``). Each value a fault may bend goes
through ``run.apply("<value>", i, x)`` (or ``run.any`` / ``run.planted``); the faults are in
``tests/rules/faults.py``. A new rule whose signal no channel writes adds a channel here, with a generator
of its own, so that no other run (and no other rule's golden verdicts) moves."""
from __future__ import annotations

import math

from tests.rules.generator import BN, LAYERS, MODULES, Channel, channel


@channel
class Main(Channel):
    """Loss, grad norm, the GradScaler, LR, clipping, EMA, inputs, and the classic layer statistics: the
    run's own generator (the draws' order is the runs' identity: keep it)."""
    name = "main"
    values = ("curve", "loss", "grad_level", "grad_norm", "overflow", "overflow_counted", "nan", "lr",
              "input_nonfinite", "clipped", "ema", "layer_grad_norm", "weight_drift", "update_factor",
              "act_factor", "bn_shift")

    def setup(self) -> None:
        run, rng = self.run, self.rng
        run.loss0, run.floor = rng.uniform(0.5, 5.0), rng.choice([0.0, 0.1, 1.0])
        run.decay_t, run.decay_p = rng.uniform(100, 3000), rng.uniform(0.05, 0.7)
        run.noise = rng.choice([0.002, 0.002, 0.01, 0.03] if run.short else [0.002, 0.01, 0.03, 0.1])
        run.gn0 = rng.choice([0.05, 0.5, 3.0])
        run.clip = rng.choice([None, 1.0, run.gn0 * 1.05])
        run.amp = (rng.random() < 0.7 or run.needs("amp")) and not run.refuses("amp")
        self.growth_interval = rng.choice([100, 300, 2000])
        self.overflow_rate = rng.choice([0.0005, 0.002, 0.01])
        # GradScaler's start: halving from too high an init scale
        self.calibration = rng.choice([0, 6] if run.short else [0, 0, 6])
        self.reports_overflow = rng.random() < 0.85
        run.peak_lr = rng.choice([1e-3, 3e-4])
        run.warmup = rng.choice([0, 0, 50, 300])
        run.schedule = rng.choice(["const", "cosine", "cosine_to_zero", "step"])
        self.has_ema = rng.random() < 0.6 or run.needs("ema")
        run.ema0 = rng.choice([1e-3, 0.2])
        run.layers_every = rng.choice([1, 1, 3]) if rng.random() < 0.9 or run.needs("layers") else 0
        run.stats_every = rng.choice([1, 10, 50, 100])
        if run.short:
            run.layers_every, run.stats_every = 1, rng.choice([1, 3])
        self.levels = {"grad_norm": [run.gn0 * rng.uniform(0.1, 2.0) for _ in range(LAYERS)],
                       "weight_norm": [rng.uniform(1, 50) for _ in range(LAYERS)],
                       "update_ratio": [rng.uniform(3e-4, 3e-3) for _ in range(LAYERS)],
                       "act_std": [rng.uniform(0.5, 2.0) for _ in range(MODULES)],
                       "act_mean": [rng.uniform(-0.5, 0.5) for _ in range(MODULES)],
                       "bn_var_norm": [rng.uniform(1, 10) for _ in range(BN)]}

    def ready(self) -> None:
        # drawn after the faults' plans, where they were first added (so that the runs stayed as they were)
        self.run.gap_rate = self.rng.choice([0.02, 0.08, 0.2])
        self.scale = 65536.0 * (32 if self.calibration else self.rng.choice([1, 32]))
        self.good_since = 0
        self.weight_scale = [1.0] * LAYERS
        self.held = self.run.needs("held_scale")      # the scale moves only where a fault says

    def scalars(self, i: int, st: dict) -> None:
        run, rng = self.run, self.rng
        s = run.first + i
        g = rng.gauss(0, 1)
        loss = run.loss0 * (1 + i / run.decay_t) ** -run.decay_p * (1 + run.noise * g) + run.floor
        loss = run.apply("loss", i, run.apply("curve", i, loss))
        gn = run.apply("grad_level", i, run.gn0) * (1 + 0.1 * abs(rng.gauss(0, 1)))
        gn = run.apply("grad_norm", i, gn)
        overflow = None
        if run.amp:
            held = self.held
            overflow = (run.any("overflow", i) or i < self.calibration
                        or (rng.random() < self.overflow_rate and not held))
            if overflow:
                self.scale /= 2
                self.good_since = 0
                gn = math.inf
            else:
                self.good_since += 1
                if self.good_since >= self.growth_interval and not held:
                    self.scale *= 2
                    self.good_since = 0
        if run.any("nan", i):
            loss, gn = rng.choice([math.nan, math.inf]), math.nan
            if run.amp:
                overflow = True
        self.gn = gn
        st.update({"step": s, "time": 1.7e9 + s * 0.05, "loss": loss, "grad_norm": gn,
                   "clip_max_norm": run.clip, "clipped": None if run.clip is None else bool(gn > run.clip),
                   "loss_scale": self.scale if run.amp else None,
                   "overflow": overflow if self.reports_overflow else None,
                   "overflow_count": int(run.any("overflow_counted", i)) if run.amp else None,
                   "lr": run.apply("lr", i, self.lr(i)),
                   "input_nonfinite": 0 if s % 10 == 0 else None})
        st["input_nonfinite"] = run.apply("input_nonfinite", i, st["input_nonfinite"])
        st["clipped"] = run.apply("clipped", i, st["clipped"])
        if self.has_ema:
            st["ema_divergence"] = abs(run.apply("ema", i, run.ema0 * (1 + 0.2 * rng.gauss(0, 1))))

    def lr(self, i: int) -> float:
        run = self.run
        if run.schedule == "const":
            lr = run.peak_lr
        elif run.schedule == "step":
            lr = run.peak_lr * 0.1 ** (i * 3 // run.n)
        else:
            end = 0.0 if run.schedule == "cosine_to_zero" else 0.05 * run.peak_lr
            lr = end + (run.peak_lr - end) * 0.5 * (1 + math.cos(math.pi * i / run.n))
        if run.warmup and i < run.warmup:
            lr = run.peak_lr * (i + 1) / run.warmup
        return lr

    def grads(self, i: int, st: dict, layers: dict) -> None:
        rng, gn, gn0 = self.rng, self.gn, self.run.gn0
        values: list = [v * (1 + 0.05 * rng.gauss(0, 1)) * gn / max(gn0, 1e-30) if math.isfinite(gn) else gn
                        for v in self.levels["grad_norm"]]
        if rng.random() < 0.01:
            values[rng.randrange(LAYERS)] = math.nan
        layers["grad_norm"] = self.run.apply("layer_grad_norm", i, values)

    def stats(self, i: int, st: dict, layers: dict) -> None:
        run, rng, lv = self.run, self.rng, self.levels
        drift = run.planted("weight_drift", i)          # a planted drift replaces the healthy draw
        for k in range(LAYERS):
            self.weight_scale[k] *= drift[k] if k in drift else 1.0 + 0.001 * rng.gauss(0, 1)
        layers["weight_norm"] = [v * w for v, w in zip(lv["weight_norm"], self.weight_scale)]
        if rng.random() < 0.1:             # a parameter not measured at this sample, or at 0
            layers["weight_norm"][rng.randrange(LAYERS)] = rng.choice([None, 0.0])
        up = run.planted("update_factor", i)
        layers["update_ratio"] = [v * up.get(k, 1) * (1 + 0.1 * rng.gauss(0, 1))
                                  for k, v in enumerate(lv["update_ratio"])]
        act = run.planted("act_factor", i)
        layers["act_std"] = [v * act.get(k, 1) * (1 + 0.05 * rng.gauss(0, 1)) for k, v in enumerate(lv["act_std"])]
        layers["act_mean"] = [v + 0.01 * rng.gauss(0, 1) for v in lv["act_mean"]]
        bn = run.planted("bn_shift", i)
        layers["bn_var_norm"] = [v * (1 + (bn[k] if k in bn else 0.02 * rng.gauss(0, 1)))
                                 for k, v in enumerate(lv["bn_var_norm"])]
        if rng.random() < 0.05:
            layers["act_std"][rng.randrange(MODULES)] = None


@channel
class Zeros(Channel):
    """B6: the share of exact-zero gradient entries per parameter."""
    name = "zeros"
    values = ("grad_zero_fraction",)

    def setup(self) -> None:
        rng = self.rng
        self.levels = [rng.choice([0.0, 0.0, rng.uniform(0, 0.04), rng.uniform(0.2, 0.6)]) for _ in range(LAYERS)]

    def stats(self, i: int, st: dict, layers: dict) -> None:
        rng = self.rng
        zeros = [min(1.0, max(0.0, z + 0.02 * rng.gauss(0, 1))) if z else 0.0 for z in self.levels]
        zeros = self.run.apply("grad_zero_fraction", i, zeros)
        if rng.random() < 0.05:
            zeros[rng.randrange(LAYERS)] = rng.choice([None, math.nan])
        layers["grad_zero_fraction"] = zeros


@channel
class Early(Channel):
    """The early-warning arrays: H1 Adam g² / v̂ per parameter, H4 Linear output RMS per module."""
    name = "early"
    values = ("adam_g2_over_v", "linear_out_rms")

    def setup(self) -> None:
        rng = self.rng
        self.adam_levels = [rng.uniform(0.3, 2.0) for _ in range(LAYERS)]
        self.rms_levels = [rng.uniform(0.2, 3.0) for _ in range(MODULES)]

    def grads(self, i: int, st: dict, layers: dict) -> None:
        finite = math.isfinite(st["grad_norm"])
        ratios: list = [v * math.exp(0.4 * self.rng.gauss(0, 1)) if finite else math.nan for v in self.adam_levels]
        ratios = self.run.apply("adam_g2_over_v", i, ratios)
        for k, g in enumerate(layers["grad_norm"]):
            if g is None:
                ratios[k] = None             # no grad, no Adam update: not measured
        layers["adam_g2_over_v"] = ratios

    def stats(self, i: int, st: dict, layers: dict) -> None:
        rng = self.rng
        rms = self.run.apply("linear_out_rms", i, [v * (1 + 0.03 * rng.gauss(0, 1)) for v in self.rms_levels])
        if rng.random() < 0.05:
            rms[rng.randrange(MODULES)] = rng.choice([None, math.nan])
        layers["linear_out_rms"] = rms


@channel
class Logits(Channel):
    """H2 / H12 attention logits per module, H3 the output's log Z."""
    name = "logits"
    values = ("attn_logit_max", "output_log_z")

    def setup(self) -> None:
        rng = self.rng
        self.levels = [rng.uniform(3.0, 30.0) for _ in range(MODULES)]
        self.log_z0 = rng.uniform(-3.0, 8.0)

    def stats(self, i: int, st: dict, layers: dict) -> None:
        rng = self.rng
        logits = self.run.apply("attn_logit_max", i, [v * (1 + 0.05 * rng.gauss(0, 1)) for v in self.levels])
        if rng.random() < 0.05:
            logits[rng.randrange(MODULES)] = rng.choice([None, math.nan])
        layers["attn_logit_max"] = logits
        z = self.run.apply("output_log_z", i, self.log_z0 + 0.3 * rng.gauss(0, 1))
        st["output_log_z"] = z if rng.random() > 0.03 else rng.choice([None, math.nan])


@channel
class Router(Channel):
    """H14: a mixture of experts' router logit spread, on two of the modules (the others have no router)."""
    name = "router"
    values = ("router_logit_spread",)

    def setup(self) -> None:
        rng = self.rng
        self.routers = rng.sample(range(MODULES), 2)
        self.levels = [rng.uniform(2.0, 20.0) for _ in self.routers]

    def stats(self, i: int, st: dict, layers: dict) -> None:
        rng = self.rng
        spread: list = [None] * MODULES
        for k, v in zip(self.routers, self.levels):
            spread[k] = v * (1 + 0.05 * rng.gauss(0, 1))
        spread = self.run.apply("router_logit_spread", i, spread)
        if rng.random() < 0.05:
            spread[rng.choice(self.routers)] = rng.choice([None, math.nan])
        layers["router_logit_spread"] = spread


@channel
class Memory(Channel):
    """D4: the peak device memory (a CPU run has none)."""
    name = "memory"
    values = ("mem_peak",)

    def setup(self) -> None:
        rng = self.rng
        self.base = rng.choice([2e9, 3e10] if self.run.needs("memory") else [None, 2e9, 3e10])
        self.jitter = rng.choice([0.02, 0.15, 0.4])          # the peak moves with each batch's shapes

    def tail(self, i: int, st: dict) -> None:
        if self.base is None:
            return
        rng = self.rng
        held = self.run.apply("mem_peak", i, self.base * (0.6 if i < 2 else 1.0))  # 0.6: before the optimizer's state
        st["mem_peak"] = held * (1 + self.jitter * rng.random()) if rng.random() > 0.02 else None
