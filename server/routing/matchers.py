"""Label matchers, written as Alertmanager writes them: ``run=exp-1``, ``rule=~"C.*"``, ``rank!=0``, ``severity!~info``.

Leaf module (the standard library and RE2: the CLI parses matchers before it opens a database). A
regex matches the whole value (anchored, as in Alertmanager). A bad matcher raises ``ValueError``
saying what is wrong.

Regexes are RE2's (the ``google-re2`` binding, part of the ``server`` extra), not Python's ``re``:
a matcher is written by a project token holder (silences) or an operator (routing files), and is
matched on every alert while the ingest that raised it waits. Python's backtracking engine takes
exponential time on ``(a+)+b`` and its relatives, and holds the GIL all the while (the whole server
froze); RE2 matches in time linear in the value, whatever the pattern. What RE2 cannot do in linear
time (backreferences ``\\1``, lookaround ``(?=...)``) it refuses, so such a matcher is refused when it is
written, with RE2's reason. The pattern's length and its compiled size are bounded too
(``MAX_PATTERN_CHARS``, ``MAX_PROGRAM_SIZE``) and label values are names of at most 200 characters,
so one match costs microseconds. docs/deployment.md, "Hostile input", has the figures.

>>> parse_matcher('run=~"(a+)+b"').matches({"run": "a" * 30})
False
>>> parse_matcher(r'run=~"(a)\\1"')
Traceback (most recent call last):
...
ValueError: matcher run=~"(a)\\1": not a regular expression RE2 accepts (matched in linear time): invalid escape sequence: \\1
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache
from typing import Iterable, Mapping

import re2

MATCHER_LABELS = ("project", "run", "rule", "name", "family", "severity", "rank")
_SYNTAX = re.compile(r'^\s*([a-z_]+)\s*(=~|!~|!=|=)\s*(.*?)\s*$', re.S)
# bounds on one matcher: a routing file or a silence names labels, not documents
MAX_PATTERN_CHARS = 1000
MAX_PROGRAM_SIZE = 5000       # RE2's compiled instructions: `a{100}{100}`-style blow-ups stop here


@lru_cache(maxsize=4096)
def compile_regex(pattern: str) -> "re2._Regexp":
    """The RE2 program of one matcher's regex (cached: silences are parsed on every alert they may cover).

    Raises ``ValueError`` naming the rule it breaks.
    """
    if len(pattern) > MAX_PATTERN_CHARS:
        raise ValueError(f"a regular expression of at most {MAX_PATTERN_CHARS} characters, got {len(pattern)}")
    options = re2.Options()
    options.log_errors = False          # RE2 would print every refused pattern on the server's stderr
    options.max_mem = 1 << 20
    try:
        program = re2.compile(pattern, options)
    except re2.error as e:
        reason = e.args[0].decode("utf-8", "replace") if e.args and isinstance(e.args[0], bytes) else str(e)
        raise ValueError(f"not a regular expression RE2 accepts (matched in linear time): {reason}") from None
    if program.programsize > MAX_PROGRAM_SIZE:
        raise ValueError(f"the regular expression compiles to {program.programsize} RE2 instructions, "
                         f"at most {MAX_PROGRAM_SIZE}: write a shorter pattern")
    return program


@dataclass(frozen=True)
class Matcher:
    label: str
    op: str          # = != =~ !~
    value: str

    def __post_init__(self):
        if self.label not in MATCHER_LABELS:
            raise ValueError(f"matcher {self}: unknown label {self.label!r}; labels: {', '.join(MATCHER_LABELS)}")
        if not isinstance(self.value, str):
            raise ValueError(f"matcher {self}: the value must be a string")
        if self.op in ("=~", "!~"):
            try:
                compile_regex(self.value)
            except ValueError as e:
                raise ValueError(f"matcher {self}: {e}") from None
        elif len(self.value) > MAX_PATTERN_CHARS:
            raise ValueError(f"matcher {self.label}{self.op}…: a value of at most {MAX_PATTERN_CHARS} characters")

    def __str__(self) -> str:
        return f'{self.label}{self.op}"{self.value}"'

    def matches(self, labels: Mapping[str, str]) -> bool:
        value = labels.get(self.label, "")
        if self.op == "=":
            return value == self.value
        if self.op == "!=":
            return value != self.value
        hit = compile_regex(self.value).fullmatch(value) is not None
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
