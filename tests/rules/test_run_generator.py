"""The run generator's declarations check themselves: a fault method that bends no value is refused where it
is declared, every value a channel declares is one it passes, and a scenario naming no declared fault is
refused (a misspelt fault would otherwise give a healthy run, and its rule's test would test nothing)."""
from __future__ import annotations

import pytest

from tests.rules.generator import FAULT_TYPES, Fault, fault, known_values
from tests.rules.runs import wire_run


def test_a_fault_method_that_bends_no_value_is_refused():
    class Misspelt(Fault):
        name = "misspelt_probe"
        random = False

        def los(self, i, loss):          # "loss" misspelt
            return loss * 2

    with pytest.raises(AssertionError, match=r"\['los'\] is no channel's value"):
        fault(Misspelt)
    assert "misspelt_probe" not in FAULT_TYPES


def test_every_declared_value_passes_through_the_faults():
    """A probe fault bending every declared value sees each of them asked for on a short run."""
    values = sorted(known_values())
    asked: set[str] = set()

    def bend(value):
        def method(self, i, *x):
            asked.add(value)
            return x[0] if x else {}     # apply passes the value on; any / planted: nothing said, nothing planted
        return method

    # a run with a GradScaler, an EMA, a peak memory, and (short) layer statistics on its first step
    probe = type("Probe", (Fault,), {"name": "every_value_probe", "random": False,
                                     "needs": ("amp", "ema", "memory", "layers"), **{v: bend(v) for v in values}})
    fault(probe)
    try:
        wire_run("every_value_probe", 0, short=True)
    finally:
        del FAULT_TYPES["every_value_probe"]
    assert asked == set(values)


def test_a_scenario_naming_no_declared_fault_is_refused():
    with pytest.raises(AssertionError, match="no fault declared as"):
        wire_run("nan_los", 0, short=True)

