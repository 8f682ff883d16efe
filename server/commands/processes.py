"""Child processes of the CLI: started independent of the working directory, stopped with their parent.

``python -m gradwatch.server`` puts the working directory first on ``sys.path``, so a user's
``server.py``, ``agent.py`` or ``dashboard/`` next to where they type ``gradwatch demo`` would be
imported instead of gradwatch's own code. :func:`module_command` runs a module the way ``-m`` does
but with that first entry removed (the ``-P`` flag of Python 3.11, for every supported Python),
so a child imports exactly what this interpreter has installed.

Children must not outlive the command that started them: :func:`popen` asks Linux to send them
SIGTERM when their parent dies however it dies (even ``kill -9``), and :func:`stop` ends them in
order (SIGINT, then SIGKILL after a grace period).
"""
from __future__ import annotations

import signal
import subprocess
import sys
from typing import Optional, Sequence

# Run by `python -c`: sys.argv is ['-c', MODULE, ARGS...] and sys.path[0] is the working
# directory ('' ) unless safe-path mode already left it out.
_RUN_MODULE = ("import runpy, sys\n"
               "if not getattr(sys.flags, 'safe_path', False):\n"
               "    del sys.path[0]\n"
               "module = sys.argv.pop(1)\n"
               "sys.argv[0] = module\n"
               "runpy.run_module(module, run_name='__main__', alter_sys=True)\n")


def module_command(module: str, *args: str) -> list[str]:
    """``python -m module args…`` for this interpreter, immune to the working directory's contents."""
    return [sys.executable, "-c", _RUN_MODULE, module, *args]


def _die_with_parent() -> None:   # pragma: no cover - runs in the child between fork and exec
    # A command started in the background by a shell inherits SIGINT ignored, and so would its
    # children: stop()'s SIGINT would then wait out its grace period. The child gets Ctrl-C back.
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    try:
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM))
    except (OSError, AttributeError):
        pass   # not Linux: stop() in the parent's finally still ends the child


def popen(cmd: Sequence[str], **kwargs) -> subprocess.Popen:
    """``subprocess.Popen`` for a child that ends when this process ends."""
    if sys.platform.startswith("linux"):
        kwargs.setdefault("preexec_fn", _die_with_parent)
    return subprocess.Popen(list(cmd), **kwargs)


def stop(proc: Optional[subprocess.Popen], timeout: float = 10.0) -> None:
    """End ``proc`` gracefully (SIGINT: uvicorn drains, the agent flushes), killed after ``timeout`` s."""
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


class Terminated(Exception):
    """SIGTERM arrived: unwinds the command like Ctrl-C so that its ``finally`` stops the children."""


def raise_on_sigterm() -> None:
    """Turn SIGTERM into :class:`Terminated` in the main thread (call from the command's main thread)."""
    def handler(signum, frame):
        raise Terminated()

    signal.signal(signal.SIGTERM, handler)
