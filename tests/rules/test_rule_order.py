"""The rules' place, declared on the rule (``Rule.order``: its id unless it declares one), through the one
plug-in loader (agent/plugins.py) that finds every rule of server/rules/catalog/."""
from __future__ import annotations

import importlib
import pkgutil

from gradwatch.server.rules import registry
from gradwatch.server.rules.rule import Rule


def test_rules_are_in_id_order_and_each_place_is_its_id():
    classes = registry.rule_classes()
    assert [cls.order for cls in classes] == [cls.id for cls in classes]
    assert [cls.id for cls in classes] == sorted(cls.id for cls in classes)
    assert [c.id for c in registry.rule_classes("timer")] == [c.id for c in classes if c.kind == "timer"]


def test_every_rule_class_of_the_catalogue_is_registered():
    # found by walking the package here, independently of the loader: each named Rule subclass defined in
    # a catalogue module (not a _helper) is in the registry, and nothing else is
    package = importlib.import_module("gradwatch.server.rules.catalog")
    defined = set()
    for info in pkgutil.iter_modules(package.__path__):
        if info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{package.__name__}.{info.name}")
        defined |= {v for v in vars(module).values()
                    if isinstance(v, type) and issubclass(v, Rule) and v.__module__ == module.__name__ and v.name}
    assert defined == set(registry.rule_classes())
    assert len(defined) >= 44
