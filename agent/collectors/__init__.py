"""The collectors: one kind of measurement each, behind the protocol of :mod:`agent.collectors.base`.

:data:`DEFAULT` is every collector class defined in a module of this package, in the order the
monitor composes them in: by the ``order`` each declares, then by ``name`` (:mod:`agent.plugins`,
the loader of rules and dashboard pages too). That is the order their tensors take in a step
record. A new collector is a new file here, with no list to edit (docs/architecture.md, "Adding a
signal").
"""
from __future__ import annotations

from gradwatch.agent import plugins
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

DEFAULT: tuple[type[Collector], ...] = plugins.classes(__name__, Collector)

__all__ = ["DEFAULT", "Collector", "Watched", "ActivationStats", "BatchNormStats", "EmaDivergence", "GradNorms",
           "InputNonfinite", "LearningRate", "LossScale", "PeakMemory", "WeightNorms"]
