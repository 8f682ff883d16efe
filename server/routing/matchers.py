"""Label matchers, written as Alertmanager writes them: ``run=exp-1``, ``rule=~"C.*"``, ``rank!=0``, ``severity!~info``.

Leaf module (standard library only: the CLI parses matchers before it opens a database). A regex
matches the whole value (anchored, as in Alertmanager). A bad matcher raises ``ValueError`` saying
what is wrong.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable, Mapping

MATCHER_LABELS = ("project", "run", "rule", "name", "family", "severity", "rank")
_SYNTAX = re.compile(r'^\s*([a-z_]+)\s*(=~|!~|!=|=)\s*(.*?)\s*$', re.S)


@dataclass(frozen=True)
class Matcher:
    label: str
    op: str          # = != =~ !~
    value: str

    def __post_init__(self):
        if self.label not in MATCHER_LABELS:
            raise ValueError(f"matcher {self}: unknown label {self.label!r}; labels: {', '.join(MATCHER_LABELS)}")
        if self.op in ("=~", "!~"):
            try:
                re.compile(self.value)
            except re.error as e:
                raise ValueError(f"matcher {self}: not a valid regular expression: {e}") from None

    def __str__(self) -> str:
        return f'{self.label}{self.op}"{self.value}"'

    def matches(self, labels: Mapping[str, str]) -> bool:
        value = labels.get(self.label, "")
        if self.op == "=":
            return value == self.value
        if self.op == "!=":
            return value != self.value
        hit = re.fullmatch(self.value, value) is not None
        return hit if self.op == "=~" else not hit


def parse_matcher(text: str) -> Matcher:
    """``'rule=~"C[13]"'`` → Matcher("rule", "=~", "C[13]"). Quotes around the value are optional."""
    if not isinstance(text, str):
        raise ValueError(f"matcher: expected a string like 'run=exp-1', got {text!r}")
    m = _SYNTAX.match(text)
    if m is None:
        raise ValueError(f"matcher {text!r}: expected LABEL=VALUE, LABEL!=VALUE, LABEL=~REGEX or LABEL!~REGEX")
    label, op, value = m.groups()
    if len(value) >= 2 and value[0] == value[-1] and value[0] in "\"'":
        value = value[1:-1]
    return Matcher(label, op, value)


def parse_matchers(texts: Iterable[str]) -> tuple[Matcher, ...]:
    if isinstance(texts, str):
        texts = [texts]
    return tuple(parse_matcher(t) for t in texts)


def matches_all(matchers: Iterable[Matcher], labels: Mapping[str, str]) -> bool:
    """Every matcher holds (no matchers: everything matches)."""
    return all(m.matches(labels) for m in matchers)
