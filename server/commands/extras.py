"""Which extra a command needs, told in one line when its packages are not installed.

gradwatch installs on three kinds of machines from one distribution (docs/install.md): a training
node (``pip install gradwatch``: the agent, with the torch already there), a monitoring host
(``pip install "gradwatch[server]"``: no torch) and a development tree. Every ``gradwatch`` command
exists on every install; one whose packages are missing says which extra brings them instead of
printing a traceback. Standard library only: this runs where nothing else is installed.
"""
from __future__ import annotations

from typing import Optional

# import name -> the extra that installs it (pyproject.toml's [project.optional-dependencies];
# tests/packaging checks that every requirement of those extras is named here)
MODULE_EXTRA = {
    "torch": "agent",
    "fastapi": "server", "starlette": "server", "uvicorn": "server", "sqlalchemy": "server",
    "alembic": "server", "pydantic": "server", "httpx": "server", "psycopg": "server", "dash": "server",
    "flask": "server", "plotly": "server", "a2wsgi": "server", "pyarrow": "server", "orjson": "server",
    "numpy": "server", "re2": "server",
    "tensorboard": "import", "wandb": "import",
    "transformers": "hf", "accelerate": "hf",
    "lightning": "lightning", "pytorch_lightning": "lightning",
    "deepspeed": "deepspeed",
}

WHAT = {"agent": "PyTorch", "server": "the server's packages", "import": "the loggers' readers",
        "hf": "Hugging Face transformers", "lightning": "Lightning",
        "deepspeed": "DeepSpeed"}


def pip_command(extra: str) -> str:
    """The command that installs ``extra`` (one spelling everywhere a message names it)."""
    return f'pip install "gradwatch[{extra}]"'


def missing_extra(exc: BaseException) -> Optional[str]:
    """The extra whose absence raised ``exc`` (a ModuleNotFoundError), or None if it is not that."""
    if not isinstance(exc, ModuleNotFoundError) or not exc.name:
        return None
    return MODULE_EXTRA.get(exc.name.split(".")[0])


def install_hint(command: str, exc: BaseException) -> Optional[str]:
    """One line for a user whose ``gradwatch COMMAND`` needs an extra that is not installed."""
    extra = missing_extra(exc)
    if extra is None:
        return None
    return (f"gradwatch {command}: needs {WHAT[extra]} (no module named {exc.name.split('.')[0]!r}); "
            f"install it with: {pip_command(extra)}")
