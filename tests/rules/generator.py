"""The run generator's machinery: a run is built by *channels* (the healthy signals, each drawing from a
random generator of its own) and bent by *faults* (one small class each), both declared without a list.

- A ``Channel`` (``tests/rules/channels.py``) draws its healthy shape in ``setup``, and writes its values
  into each step: ``scalars`` (every step), ``grads`` (steps with per-parameter gradient statistics),
  ``stats`` (steps with the other layer statistics), ``tail`` (every step, after the layers). The main
  channel draws from the run's own generator; any other from ``"<run key>/<channel name>"``, so that a
  channel added for a new rule leaves every other value of every run as it was.
- A ``Fault`` (``tests/rules/faults.py``) draws its episodes in ``plan`` (from its channel's generator,
  after that channel's ``setup``) and bends the values a channel passes through ``Run.apply``, by defining
  a method of the value's name (``loss``, ``lr``, ``grad_zero_fraction``, ...). Only a run's own faults
  plan and draw, so a fault that no random run picks (``random = False``) moves no other run.

``wire_run`` below is the whole driver: it names no signal and no fault.
"""
from __future__ import annotations

import math
import random
from typing import Any, Callable, Optional

LAYERS = 24        # parameters: grad_norm, weight_norm, update_ratio
MODULES = 10       # act_std, act_mean
BN = 6             # bn_var_norm
PARAM_NAMES = [f"blocks.{i // 4}.{('fc.weight', 'fc.bias', 'norm.weight', 'proj.weight')[i % 4]}"
               for i in range(LAYERS - BN)] + [f"bn{k}.weight" for k in range(BN)]
MODULE_NAMES = [f"blocks.{i}.mlp" for i in range(MODULES)]
BN_NAMES = [f"bn{k}" for k in range(BN)]

CHANNELS: list[type["Channel"]] = []          # in declaration order: the order their values take in a step
FAULT_TYPES: dict[str, type["Fault"]] = {}    # in declaration order: the order faults plan and bend values


def channel(cls):
    """Declares a channel (a class decorator)."""
    assert all(c.name != cls.name for c in CHANNELS), f"channel {cls.name} declared twice"
    CHANNELS.append(cls)
    return cls


# the values the driver itself passes through the faults: the step as recorded, the records as sent
DRIVER_VALUES = ("record", "sent")


def known_values() -> set[str]:
    """The values a fault may bend: the channels' declared values and the driver's."""
    return {v for c in CHANNELS for v in c.values} | set(DRIVER_VALUES)


def fault(cls):
    """Declares a fault (a class decorator). Each of its methods must bend a value some channel (or the driver)
    passes: a misspelt one would bend nothing, silently."""
    assert cls.name not in FAULT_TYPES, f"fault {cls.name} declared twice"
    assert any(c.name == cls.channel for c in CHANNELS), f"fault {cls.name}: no channel {cls.channel}"
    known = known_values()
    methods = {k for klass in cls.__mro__[:cls.__mro__.index(Fault)] for k, v in vars(klass).items()
               if callable(v) and not k.startswith("_")} - {"plan"}
    assert methods <= known, f"fault {cls.name}: {sorted(methods - known)} is no channel's value"
    FAULT_TYPES[cls.name] = cls
    return cls


def random_faults() -> tuple[str, ...]:
    """The faults that "mixed" runs and the short runs' second fault draw from (their order is part of the
    draw: a fault added to it changes those runs, and the golden verdicts with them)."""
    return tuple(name for name, cls in FAULT_TYPES.items() if cls.random)


def segment(rng: random.Random, n: int, lo: int, hi: int, earliest: int = 50) -> tuple[int, int]:
    length = rng.randint(lo, hi)
    start = min(earliest, n // 4)
    a = rng.randint(start, max(start, n - length - 1))
    return a, a + length


class Run:
    """One run being built: its length and options, the shape its channels drew (plain attributes, e.g.
    ``run.amp``, ``run.clip``, ``run.stats_every``), its faults, and ``apply``."""

    def __init__(self, n: int, first: int, short: bool, calm: int, faults: list["Fault"]):
        self.n, self.first, self.short, self.calm = n, first, short, calm
        self.faults = faults
        self.layers_every = self.stats_every = 0
        self._bends: dict[str, list[Callable]] = {}

    @property
    def earliest(self) -> int:
        """The first step a fault's episode may start at."""
        return self.calm if self.short else 50

    def needs(self, what: str) -> bool:
        return any(what in f.needs for f in self.faults)

    def refuses(self, what: str) -> bool:
        return any(what in f.refuses for f in self.faults)

    def bends(self, value: str) -> list[Callable]:
        """The run's faults' methods that bend ``value``, in declaration order (looked up on the class: a
        method, never an attribute a plan set), once per run: a step asks for them some 25 times."""
        found = self._bends.get(value)
        if found is None:
            assert value in known_values(), f"{value}: no channel declares it (Channel.values)"
            found = self._bends[value] = [getattr(f, value) for f in self.faults if hasattr(type(f), value)]
        return found

    def apply(self, value: str, i: int, x: Any = None) -> Any:
        """``x`` through the run's faults that bend ``value``."""
        for bend in self.bends(value):
            x = bend(i, x)
        return x

    def any(self, value: str, i: int) -> bool:
        """Whether one of the run's faults says so at step ``i`` (``overflow``, ``nan``)."""
        return any(bend(i) for bend in self.bends(value))

    def planted(self, value: str, i: int) -> dict[int, float]:
        """Per-element values the faults plant at step ``i`` ({index: value}), in place of the healthy draw."""
        out: dict[int, float] = {}
        for bend in self.bends(value):
            out.update(bend(i))
        return out


class Channel:
    name = ""
    values: tuple[str, ...] = ()     # the values it passes through the faults (what a fault may bend)

    def __init__(self, run: Run, rng: random.Random):
        self.run, self.rng = run, rng

    def setup(self) -> None:
        """Draws the healthy shape (before the channel's faults plan)."""

    def ready(self) -> None:
        """Draws what comes after the faults' plans."""

    def scalars(self, i: int, st: dict) -> None: ...

    def grads(self, i: int, st: dict, layers: dict) -> None: ...

    def stats(self, i: int, st: dict, layers: dict) -> None: ...

    def tail(self, i: int, st: dict) -> None: ...


class Fault:
    name = ""
    channel = "main"       # whose generator its plan and its bends draw from
    random = True          # among the faults "mixed" and the short runs draw from
    needs: tuple[str, ...] = ()      # what the run must have (e.g. "amp": a GradScaler, "layers", "ema")
    refuses: tuple[str, ...] = ()    # what it must not have (refusing wins over needing)
    shape: dict[str, Any] = {}       # the run's shape set to these values (e.g. the LR schedule)

    def __init__(self, run: Run, ch: Channel):
        self.run, self.ch, self.rng = run, ch, ch.rng
        self.seg: tuple[int, int] = (0, 0)

    def plan(self) -> None:
        """Draws the fault's episodes (``self.seg`` for one stretch of steps)."""

    def segment(self, lo: int, hi: int) -> tuple[int, int]:
        return segment(self.rng, self.run.n, lo, hi, earliest=self.run.earliest)

    def inside(self, i: int, seg: Optional[tuple[int, int]] = None) -> bool:
        a, b = seg or self.seg
        return a <= i < b


def wire_run(scenario: str, seed: int, short: bool = False, calm: int = 3) -> list[dict]:
    """A run's steps in wire format: a healthy run of a random shape, with ``scenario``'s faults
    ("healthy": none; "mixed": four random ones; "a+b+c": those). ``short``: 80 steps from step 0, often
    a scaler calibrating at the start, layer statistics on every step, and the faults from step ``calm``."""
    key = f"{scenario}/{seed}/{short}/{calm}"
    rng = random.Random(key)
    n = 80 if short else rng.choice([600, 900, 1200])
    first = 0 if short else rng.choice([0, 0, 0, 5000])
    names = set(rng.sample(random_faults(), 4)) if scenario == "mixed" else set(scenario.split("+")) - {"healthy"}
    unknown = names - set(FAULT_TYPES)
    assert not unknown, f"no fault declared as {sorted(unknown)}"
    run = Run(n, first, short, calm, [])
    channels = [cls(run, rng if cls.name == "main" else random.Random(f"{key}/{cls.name}")) for cls in CHANNELS]
    by_name = {ch.name: ch for ch in channels}
    run.faults = [cls(run, by_name[cls.channel]) for name, cls in FAULT_TYPES.items() if name in names]
    for ch in channels:
        ch.setup()
        for f in run.faults:
            if f.channel == ch.name:
                for k, v in f.shape.items():
                    setattr(run, k, v)
                f.plan()
        ch.ready()

    out = []
    for i in range(n):
        st: dict[str, Any] = {}
        for ch in channels:
            ch.scalars(i, st)
        layers: dict[str, list] = {}
        if run.layers_every and i % run.layers_every == 0:
            for ch in channels:
                ch.grads(i, st, layers)
        if run.stats_every and i % run.stats_every == 0:
            for ch in channels:
                ch.stats(i, st, layers)
        for ch in channels:
            ch.tail(i, st)
        st["layers"] = layers
        run.apply("record", i, st)
        out.extend(run.apply("sent", i, [{k: _wire(v) for k, v in st.items()}]))
    return out


def _wire(v):
    if isinstance(v, float) and not math.isfinite(v):
        return "NaN" if v != v else ("Infinity" if v > 0 else "-Infinity")
    if isinstance(v, dict):
        return {k: [_wire(x) for x in xs] for k, xs in v.items()}
    return v
