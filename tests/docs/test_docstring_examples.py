"""Every ``>>>`` example in the package's docstrings runs and prints what it shows.

The public API is documented with examples (README, "How we work"); an example that no longer matches
the code is a wrong document, so each module's examples run here as doctests. Two kinds of module are
not imported: ``__main__`` modules (importing one runs the CLI) and the dashboard's pages (Dash
registers a page only inside a running app) — those must hold no examples, which is checked from
their source instead, so that leaving them out can hide nothing.
"""
from __future__ import annotations

import doctest
import importlib
import importlib.util
import pkgutil
from pathlib import Path

import pytest

import gradwatch

PACKAGES = ("agent", "server", "dashboard")


def _module_names() -> list[str]:
    names = []
    for pkg in PACKAGES:
        base = importlib.import_module(f"gradwatch.{pkg}")
        names += [m.name for m in pkgutil.walk_packages(base.__path__, f"gradwatch.{pkg}.")]
    return sorted(names)


def _not_importable(name: str) -> bool:
    return name.endswith(".__main__") or name.startswith("gradwatch.dashboard.pages")


MODULES = _module_names()


def test_the_walk_finds_the_packages_modules():
    assert len(MODULES) > 100 and "gradwatch.agent.collectors.linear_outputs" in MODULES


@pytest.mark.parametrize("name", [n for n in MODULES if not _not_importable(n)])
def test_docstring_examples(name):
    module = importlib.import_module(name)
    finder = doctest.DocTestFinder(exclude_empty=True)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    for test in finder.find(module, name):
        runner.run(test)
    result = runner.summarize(verbose=False)
    assert result.failed == 0, f"{result.failed} of {result.attempted} docstring examples of {name} failed (printed above)"


@pytest.mark.parametrize("name", [n for n in MODULES if _not_importable(n)])
def test_modules_left_unimported_hold_no_examples(name):
    spec = importlib.util.find_spec(name)
    assert spec is not None and spec.origin
    assert ">>>" not in Path(spec.origin).read_text(encoding="utf-8"), \
        f"{name} is not imported by the doctest run, so its examples would never run: move them to a module that is"
