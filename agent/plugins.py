"""The one plug-in loader: collectors, rules and dashboard pages (docs/architecture.md, "One way to register a plug-in").

A plug-in package has every one of its modules imported, by module name (a module named ``_…`` is a
helper, never imported here); importing a module declares its plug-ins. A plug-in class is a subclass
of the package's base defined in one of those modules, with a ``name``, placed by the ``order`` it
declares, ties by ``name``::

    class MyCollector(Collector):        # agent/collectors/my_signal.py
        name = "my_signal"
        order = 180                      # its tensors' place in a step record

    plugins.classes("gradwatch.agent.collectors", Collector)   # ..., MyCollector, ...

Adding a plug-in is adding a file (or a class to a file): no list names them. A dashboard page is a
module (Dash's ``register_page`` takes the module), so pages use :func:`modules` alone and declare
their ``order`` to ``register_page``; Dash breaks its ties by module name.

A leaf: standard library only, importing nothing of gradwatch, so that the agent, the server and
the dashboard all load their plug-ins through it (the server and the dashboard import only
torch-free leaves of the agent).
"""
from __future__ import annotations

import importlib
import pkgutil
from types import ModuleType
from typing import Any, Iterable, TypeVar

P = TypeVar("P")


def modules(package: str) -> tuple[ModuleType, ...]:
    """Import every module of ``package`` (a dotted name) except those named ``_…``, in module-name
    order, and return them."""
    pkg = importlib.import_module(package)
    return tuple(importlib.import_module(f"{pkg.__name__}.{info.name}")
                 for info in sorted(pkgutil.iter_modules(pkg.__path__), key=lambda i: i.name)
                 if not info.name.startswith("_"))


def place(plugin: Any) -> tuple[Any, str]:
    """A plug-in's sort key: the ``order`` it declares, then its ``name``."""
    return plugin.order, plugin.name


def ordered(plugins: Iterable[P]) -> tuple[P, ...]:
    """``plugins`` by :func:`place`; two with the same ``name`` are refused (one would shadow the other
    wherever plug-ins are looked up by name)."""
    found = sorted(plugins, key=place)
    seen: dict[str, Any] = {}
    for plugin in found:
        other = seen.setdefault(plugin.name, plugin)
        if other is not plugin:
            raise ValueError(f"plug-in name {plugin.name!r} is declared twice: {other.__module__}.{other.__qualname__} "
                             f"and {plugin.__module__}.{plugin.__qualname__}")
    return tuple(found)


def classes(package: str, base: type[P]) -> tuple[type[P], ...]:
    """Every subclass of ``base`` defined in a module of ``package`` (:func:`modules`) that declares a
    ``name`` (a base without one, such as an intermediate class, is not a plug-in), by :func:`place`."""
    found: dict[type[P], None] = {}
    for module in modules(package):
        for value in vars(module).values():
            if (isinstance(value, type) and issubclass(value, base) and value.__module__ == module.__name__
                    and value.name):
                found[value] = None
    return ordered(found)
