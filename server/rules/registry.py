"""The rule registry: the rules of the ``server.rules.catalog`` package; everything else asks the registry.

    from gradwatch.server.rules.registry import register
    from gradwatch.server.rules.rule import BatchRule

    @register
    class MyRule(BatchRule):
        id, name, family = "E9", "my_rule", "E"   # family: one of spec.FAMILIES, the id's letter
        ...

The catalogue is loaded on first use by the plug-in loader that loads the collectors and the
dashboard's pages too (``agent/plugins.py``): every module of the package is imported, so a rule
file dropped into it is found without being listed anywhere, and every ``Rule`` subclass defined
there with a ``name`` is a rule, checked by :func:`register` (which ``@register`` runs at import).
Order: the rule's ``order``, its id unless it declares one (``Rule.order``).
"""
from __future__ import annotations

import threading
from typing import Optional

from gradwatch.agent import plugins
from gradwatch.server.rules.rule import KINDS, Rule
from gradwatch.server.rules.spec import FAMILIES, SEVERITIES, RuleSpec

_classes: dict[str, type[Rule]] = {}
_ordered: tuple[type[Rule], ...] = ()    # _classes' values in the loader's order
_loaded = False
_lock = threading.RLock()


def register(cls: type[Rule]) -> type[Rule]:
    """Class decorator: check the declaration and add the rule to the catalogue."""
    global _ordered
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
    _ordered = plugins.ordered(_classes.values())
    return cls


def _load() -> None:
    global _loaded
    if _loaded:
        return
    with _lock:
        if _loaded:
            return
        for cls in plugins.classes(f"{__package__}.catalog", Rule):
            if _classes.get(cls.id) is not cls:
                register(cls)
        _loaded = True


def rule_classes(kind: Optional[str] = None) -> list[type[Rule]]:
    """The registered rule classes (of one kind), in the loader's order (by id)."""
    _load()
    return [cls for cls in _ordered if kind is None or cls.kind == kind]


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
