"""``worker.py`` with the agent's threads descheduled at the worst moment for FSDP1.

Every EMA divergence the agent computes off the training thread (on its EMA worker thread, or on the
sender thread that seals a stale step) reads the weights only once the training thread is inside its
next forward, where FSDP1 has pointed each flat parameter at its gathered full tensor (or after 2 s,
where the training thread does not get there: it waits for the read). The training thread, at each
``Linear``'s forward, gives a pending read up to 50 ms to start and then waits for it to end, so the
interleaving is the same on every run. A loaded machine makes it by chance: in a fresh-clone run beside
two CPU hogs a step of the FSDP1 run lost its EMA divergence this way. The run and its server are real.

``python -m torch.distributed.run ... descheduled_worker.py MODE OUT_DIR [worker.py's options]``
"""
from __future__ import annotations

import runpy
import sys
import threading
from pathlib import Path

import torch

WORKER = Path(__file__).with_name("worker.py")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # the repository root

from gradwatch.agent.collectors.ema import EmaDivergence  # noqa: E402

_add = EmaDivergence._add
_pending, _inside, _read = threading.Event(), threading.Event(), threading.Event()


def late_add(self, rec) -> None:
    """The agent's EMA read; off the training thread, only once that thread is inside a forward."""
    if threading.current_thread() is threading.main_thread():
        return _add(self, rec)
    _read.clear()
    _pending.set()
    _inside.wait(2.0)
    try:
        _add(self, rec)
    finally:
        _pending.clear()
        _inside.clear()
        _read.set()


def inside_forward(module, args) -> None:
    """A ``Linear``'s forward on the training thread: FSDP1 has gathered the weights by now."""
    if (isinstance(module, torch.nn.Linear) and torch.is_grad_enabled()
            and threading.current_thread() is threading.main_thread() and _pending.wait(0.05)):
        _inside.set()
        _read.wait(2.0)


EmaDivergence._add = late_add
torch.nn.modules.module.register_module_forward_pre_hook(inside_forward)
sys.argv = [str(WORKER), *sys.argv[1:]]
runpy.run_path(str(WORKER), run_name="__main__")
