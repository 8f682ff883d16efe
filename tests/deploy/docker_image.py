"""Read server/Dockerfile and .dockerignore the way ``docker build`` does (no Docker engine needed).

``instructions()`` parses the Dockerfile (line continuations, comments,
exec-form JSON); ``ignored()`` applies .dockerignore's rules (Go
``filepath.Match`` patterns plus ``**``, ``!`` exceptions, the last matching
rule wins, a rule matching a folder covers what is inside);
``copy_context()`` lays out the image's /app from the files its COPY
instructions take out of the context those rules leave; ``requirements()``
runs the Dockerfile's own requirement reader. tests/deploy/test_docker_image.py
builds and runs the image's install from these.
"""
from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

REPO_ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO_ROOT / "server" / "Dockerfile"
DOCKERIGNORE = REPO_ROOT / ".dockerignore"


@dataclass(frozen=True)
class Instruction:
    keyword: str        # upper case: FROM, RUN, COPY, ...
    args: str           # the rest of the instruction, continuations joined

    def exec_form(self) -> list[str] | None:
        """``["a", "b"]`` arguments as a list; None for the shell form."""
        text = self.args.strip()
        if text.startswith("["):
            try:
                value = json.loads(text)
            except ValueError:
                return None
            return [str(v) for v in value] if isinstance(value, list) else None
        return None

    def words(self) -> list[str]:
        """Shell-form arguments split as /bin/sh would split them (quotes removed, operators kept)."""
        return shlex.split(self.args)


def instructions(path: Path = DOCKERFILE) -> list[Instruction]:
    out: list[Instruction] = []
    pending = ""
    for line in path.read_text().splitlines():
        stripped = line.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if pending and stripped.startswith("#"):     # a comment inside a continued instruction
            continue
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        text = pending + stripped
        pending = ""
        keyword, _, args = text.partition(" ")
        out.append(Instruction(keyword.upper(), args.strip()))
    assert not pending, f"{path} ends inside a continued line"
    return out


def healthcheck_command(instrs: list[Instruction]) -> list[str]:
    """The HEALTHCHECK's ``CMD [...]`` (exec form), options stripped."""
    checks = [i for i in instrs if i.keyword == "HEALTHCHECK"]
    assert len(checks) == 1, "expected one HEALTHCHECK"
    _, sep, cmd = checks[0].args.partition("CMD ")
    assert sep, f"HEALTHCHECK without CMD: {checks[0].args}"
    argv = Instruction("CMD", cmd).exec_form()
    assert argv, f"HEALTHCHECK CMD is not in exec form: {cmd}"
    return argv


# --------------------------------------------------------------------------- .dockerignore

def _pattern_regex(pattern: str) -> re.Pattern:
    """moby/patternmatcher: ``**`` any number of folders, ``*`` / ``?`` within one name."""
    out = ""
    i = 0
    while i < len(pattern):
        c = pattern[i]
        if pattern.startswith("**/", i):
            out += "(?:.*/)?"
            i += 3
            continue
        if pattern.startswith("**", i):
            out += ".*"
            i += 2
            continue
        if c == "*":
            out += "[^/]*"
        elif c == "?":
            out += "[^/]"
        elif c == "[":
            end = pattern.index("]", i)
            out += "[" + pattern[i + 1:end].replace("!", "^", 1) + "]"
            i = end
        elif c == "\\":
            i += 1
            out += re.escape(pattern[i])
        else:
            out += re.escape(c)
        i += 1
    return re.compile(out + r"\Z")


def ignore_rules(path: Path = DOCKERIGNORE) -> list[tuple[bool, re.Pattern, str]]:
    """(exception?, regex, pattern) per rule, in file order."""
    rules = []
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        pattern = line[1:].strip() if negate else line
        pattern = str(PurePosixPath("/" + pattern)).lstrip("/")     # docker cleans: leading / and trailing / go
        rules.append((negate, _pattern_regex(pattern), pattern))
    return rules


def ignored(relpath: str, rules=None) -> bool:
    """Whether ``relpath`` (relative to the context, ``/``-separated) is left out of the build context."""
    rules = ignore_rules() if rules is None else rules
    parts = PurePosixPath(relpath).parts
    candidates = ["/".join(parts[:n]) for n in range(1, len(parts) + 1)]   # the path and its parent folders
    excluded = False
    for negate, regex, _ in rules:
        if any(regex.match(c) for c in candidates):
            excluded = not negate
    return excluded


def context_files(root: Path = REPO_ROOT) -> list[str]:
    """Every file of ``root`` that the build context holds (``/``-separated, relative)."""
    rules = ignore_rules(root / ".dockerignore")
    exceptions = [pattern for negate, _, pattern in rules if negate]
    files = []
    for folder, dirs, names in os.walk(root):     # symlinks (the .venv) are not followed
        base = Path(folder).relative_to(root).as_posix()
        base = "" if base == "." else base + "/"
        # an ignored folder no exception reaches into is not walked (the 1.4 GB .venv, .git)
        dirs[:] = [d for d in dirs if not (ignored(base + d, rules)
                                           and not any(e.startswith(base + d + "/") for e in exceptions))]
        files += [base + n for n in names if not ignored(base + n, rules)]
    return sorted(files)


def copy_context(instrs: list[Instruction], dest_root: Path, root: Path = REPO_ROOT) -> list[str]:
    """Carry out the COPY instructions into ``dest_root`` (the image's WORKDIR) from the context's files."""
    available = set(context_files(root))
    copied = []
    for instr in instrs:
        if instr.keyword != "COPY":
            continue
        argv = instr.exec_form() or instr.words()
        assert not any(a.startswith("--") for a in argv), f"COPY options are not mirrored: {instr.args}"
        *sources, target = argv
        for src in sources:
            src = src.rstrip("/")
            inside = [f for f in available if f == src or f.startswith(src + "/")]
            assert inside, f"COPY {src}: nothing of it is in the build context (.dockerignore?)"
            for rel in inside:
                if rel == src:      # a file: into a folder (target ends with /) or to that name
                    out = dest_root / target / Path(src).name if target.endswith("/") else dest_root / target
                else:               # a folder: its contents into target
                    out = dest_root / target / rel[len(src) + 1:]
                out.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(root / rel, out)
                copied.append(rel)
    return copied


# --------------------------------------------------------------------------- the install steps

@dataclass(frozen=True)
class RequirementStep:
    index: int          # position of the RUN among the instructions
    reader: str         # the ``python -c`` program that prints the requirements
    path: str           # where the RUN writes them, then installs with ``pip install -r``


def requirement_step(instrs: list[Instruction]) -> RequirementStep:
    """The RUN that reads the requirements from pyproject.toml and installs them."""
    for index, instr in enumerate(instrs):
        if instr.keyword != "RUN" or "tomllib" not in instr.args:
            continue
        words = instr.words()
        i = words.index("-c")
        assert words[i - 1] == "python" and words[i + 2] == ">", f"unexpected requirement RUN: {instr.args}"
        path = words[i + 3]
        installs = [n for n, w in enumerate(words) if w == "install" and words[n - 1] == "pip"]
        assert any("-r" in words[n:] and words[words.index("-r", n) + 1] == path for n in installs), \
            f"the RUN that writes {path} does not pip install -r it"
        return RequirementStep(index, words[i + 1], path)
    raise AssertionError("no RUN reads the requirements from pyproject.toml with tomllib")


def requirements(step: RequirementStep, python: str, workdir: Path) -> list[str]:
    """What the Dockerfile's reader prints, run with ``python`` in ``workdir`` (the image's /app)."""
    out = subprocess.run([python, "-c", step.reader], cwd=workdir, capture_output=True, text=True,
                         check=True, timeout=60)
    return [ln.strip() for ln in out.stdout.splitlines() if ln.strip()]
