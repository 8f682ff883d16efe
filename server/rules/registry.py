"""The rule registry: rule classes register themselves; everything else asks the registry.

    from gradwatch.server.rules.registry import register
    from gradwatch.server.rules.rule import BatchRule

    @register
    class MyRule(BatchRule):
        id, name, family = "E9", "my_rule", "E"   # family: one of spec.FAMILIES, the id's letter
        ...

Every module of the ``server.rules.catalog`` package is imported on first use, so a rule file
dropped into that package is found without being listed anywhere (prometheus client_python's
collectors register themselves the same way). Order: by id.
"""
from __future__ import annotations

import importlib
import pkgutil
import threading
from typing import Optional

from gradwatch.server.rules.rule import KINDS, Rule
from gradwatch.server.rules.spec import FAMILIES, SEVERITIES, RuleSpec

_classes: dict[str, type[Rule]] = {}
_loaded = False
_lock = threading.RLock()


def register(cls: type[Rule]) -> type[Rule]:
    """Class decorator: check the declaration and add the rule to the catalogue."""
    if not cls.id or not cls.name:
        raise TypeError(f"{cls.__name__}: a rule declares an id and a name")
    if cls.kind not in KINDS:
        raise TypeError(f"{cls.__name__}: kind {cls.kind!r} is not one of {', '.join(KINDS)}")
    if cls.family not in FAMILIES or not cls.id.startswith(cls.family):
        raise TypeError(f"{cls.__name__}: family {cls.family!r} is not one of {', '.join(FAMILIES)} or does not "
                        f"begin its id {cls.id!r}")
    if cls.severity not in SEVERITIES:
        raise TypeError(f"{cls.__name__}: severity {cls.severity!r} is not one of {', '.join(SEVERITIES)}")
    if cls.id in _classes and _classes[cls.id] is not cls:
        other = _classes[cls.id]
        if (other.__module__, other.__qualname__) != (cls.__module__, cls.__qualname__):   # not a reload
            raise ValueError(f"rule id {cls.id} is declared twice: {other.__module__} and {cls.__module__}")
    for other in _classes.values():
        if other.name == cls.name and other.id != cls.id:
            raise ValueError(f"rule name {cls.name} is declared twice: {other.id} and {cls.id}")
    cls.spec = cls.make_spec()
    _classes[cls.id] = cls
    return cls


def _load() -> None:
    global _loaded
    if _loaded:
        return
    with _lock:
        if _loaded:
            return
        package = importlib.import_module(".catalog", __package__)
        for info in sorted(pkgutil.iter_modules(package.__path__), key=lambda i: i.name):
            if not info.name.startswith("_"):
                importlib.import_module(f"{package.__name__}.{info.name}")
        _loaded = True


def rule_classes(kind: Optional[str] = None) -> list[type[Rule]]:
    """The registered rule classes (of one kind), ordered by id."""
    _load()
    return [cls for _, cls in sorted(_classes.items()) if kind is None or cls.kind == kind]


def specs() -> tuple[RuleSpec, ...]:
    return tuple(cls.spec for cls in rule_classes())


def get(rule_id: str) -> type[Rule]:
    _load()
    return _classes[rule_id]


def family_of(rule_id: str) -> str:
    """The family ``rule_id``'s rule declares ("" for an id no longer in the catalogue)."""
    _load()
    cls = _classes.get(rule_id)
    return cls.family if cls is not None else ""


def ids_of_family(family: str) -> list[str]:
    """The ids of the registered rules of ``family``, ordered."""
    return [cls.id for cls in rule_classes() if cls.family == family]


def failure_noun(rule_id: str, name: str) -> str:
    """What the failure ``rule_id`` alerts on is called in a sentence: the rule's ``failure_noun``, else
    "the <name with spaces>" (also for an id no longer in the catalogue, whose alert keeps its ``name``)."""
    _load()
    cls = _classes.get(rule_id)
    return (cls.failure_noun if cls is not None else "") or f"the {name.replace('_', ' ')}"
