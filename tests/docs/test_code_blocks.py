"""Every fenced code block in README.md and docs/*.md is checked, or marked as a fragment.

A block's info string says what it is: ``python``, ``bash``, ``json``, ``toml``, ``yaml``, ``ini`` or
``text`` (output, diagrams, tables of figures). A block with no info string fails. A second word
``fragment`` (```python fragment```) marks a block that is deliberately partial (placeholders such as
``...``, a training framework, a GPU or a running server): it is counted, not checked (a ``python
fragment`` must still parse). GitHub
highlights on the first word only, so the marking does not change how a page looks.

What is checked (see docs/testing.md, "Docs that run"):

* ``python``: parses; then runs, in a fresh interpreter with GRADWATCH_MODE=disabled (the blocks in
  RUN), or is run by tests/e2e/test_quickstart.py (docs/quickstart.md's blocks);
* ``bash``: each ``gradwatch ...`` command parses with the CLI's own argument parser (nothing is run);
  ``python -m MODULE`` names an importable module; ``python SCRIPT.py`` and ``bash .ci/...`` name files
  that exist;
* ``json`` / ``toml`` / ``yaml`` / ``ini``: parse.
"""
from __future__ import annotations

import ast
import configparser
import contextlib
import importlib.util
import io
import json
import os
import re
import shlex
import subprocess
import sys
import textwrap
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from tests.conftest import REPO_ROOT

DOCS = [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]
LANGS = {"python", "bash", "json", "toml", "yaml", "ini", "text"}
FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})(.*)$")

# python blocks run here, standalone, in a fresh interpreter (rel. path, first line of the block's text)
RUN = {
    ("docs/install.md", "from gradwatch import agent"),             # the package's import paths
    ("docs/webhooks.md", "import hashlib, hmac, time"),
}
# python blocks run verbatim by another test
RUN_ELSEWHERE = {"docs/quickstart.md": "tests/e2e/test_quickstart.py"}


@dataclass
class Block:
    file: str
    line: int          # 1-based line of the opening fence
    info: str
    text: str

    @property
    def lang(self) -> str:
        return self.info.split()[0] if self.info.split() else ""

    @property
    def fragment(self) -> bool:
        return self.info.split()[1:2] == ["fragment"]

    @property
    def where(self) -> str:
        return f"{self.file}:{self.line} ```{self.info}"


def blocks(text: str, file: str) -> list[Block]:
    """The fenced blocks of a markdown text, their indentation (list items) removed."""
    out, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        _, fence, info = m.groups()
        start, body = i, []
        i += 1
        close = re.compile(rf"^\s*{re.escape(fence[0])}{{{len(fence)},}}\s*$")
        while i < len(lines) and not close.match(lines[i]):
            body.append(lines[i])
            i += 1
        out.append(Block(file, start + 1, info.strip(), textwrap.dedent("\n".join(body)) + "\n"))
        i += 1
    return out


def _logical_lines(text: str) -> list[str]:
    return [ln for ln in text.replace("\\\n", " ").splitlines() if ln.strip()]


def _commands(line: str) -> list[list[str]]:
    """A shell line's simple commands as word lists (comments dropped, split at ; && || | &, cut at redirections)."""
    lex = shlex.shlex(line, posix=True, punctuation_chars=True)
    lex.whitespace_split = True
    lex.commenters = "#"
    cmds, cur = [], []
    try:
        tokens = list(lex)
    except ValueError:            # unbalanced quotes: reported by the caller as unparsable
        return [["<unparsable>"]]
    redirect = False
    for tok in tokens:
        if tok in {";", "&&", "||", "|", "&", "(", ")"}:
            cmds.append(cur)
            cur, redirect = [], False
        elif set(tok) <= set("<>&"):
            if cur and cur[-1].isdigit():      # 2>&1
                cur.pop()
            redirect = True
        elif not redirect:
            cur.append(tok)
    cmds.append(cur)
    out = []
    for cmd in cmds:
        while cmd and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", cmd[0]):   # VAR=value prefixes
            cmd = cmd[1:]
        if cmd:
            out.append(cmd)
    return out


def _cli_error(argv: list[str]) -> str | None:
    """What the gradwatch CLI's parser says about ``argv`` (None: accepted). Nothing is run."""
    from gradwatch.server.cli import build_parser

    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            build_parser().parse_args(argv)
    except SystemExit as e:
        if e.code:
            return err.getvalue().strip().splitlines()[-1] if err.getvalue().strip() else f"exit {e.code}"
    return None


def check_bash(text: str) -> list[str]:
    problems = []
    for line in _logical_lines(text):
        code = line.split(" #", 1)[0]
        if re.search(r"<[A-Za-z][^<>]*>", code):
            problems.append(f"placeholder in {line.strip()!r} (mark the block `bash fragment`)")
            continue
        for cmd in _commands(line):
            if cmd == ["<unparsable>"]:
                problems.append(f"unparsable shell line {line.strip()!r}")
                continue
            prog = cmd[0]
            if prog == "gradwatch" or prog.endswith("/gradwatch"):
                err = _cli_error(cmd[1:])
                if err:
                    problems.append(f"{shlex.join(cmd)!r}: {err}")
            elif (prog == "python" or prog.endswith("/python")) and cmd[1:2] == ["-m"] and len(cmd) > 2:
                if importlib.util.find_spec(cmd[2]) is None:
                    problems.append(f"{shlex.join(cmd)!r}: no module {cmd[2]}")
            elif (prog == "python" or prog.endswith("/python")) and len(cmd) > 1 and cmd[1].endswith(".py") \
                    and not cmd[1].startswith(("/", "$")) and "$" not in cmd[1]:
                if not (REPO_ROOT / cmd[1]).exists():
                    problems.append(f"{shlex.join(cmd)!r}: no file {cmd[1]}")
            elif prog == "bash" and len(cmd) > 1 and cmd[1].startswith(".ci/"):
                if not (REPO_ROOT / cmd[1]).exists():
                    problems.append(f"{shlex.join(cmd)!r}: no file {cmd[1]}")
    return problems


def _run_python(text: str) -> str | None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GRADWATCH_")}
    env.update(GRADWATCH_MODE="disabled", PYTHONPATH=str(REPO_ROOT))
    proc = subprocess.run([sys.executable, "-c", text], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    return None if proc.returncode == 0 else f"exit {proc.returncode}: {proc.stderr.strip()[-400:]}"


def check(block: Block, *, run: bool = True) -> tuple[str, list[str]]:
    """(what was done: "fragment" / "checked" / "executed" / "elsewhere", problems) for one block."""
    if not block.info:
        return "unmarked", ["no info string (plain output and diagrams are ```text)"]
    if block.lang not in LANGS:
        return "unmarked", [f"unknown info string {block.info!r} (one of {sorted(LANGS)}, optionally + fragment)"]
    if block.info.split()[1:] and not block.fragment or len(block.info.split()) > 2:
        return "unmarked", [f"info string {block.info!r}: the only second word is `fragment`"]
    if block.fragment:             # not checked; a python fragment must still be python
        if block.lang == "python":
            try:
                ast.parse(block.text)
            except SyntaxError as e:
                return "fragment", [f"python fragment does not parse: {e}"]
        return "fragment", []
    text, lang = block.text, block.lang
    try:
        if lang == "python":
            ast.parse(text)
        elif lang == "json":
            json.loads(text)
        elif lang == "toml":
            tomllib.loads(text)
        elif lang == "yaml":
            yaml.safe_load(text)
        elif lang == "ini":
            configparser.ConfigParser(interpolation=None).read_string(text)
    except Exception as e:  # noqa: BLE001 - any parse error is the finding
        return "checked", [f"{lang} does not parse: {type(e).__name__}: {e}"]
    if lang == "bash":
        return "checked", check_bash(text)
    if lang == "python":
        if block.file in RUN_ELSEWHERE:
            return "elsewhere", []
        if any(block.file == f and text.startswith(first) for f, first in RUN):
            err = _run_python(text) if run else None
            return "executed", [err] if err else []
        return "checked", ["python block neither run here nor marked `python fragment` (add it to RUN, or mark it)"]
    return "checked", []


def _all_blocks() -> list[Block]:
    return [b for doc in DOCS for b in blocks(doc.read_text(encoding="utf-8"), str(doc.relative_to(REPO_ROOT)))]


def test_every_block_is_checked_or_marked_a_fragment():
    counts: dict[str, int] = {}
    failures = []
    for block in _all_blocks():
        done, problems = check(block)
        counts[done] = counts.get(done, 0) + 1
        failures += [f"{block.where}: {p}" for p in problems]
    print(f"\ndoc code blocks: {sum(counts.values())} in all; checked {counts.get('checked', 0)}, "
          f"executed {counts.get('executed', 0)} (+ {counts.get('elsewhere', 0)} by tests/e2e/test_quickstart.py), "
          f"fragments {counts.get('fragment', 0)}, unmarked {counts.get('unmarked', 0)}")
    assert not failures, "doc code blocks:\n" + "\n".join(failures)
    assert counts.get("executed", 0) == len(RUN), "a block named in RUN was not found (its first line changed?)"


BAD_PAGE = """\
Some text.

```bash
gradwatch serve --no-such-option
gradwatch export exp-42 --format parquet   # fine
.venv/bin/python -m no_such_module_here
```

```python
def f(:
```

```
an output listing with no info string
```

```python
print("neither run nor marked")
```

```json
{"a": 1,}
```

```python fragment
monitor = agent.attach(model, ...)   # not run
```

```python fragment
for x in loader
```

  ```toml
  [ok]
  a = 1
  ```
"""


def test_the_check_reports_bad_blocks():
    found = {b.line: check(b, run=False) for b in blocks(BAD_PAGE, "bad.md")}
    assert sorted(found) == [3, 9, 13, 17, 21, 25, 29, 33]
    done, problems = found[3]
    assert done == "checked" and len(problems) == 2
    assert "--no-such-option" in problems[0] and "no_such_module_here" in problems[1]
    assert "does not parse" in found[9][1][0]
    assert found[13] == ("unmarked", ["no info string (plain output and diagrams are ```text)"])
    assert "neither run here nor marked" in found[17][1][0]
    assert "json does not parse" in found[21][1][0]
    assert found[25] == ("fragment", [])
    assert found[29][0] == "fragment" and "does not parse" in found[29][1][0]
    assert found[33] == ("checked", [])         # indented (in a list item) and fine


def test_shell_lines_split_into_commands():
    assert _commands("A=1 gradwatch serve --port 1 2>&1 | tee log  # c") == [["gradwatch", "serve", "--port", "1"], ["tee", "log"]]
    assert _commands("export X=$(gradwatch token create --project v)") == [["export", "X=$"], ["gradwatch", "token", "create", "--project", "v"]]
    assert check_bash("docker exec gradwatch gradwatch token create --project vision\n") == []
    assert check_bash("gradwatch token create --project v --bogus\n")
    assert check_bash(".venv/bin/python bench/no_such_script.py --x 1\n")
    assert check_bash("gradwatch export <run> --format csv\n")         # a placeholder needs `bash fragment`
