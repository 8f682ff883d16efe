"""The collectors: one kind of measurement each, behind the protocol of :mod:`agent.collectors.base`.

:data:`DEFAULT` is the order the monitor composes them in (it is the order their
tensors take in a step record).
"""
from __future__ import annotations

from gradwatch.agent.collectors.activations import ActivationStats
from gradwatch.agent.collectors.base import Collector, Watched
from gradwatch.agent.collectors.batchnorm import BatchNormStats
from gradwatch.agent.collectors.ema import EmaDivergence
from gradwatch.agent.collectors.grads import GradNorms
from gradwatch.agent.collectors.inputs import InputNonfinite
from gradwatch.agent.collectors.loss_scale import LossScale
from gradwatch.agent.collectors.lr import LearningRate
from gradwatch.agent.collectors.memory import PeakMemory
from gradwatch.agent.collectors.weights import WeightNorms

_BUILT_IN: tuple[type[Collector], ...] = (GradNorms, LossScale, LearningRate, WeightNorms, ActivationStats,
                                          BatchNormStats, InputNonfinite, PeakMemory, EmaDivergence)


def _discovered() -> tuple[type[Collector], ...]:
    """Every other collector class defined in a module of this package, in module-name order: a new
    collector is a new file here, with no list to edit (docs/architecture.md, "Adding a signal")."""
    import importlib
    import pkgutil

    found: list[type[Collector]] = []
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        module = importlib.import_module(f"{__name__}.{info.name}")
        for value in vars(module).values():
            if (isinstance(value, type) and issubclass(value, Collector) and value.__module__ == module.__name__
                    and value.name and value not in _BUILT_IN and value not in found):
                found.append(value)
    return tuple(found)


DEFAULT: tuple[type[Collector], ...] = _BUILT_IN + _discovered()

__all__ = ["DEFAULT", "Collector", "Watched", "ActivationStats", "BatchNormStats", "EmaDivergence", "GradNorms",
           "InputNonfinite", "LearningRate", "LossScale", "PeakMemory", "WeightNorms"]
