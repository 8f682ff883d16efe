"""The one plug-in loader (agent/plugins.py) and the collectors it composes.

Collectors, rules and dashboard pages are found and ordered by it (docs/architecture.md, "One way to
register a plug-in"); the rules' and the pages' order is checked in tests/rules/test_rule_order.py and
tests/dashboard/test_dashboard_page_registry.py.
"""
from __future__ import annotations

import importlib
import sys
import textwrap
import uuid

import pytest

from gradwatch.agent import collectors, plugins

# The collectors' order before they declared it: the hand list of the built-ins, then the others by
# module name (a module's classes in their order). It is the order their tensors take in a step
# record, so the wire stays byte-identical only if DEFAULT keeps it.
ORDER_BEFORE_THE_LOADER = ("GradNorms", "LossScale", "LearningRate", "WeightNorms", "ActivationStats",
                           "BatchNormStats", "InputNonfinite", "PeakMemory", "EmaDivergence", "AdamStaleness",
                           "AttentionLogits", "OutputLogits", "GradAbsMax", "ParamsWithoutGrad", "GradZeroFraction",
                           "LinearOutputs", "RngState")


def test_default_collectors_keep_their_order():
    assert tuple(cls.__name__ for cls in collectors.DEFAULT) == ORDER_BEFORE_THE_LOADER


def test_every_collector_declares_its_order():
    # the base's default (after every built-in) is for a new collector; each built-in declares its place
    assert all("order" in vars(cls) for cls in collectors.DEFAULT)
    assert len({cls.order for cls in collectors.DEFAULT}) == len(collectors.DEFAULT)


@pytest.fixture
def probe_name():
    name = f"plugin_probe_{uuid.uuid4().hex[:8]}"
    yield name
    for module in [m for m in sys.modules if m == name or m.startswith(f"{name}.")]:   # leave with the test
        del sys.modules[module]


def _package(tmp_path, monkeypatch, name: str, files: dict[str, str]) -> str:
    root = tmp_path / name
    root.mkdir()
    (root / "__init__.py").write_text("class Base:\n    name = ''\n    order = 1000\n")
    for module, text in files.items():
        (root / f"{module}.py").write_text(textwrap.dedent(text))
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


def test_loader_orders_by_declared_order_then_name(tmp_path, monkeypatch, probe_name):
    pkg = _package(tmp_path, monkeypatch, probe_name, {
        "a_first": """
            from . import Base
            from .b_second import Second        # imported here, defined there: found once

            class Later(Base):
                name, order = "b_tie", 2

            class First(Base):
                name, order = "first", 0
        """,
        "b_second": """
            from . import Base

            class Intermediate(Base):           # no name: a base, not a plug-in
                pass

            class Second(Intermediate):
                name, order = "second", 1

            class Tie(Base):
                name, order = "a_tie", 2

            class Undeclared(Base):             # the base's order
                name = "new"
        """,
        "_helper": "raise RuntimeError('a module named _... is never imported by the loader')\n",
    })
    base = importlib.import_module(pkg).Base
    found = plugins.classes(pkg, base)
    assert [cls.__name__ for cls in found] == ["First", "Second", "Tie", "Later", "Undeclared"]
    assert [m.__name__ for m in plugins.modules(pkg)] == [f"{pkg}.a_first", f"{pkg}.b_second"]
    assert f"{pkg}._helper" not in sys.modules


def test_loader_refuses_a_name_declared_twice(tmp_path, monkeypatch, probe_name):
    pkg = _package(tmp_path, monkeypatch, probe_name, {
        "one": "from . import Base\n\nclass A(Base):\n    name, order = 'same', 1\n",
        "two": "from . import Base\n\nclass B(Base):\n    name, order = 'same', 2\n",
    })
    with pytest.raises(ValueError, match=r"plug-in name 'same' is declared twice: .*one\.A and .*two\.B"):
        plugins.classes(pkg, importlib.import_module(pkg).Base)


def test_loader_is_a_torch_free_leaf():
    # the server and the dashboard load their rules and pages through it (they import only torch-free
    # leaves of the agent): it imports the standard library only
    import ast
    from pathlib import Path

    tree = ast.parse(Path(plugins.__file__).read_text(encoding="utf-8"))
    imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
                for alias in node.names}
    imported |= {node.module.split(".")[0] for node in ast.walk(tree)
                 if isinstance(node, ast.ImportFrom) and node.module}
    assert imported <= set(sys.stdlib_module_names) | {"__future__"}, imported
