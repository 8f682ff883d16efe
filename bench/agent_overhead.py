"""Agent overhead: step time of the reference loop with and without telemetry.

The reference loop: a 12-block pre-norm Transformer (about 150 parameter
tensors), AdamW, GradScaler, clipping at 1.0, an EMA, fp32 compute on CPU, one
torch thread. Every mode runs in its own process; modes are interleaved in
rounds so that machine noise hits them alike. For each round the ratio of a
mode's median step time to bare's is taken; the median over rounds is printed.

Modes:
  bare            the loop alone
  agent-capture   agent attached with mode=disabled: hooks and device vectors, no sender thread
  agent           agent with default telemetry (sender thread, spool; offline unless --server)
  agent-full      agent with every collector every step
  agent-skip      agent with the opt-in skip_spikes guard (--interleaved-mode agent-skip only)
  agent-rewind    agent with the opt-in remediate=Rewind(every=100, keep=2) snapshots (--interleaved-mode
                  agent-rewind only; needs --server: remediation acts on the server's alerts)
  tensorboard     the same per-step scalars through torch.utils.tensorboard.SummaryWriter
  wandb           the same per-step scalars through wandb in offline mode
(tensorboard / wandb are skipped when the package is not installed: `.venv/bin/pip install -e ".[bench]"`.)

A third measurement, ``--interleaved-steps N`` (run with ``--rounds 0 --paired-blocks 0``
to have only it), builds two identical copies of the loop in one process, one
with the agent (default telemetry, offline spool) and one bare, and steps them
alternately: both see the same machine load step by step. The agent moves from
the first copy to the second half-way, so that a copy that happens to run
faster (where its memory landed: up to ±6 % seen) favours neither side. It reports the
ratio of median step times, and the training thread's CPU time per step
(``time.thread_time``, which a busy machine barely disturbs) with and without
the agent, plus the CPU the sender thread used per step, and, pairing each agent step with the bare
step run beside it, the training thread's extra CPU on the steps that sample nothing, on the every-10
and on the every-100 ones, and its mean over all steps (what a run's total time pays: the medians
skip the sampled steps). The bare copy's
``clip_grad_norm_`` goes through the agent's patch too (to torch's original,
unchanged), so the ratios slightly understate the overhead (by the patch's
argument check).

A fourth, ``--versus-steps N`` (with ``--rounds 0 --paired-blocks 0``), ranks the agent against
the loggers: one copy of the loop per mode (bare, agent, tensorboard, wandb) in one process,
each round steps every copy once in a rotating order, and the modes move across the copies
(a Latin square) so no mode keeps a faster copy. It prints, per mode, the ratio of median step
times to bare (wall and training-thread CPU) with a 95 % bootstrap interval over rounds, the
background CPU (the agent's sender and EMA threads; TensorBoard's writer thread; wandb's threads and its wandb-core
process), and for the agent against each logger the ratio of medians with its interval and
the share of rounds in which the agent's step was the faster. An interval that excludes 1 is a
ranking; one that straddles it is not.

A separate RSS check runs the agent for --rss-steps steps (default 10,000) on a
small version of the same model and prints the RSS growth after warm-up.

    python bench/agent_overhead.py                      # several minutes on 2 cores
    python bench/agent_overhead.py --rounds 3 --steps 30 --rss-steps 2000   # quick look
    python bench/agent_overhead.py --json results.json  # also write the raw figures
    python bench/agent_overhead.py --rounds 0 --paired-blocks 0 --rss-steps 0 --versus-steps 400   # vs the loggers
    python bench/agent_overhead.py --rounds 0 --paired-blocks 0 --rss-steps 0 --interleaved-steps 1000 \
        --interleaved-settings '{"adam_every": 20}'   # a cadence's cost against bare
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import checkout  # bench/, this script's folder: runs a checkout's code as gradwatch.*

REPO = Path(__file__).resolve().parent.parent
MODES = ["bare", "agent-capture", "agent", "agent-full", "tensorboard", "wandb"]


# ----------------------------------------------------------------------------- the reference loop (child side)

def build(d_model: int, seq: int, vocab: int, blocks: int = 12):
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1 = nn.LayerNorm(d_model)
            self.qkv = nn.Linear(d_model, 3 * d_model)
            self.proj = nn.Linear(d_model, d_model)
            self.ln2 = nn.LayerNorm(d_model)
            self.fc = nn.Linear(d_model, 4 * d_model)
            self.out = nn.Linear(4 * d_model, d_model)
            self.heads = 4

        def forward(self, x):
            b, t, c = x.shape
            q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
            q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
            return x + self.out(F.gelu(self.fc(self.ln2(x))))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok = nn.Embedding(vocab, d_model)
            self.pos = nn.Embedding(seq, d_model)
            self.blocks = nn.ModuleList(Block() for _ in range(blocks))
            self.ln_f = nn.LayerNorm(d_model)
            self.head = nn.Linear(d_model, vocab, bias=False)

        def forward(self, idx):
            x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
            for blk in self.blocks:
                x = blk(x)
            return self.head(self.ln_f(x))

    return GPT()


class EMA:
    """The checklist's EMA shape (a ``.shadow`` dict), updated with one fused lerp."""

    def __init__(self, model, decay=0.999):
        self.decay = decay
        self.shadow = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
        self._pairs = [(self.shadow[n], p) for n, p in model.named_parameters() if p.requires_grad]

    def update(self, model):
        import torch
        with torch.no_grad():
            torch._foreach_lerp_([s for s, _ in self._pairs], [p.detach() for _, p in self._pairs], 1 - self.decay)


def make_loop(d_model: int, seq: int, vocab: int):
    """(model, AdamW, GradScaler, EMA) of the reference loop, from seed 0."""
    import torch
    torch.manual_seed(0)
    model = build(d_model, seq, vocab)
    return model, torch.optim.AdamW(model.parameters(), lr=3e-4), torch.amp.GradScaler("cpu"), EMA(model)


def make_data(batch: int, seq: int, vocab: int) -> list:
    import torch
    return [torch.randint(0, vocab, (batch, seq + 1)) for _ in range(16)]


def train_step(loop, idx, vocab: int, log_scalars=None, state=None) -> None:
    """One step of the reference loop. With ``log_scalars`` (a callable taking a dict), the per-step
    scalars go to it the way TensorBoard and W&B users log them (``.item()``, ``get_scale()``);
    ``state`` ({"prev_scale", "overflows"}) carries the overflow count between steps."""
    import torch
    import torch.nn.functional as F
    model, opt, scaler, ema = loop
    opt.zero_grad(set_to_none=True)
    logits = model(idx[:, :-1])
    loss = F.cross_entropy(logits.reshape(-1, vocab), idx[:, 1:].reshape(-1))
    scaler.scale(loss).backward()
    scaler.unscale_(opt)
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    scale = scaler.get_scale() if log_scalars is not None else None   # what users of these loggers do
    scaler.step(opt)
    scaler.update()
    ema.update(model)
    if log_scalars is not None:
        new_scale = scaler.get_scale()
        overflow = state["prev_scale"] is not None and new_scale < scale
        state["overflows"] += int(overflow)
        state["prev_scale"] = new_scale
        log_scalars({"loss": loss.item(), "grad_norm": grad_norm.item(), "loss_scale": scale,
                     "overflow": float(overflow), "overflow_count": state["overflows"],
                     "lr": opt.param_groups[0]["lr"]})


def agent_settings(mode: str, run: str, spool_dir: str, ema, server: str | None) -> dict:
    """``agent.attach`` keyword arguments for an agent mode: ``agent-capture`` (hooks, no sender),
    ``agent`` (offline spool, or ``server``), ``agent-full`` (every collector every step), ``agent-skip``
    (``agent`` with the opt-in ``skip_spikes`` guard; only for ``--interleaved-mode``)."""
    from gradwatch.agent.config import EVERY_STEP

    settings = dict(project="bench", run=run, spool_dir=spool_dir, ema=ema)
    if mode == "agent-capture":
        settings["mode"] = "disabled"
    elif server:
        settings["server"] = server
    else:
        settings["mode"] = "offline"
    if mode == "agent-full":
        settings.update(EVERY_STEP)
    if mode == "agent-skip":   # the opt-in skip_spikes guard on top of the defaults (docs/alerts-in-the-loop.md)
        settings.update(skip_spikes=True)
    if mode == "agent-rewind":  # snapshots every 100 steps, two kept (docs/remediation.md)
        from gradwatch.agent import Rewind

        settings.update(remediate=Rewind(every=100, keep=2))
    return settings


def child(mode: str, steps: int, warmup: int, d_model: int, seq: int, batch: int, server: str | None,
          rss_every: int) -> dict:
    import torch
    torch.set_num_threads(1)
    vocab = 256
    loop = make_loop(d_model, seq, vocab)
    model, opt, scaler, ema = loop
    data = make_data(batch, seq, vocab)
    tmp = tempfile.mkdtemp(prefix=f"gw-bench-{mode}-")
    log_scalars = None
    monitor = None
    if mode.startswith("agent"):
        sys.path.insert(0, str(REPO))
        from gradwatch import agent
        monitor = agent.attach(model, scaler, optimizer=opt,
                               **agent_settings(mode, f"{mode}-{os.getpid()}", tmp, ema, server))
    elif mode == "tensorboard":
        from torch.utils.tensorboard import SummaryWriter
        writer = SummaryWriter(log_dir=tmp)

        def log_scalars(step, values):
            for k, v in values.items():
                writer.add_scalar(k, v, step)
    elif mode == "wandb":
        os.environ.setdefault("WANDB_SILENT", "true")
        import wandb
        wandb_run = wandb.init(mode="offline", dir=tmp, project="bench")

        def log_scalars(step, values):
            wandb_run.log(values, step=step)

    param_count = sum(1 for _ in model.parameters())
    times, cpu_times, rss = [], [], []
    sender_cpu = None   # the agent's sender thread's own CPU over the timed steps (its thread clock)
    state = {"prev_scale": None, "overflows": 0}
    for i in range(warmup + steps):
        if i == warmup and monitor is not None and monitor.sender is not None and monitor.sender._thread:
            sender_clock = time.pthread_getcpuclockid(monitor.sender._thread.ident)
            sender_cpu = -time.clock_gettime(sender_clock)
        idx = data[i % len(data)]
        t0, c0 = time.perf_counter(), time.process_time()
        train_step(loop, idx, vocab, (lambda values, i=i: log_scalars(i, values)) if log_scalars else None, state)
        times.append(time.perf_counter() - t0)
        cpu_times.append(time.process_time() - c0)
        if rss_every and i % rss_every == 0:
            rss.append((i, _rss_mb()))
    rss.append((warmup + steps, _rss_mb()))
    if sender_cpu is not None:
        sender_cpu = (sender_cpu + time.clock_gettime(sender_clock)) / steps
    if monitor is not None:
        monitor.close(timeout=10)
    if mode == "tensorboard":
        writer.close()
    if mode == "wandb":
        wandb_run.finish()
    return {"mode": mode, "times": times[warmup:], "cpu_times": cpu_times[warmup:], "params": param_count,
            "rss": rss, "sender_cpu_per_step": sender_cpu}


def paired_child(modes: list[str], blocks: int, block_steps: int, warmup: int, d_model: int, seq: int,
                 batch: int, server: str | None) -> dict:
    """All modes in one process, alternating blocks of steps (attach / detach around agent blocks).

    Paired blocks see the same machine load, so the ratio survives a busy machine
    far better than separate processes do.
    """
    import torch
    torch.set_num_threads(1)
    vocab = 256
    loop = make_loop(d_model, seq, vocab)
    model, opt, scaler, ema = loop
    data = make_data(batch, seq, vocab)
    tmp = tempfile.mkdtemp(prefix="gw-bench-paired-")
    loggers = {}
    if "tensorboard" in modes:
        from torch.utils.tensorboard import SummaryWriter
        writer = SummaryWriter(log_dir=tmp + "/tb")
        loggers["tensorboard"] = lambda step, values: [writer.add_scalar(k, v, step) for k, v in values.items()]
    if "wandb" in modes:
        os.environ.setdefault("WANDB_SILENT", "true")
        import wandb
        wandb_run = wandb.init(mode="offline", dir=tmp, project="bench")
        loggers["wandb"] = lambda step, values: wandb_run.log(values, step=step)
    sys.path.insert(0, str(REPO))
    from gradwatch import agent
    state = {"i": 0, "prev_scale": None, "overflows": 0}

    def step(log_scalars):
        i = state["i"]
        state["i"] += 1
        train_step(loop, data[i % len(data)], vocab,
                   (lambda values: log_scalars(i, values)) if log_scalars is not None else None, state)

    for _ in range(warmup):
        step(None)
    block_medians: dict[str, list[float]] = {m: [] for m in modes}
    for b in range(blocks):
        order = modes[b % len(modes):] + modes[:b % len(modes)]
        for m in order:
            monitor = None
            if m.startswith("agent"):
                monitor = agent.attach(model, scaler, optimizer=opt,
                                       **agent_settings(m, f"paired-{m}-{os.getpid()}-{b}", tmp, ema, server))
            log_scalars = loggers.get(m)
            step(log_scalars)   # untimed: first-use costs (sender thread start, writer open)
            times = []
            for _ in range(block_steps):
                t0 = time.perf_counter()
                step(log_scalars)
                times.append(time.perf_counter() - t0)
            if monitor is not None:
                monitor.close(timeout=10)
            block_medians[m].append(statistics.median(times))
    if "wandb" in loggers:
        wandb_run.finish()
    return {"block_medians": block_medians}


def interleaved_child(steps: int, warmup: int, d_model: int, seq: int, batch: int, server: str | None,
                      mode: str = "agent", baseline: dict | None = None, overrides: dict | None = None) -> dict:
    """Two copies of the loop, agent and bare, stepped alternately in one process.

    ``baseline`` (``--interleaved-baseline '{"nan_replay": false}'``): the second copy is not bare but
    carries the agent too, with these settings changed, so that the ratio is one feature's cost
    measured side by side (the "bare" figures are then that copy's). ``overrides``
    (``--interleaved-settings '{"adam_every": 20}'``): settings of the agent copy changed from the
    mode's, to find a cadence's cost against bare."""
    import torch
    torch.set_num_threads(1)
    vocab = 256
    loops = [make_loop(d_model, seq, vocab) for _ in range(2)]
    data = make_data(batch, seq, vocab)
    sys.path.insert(0, str(REPO))
    from gradwatch import agent
    tmp = tempfile.mkdtemp(prefix="gw-bench-interleaved-")
    settings = {**agent_settings(mode, f"interleaved-{os.getpid()}", tmp, loops[0][3], server), **(overrides or {})}
    def step(loop, i):
        train_step(loop, data[i % len(data)], vocab)

    # The agent sits on copy 0 for the first half and on copy 1 for the second half, so that
    # whatever makes one copy faster than the other (where its memory landed) cancels out.
    wall = {0: [], 1: []}     # 0: the copy with the agent, 1: the bare copy
    cpu = {0: [], 1: []}
    other_cpu = 0.0
    first_steps: list[int] = []
    half = steps // 2
    for part, (with_agent, bare) in enumerate(((0, 1), (1, 0))):
        loop_a, loop_b = loops[with_agent], loops[bare]
        monitor = agent.attach(loop_a[0], loop_a[2], optimizer=loop_a[1], **{**settings, "ema": loop_a[3],
                                                                             "run": f"{settings['run']}-{part}"})
        other = None
        if baseline is not None:
            other = agent.attach(loop_b[0], loop_b[2], optimizer=loop_b[1],
                                 **{**settings, **baseline, "ema": loop_b[3], "run": f"{settings['run']}-{part}-base"})
        for i in range(warmup):
            step(loop_a, i)
            step(loop_b, i)
        first_steps.append(monitor.step)   # the agent's number of the first timed step (resumed runs count on)
        p0 = time.process_time()
        for i in range(half):
            for k in ((0, 1) if i % 2 else (1, 0)):
                t0, c0 = time.perf_counter(), time.thread_time()
                step(loop_a if k == 0 else loop_b, i)
                wall[k].append(time.perf_counter() - t0)
                cpu[k].append(time.thread_time() - c0)
        other_cpu += time.process_time() - p0 - sum(cpu[0][-half:]) - sum(cpu[1][-half:])
        monitor.close(timeout=10)
        if other is not None:
            other.close(timeout=10)
    steps = 2 * half
    # The agent's own number of each timed step (the second attach continues from the optimizer's step
    # count): what tells a sampled step (every 10: the early-warning signals, EMA, inputs; every 100:
    # weights, activations, BatchNorm) from the others in the report.
    agent_step = [first + i for first in first_steps for i in range(half)]
    return {"agent_wall": wall[0], "bare_wall": wall[1], "agent_cpu": cpu[0], "bare_cpu": cpu[1],
            "agent_step": agent_step, "other_threads_cpu_per_step": other_cpu / steps, "load": os.getloadavg()[0]}


def sampled_step_costs(res: dict) -> dict:
    """The training thread's extra CPU per step, agent minus bare, paired step by step (the two copies
    run back to back, so a pair shares the machine's state), by the kind of step: the median over the
    steps that sample nothing, over those the every-10 cadences sample, over the every-100 ones; and the
    mean over all, which is what a run's total time pays (the medians of the main ratios hide the
    sampled steps: 9 steps in 10 sample nothing).

    >>> r = sampled_step_costs({"agent_cpu": [1.0, 2.0, 3.5, 1.0], "bare_cpu": [1.0] * 4, "agent_step": [1, 10, 100, 3]})
    >>> r["none_ms"], r["every_10_ms"], r["every_100_ms"], r["mean_ms"]
    (0.0, 1000.0, 2500.0, 875.0)
    """
    diff = [a - b for a, b in zip(res["agent_cpu"], res["bare_cpu"])]
    kinds: dict[str, list] = {"none": [], "every_10": [], "every_100": []}
    for d, n in zip(diff, res["agent_step"]):
        kinds["every_100" if n % 100 == 0 else "every_10" if n % 10 == 0 else "none"].append(d)
    out = {f"{k}_ms": 1000 * statistics.median(v) if v else None for k, v in kinds.items()}
    out["mean_ms"] = 1000 * statistics.fmean(diff)
    out["mean_cpu_ratio"] = sum(res["agent_cpu"]) / sum(res["bare_cpu"])
    return out


def versus_child(steps: int, warmup: int, d_model: int, seq: int, batch: int, modes: list[str]) -> dict:
    """bare, the agent and the loggers side by side in one process: one copy of the loop per mode.

    Every round steps each copy once (in a rotating order). The modes move across the copies
    in a Latin square (part p: copy c runs mode (c + p) mod K), so each mode spends the same
    number of rounds on each copy and a copy that happens to be faster favours nobody. Per
    round and mode: wall time and the training thread's CPU time. Background CPU, read from the
    threads' own CPU clocks: the agent's sender and EMA-divergence threads, TensorBoard's event writer thread, and
    wandb's threads plus its writer process (wandb-core, a child process; /proc, in clock ticks).
    """
    import threading
    import torch
    torch.set_num_threads(1)
    vocab = 256
    loops = [make_loop(d_model, seq, vocab) for _ in modes]
    data = make_data(batch, seq, vocab)
    sys.path.insert(0, str(REPO))
    from gradwatch import agent
    tmp = tempfile.mkdtemp(prefix="gw-bench-versus-")
    loggers = {}
    counters = {"tensorboard": 0, "wandb": 0}
    if "tensorboard" in modes:
        from torch.utils.tensorboard import SummaryWriter
        writer = SummaryWriter(log_dir=tmp + "/tb")

        def tb_log(values):
            counters["tensorboard"] += 1
            for k, v in values.items():
                writer.add_scalar(k, v, counters["tensorboard"])
        loggers["tensorboard"] = tb_log
    if "wandb" in modes:
        os.environ.setdefault("WANDB_SILENT", "true")
        import wandb
        wandb_run = wandb.init(mode="offline", dir=tmp, project="bench")

        def wandb_log(values):
            counters["wandb"] += 1
            wandb_run.log(values, step=counters["wandb"])
        loggers["wandb"] = wandb_log
    state = {k: {"prev_scale": None, "overflows": 0} for k in range(len(loops))}

    def step(c, i, log_scalars):
        train_step(loops[c], data[i % len(data)], vocab, log_scalars, state[c])

    def thread_cpu(pred) -> float:
        total = 0.0
        for t in threading.enumerate():
            if t is not threading.main_thread() and pred(t) and t.ident is not None:
                try:
                    total += time.clock_gettime(time.pthread_getcpuclockid(t.ident))
                except (OSError, AttributeError):
                    pass
        return total

    def children_cpu() -> float:
        """CPU seconds of this process's child processes (wandb's offline writer, wandb-core)."""
        total, tick = 0.0, os.sysconf("SC_CLK_TCK")
        for d in os.listdir("/proc"):
            if d.isdigit():
                try:
                    with open(f"/proc/{d}/stat") as f:
                        fields = f.read().rsplit(")", 1)[1].split()
                except OSError:
                    continue
                if int(fields[1]) == os.getpid():
                    total += (int(fields[11]) + int(fields[12])) / tick
        return total

    def background_cpu(mode: str) -> float:
        if mode == "agent":
            # the sender, and the worker that computes a CPU model's EMA divergence
            return thread_cpu(lambda t: t.name.startswith("gradwatch-"))
        if mode == "tensorboard":
            return thread_cpu(lambda t: type(t).__module__.startswith("tensorboard"))
        if mode == "wandb":
            return thread_cpu(lambda t: t.name.startswith(("wandb", "Otel"))) + children_cpu()
        return 0.0

    k = len(modes)
    wall = {m: [] for m in modes}
    cpu = {m: [] for m in modes}
    background = {m: 0.0 for m in modes}
    part_steps = steps // k
    for part in range(k):
        mode_of = {c: modes[(c + part) % k] for c in range(k)}
        monitor = None
        for c, m in mode_of.items():
            if m == "agent":
                model, opt, scaler, ema = loops[c]
                monitor = agent.attach(model, scaler, optimizer=opt, ema=ema, project="bench",
                                       run=f"versus-{os.getpid()}-{part}", spool_dir=tmp, mode="offline")
        for i in range(warmup):
            for c, m in mode_of.items():
                step(c, i, loggers.get(m))
        bg0 = {m: background_cpu(m) for m in modes}
        for i in range(part_steps):
            order = list(range(k))
            order = order[i % k:] + order[:i % k]
            for c in order:
                m = mode_of[c]
                t0, c0 = time.perf_counter(), time.thread_time()
                step(c, i, loggers.get(m))
                wall[m].append(time.perf_counter() - t0)
                cpu[m].append(time.thread_time() - c0)
        for m in modes:
            background[m] += background_cpu(m) - bg0[m]
        if monitor is not None:
            monitor.close(timeout=10)
    if "wandb" in loggers:
        wandb_run.finish()
    if "tensorboard" in loggers:
        writer.close()
    n = part_steps * k
    return {"modes": modes, "wall": wall, "cpu": cpu,
            "background_cpu_per_step": {m: v / n for m, v in background.items()}, "load": os.getloadavg()[0]}


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


# ----------------------------------------------------------------------------- the driver

def available(mode: str) -> bool:
    if mode == "tensorboard":
        return importlib.util.find_spec("tensorboard") is not None
    if mode == "wandb":
        return importlib.util.find_spec("wandb") is not None
    return True


def _child_json(what: str, flags: list[str], args, *, size: tuple[int, int, int], timeout: float,
                with_server: bool = True) -> dict:
    """Run this script with ``flags`` in a fresh process (one torch thread; model ``size`` = d_model,
    seq, batch; ``--server`` passed on unless ``with_server`` is False) and return the JSON its last
    line prints."""
    d_model, seq, batch = size
    cmd = [sys.executable, __file__, *flags, "--d-model", str(d_model), "--seq", str(seq), "--batch", str(batch)]
    if with_server and args.server:
        cmd += ["--server", args.server]
    env = {**os.environ, "OMP_NUM_THREADS": "1", **checkout.pythonpath(REPO)}
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    if out.returncode != 0:
        raise RuntimeError(f"{what} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_child(args, mode: str, steps: int, warmup: int, d_model: int, seq: int, batch: int,
              rss_every: int = 0) -> dict:
    return _child_json(mode, ["--child", mode, "--steps", str(steps), "--warmup", str(warmup),
                              "--rss-every", str(rss_every)], args, size=(d_model, seq, batch), timeout=1800)


def _bootstrap_ci(pairs: list[tuple[float, float]], resamples: int = 2000, seed: int = 1) -> tuple[float, float]:
    """95 % interval of median(a) / median(b) over rounds resampled with replacement (a round keeps its pair)."""
    import random
    rng = random.Random(seed)
    med = statistics.median
    ratios = []
    for _ in range(resamples):
        sample = rng.choices(pairs, k=len(pairs))
        ratios.append(med(a for a, _ in sample) / med(b for _, b in sample))
    ratios.sort()
    return ratios[int(0.025 * resamples)], ratios[int(0.975 * resamples) - 1]


def summarize_versus(res: dict) -> dict:
    """Ratios to bare (wall, training-thread CPU, CPU with background threads), each with a 95 %
    bootstrap interval, and agent against each logger: ratio of medians with its interval and
    the share of rounds in which the agent's step was the faster."""
    med = statistics.median
    modes = res["modes"]
    wall, cpu, bg = res["wall"], res["cpu"], res["background_cpu_per_step"]
    out = {"rounds": len(wall["bare"]), "load_at_end": res["load"], "modes": {}, "agent_vs": {}, "raw": res}
    for m in modes:
        row = {"wall_ms": 1000 * med(wall[m]), "cpu_ms": 1000 * med(cpu[m]),
               "background_cpu_ms": 1000 * bg.get(m, 0.0)}
        if m != "bare":
            row["wall_ratio"] = med(wall[m]) / med(wall["bare"])
            row["wall_ci"] = _bootstrap_ci(list(zip(wall[m], wall["bare"])))
            row["cpu_ratio"] = med(cpu[m]) / med(cpu["bare"])
            row["cpu_ci"] = _bootstrap_ci(list(zip(cpu[m], cpu["bare"])))
            row["cpu_ratio_with_background"] = (med(cpu[m]) + bg.get(m, 0.0)) / med(cpu["bare"])
            # Means count the sampled steps (EMA divergence every 10, activations every 100),
            # which medians leave out: the complete cost, at the price of more noise.
            mean = statistics.fmean
            row["cpu_mean_ratio"] = mean(cpu[m]) / mean(cpu["bare"])
            row["cpu_mean_ratio_with_background"] = (mean(cpu[m]) + bg.get(m, 0.0)) / mean(cpu["bare"])
        out["modes"][m] = row
    if "agent" in modes:
        for other in (m for m in modes if m not in ("bare", "agent")):
            pairs_w = list(zip(wall["agent"], wall[other]))
            pairs_c = list(zip(cpu["agent"], cpu[other]))
            out["agent_vs"][other] = {
                "wall_ratio": med(wall["agent"]) / med(wall[other]), "wall_ci": _bootstrap_ci(pairs_w),
                "wall_share_agent_faster": sum(a < b for a, b in pairs_w) / len(pairs_w),
                "cpu_ratio": med(cpu["agent"]) / med(cpu[other]), "cpu_ci": _bootstrap_ci(pairs_c),
                "cpu_share_agent_lower": sum(a < b for a, b in pairs_c) / len(pairs_c),
                "cpu_mean_ratio_with_background": out["modes"]["agent"]["cpu_mean_ratio_with_background"]
                / out["modes"][other]["cpu_mean_ratio_with_background"],
            }
    return out


def print_versus(v: dict) -> None:
    print(f"\nside by side, one process, one copy of the loop per mode stepped in turn, modes rotated over the "
          f"copies; {v['rounds']} rounds; 95 % bootstrap intervals in brackets:")
    print(f"{'mode':<12} {'wall':>9} {'wall ratio':>22} {'thread CPU':>11} {'CPU ratio':>22} "
          f"{'background CPU':>15} {'CPU ratio incl. background':>27}")
    for m, r in v["modes"].items():
        if m == "bare":
            print(f"{m:<12} {r['wall_ms']:>7.2f}ms {'1.000':>22} {r['cpu_ms']:>9.2f}ms {'1.000':>22}")
            continue
        print(f"{m:<12} {r['wall_ms']:>7.2f}ms {r['wall_ratio']:>7.3f} [{r['wall_ci'][0]:.3f}-{r['wall_ci'][1]:.3f}] "
              f"{r['cpu_ms']:>9.2f}ms {r['cpu_ratio']:>7.3f} [{r['cpu_ci'][0]:.3f}-{r['cpu_ci'][1]:.3f}] "
              f"{r['background_cpu_ms']:>13.3f}ms {r['cpu_ratio_with_background']:>27.3f}")
    print("mean training-thread CPU per step (sampled steps included) over bare's, without / with background: "
          + ", ".join(f"{m} {r['cpu_mean_ratio']:.3f} / {r['cpu_mean_ratio_with_background']:.3f}"
                      for m, r in v["modes"].items() if m != "bare"))
    for other, r in v["agent_vs"].items():
        print(f"agent / {other}: wall {r['wall_ratio']:.3f} [{r['wall_ci'][0]:.3f}-{r['wall_ci'][1]:.3f}], agent "
              f"faster in {100 * r['wall_share_agent_faster']:.0f} % of rounds; training-thread CPU "
              f"{r['cpu_ratio']:.3f} [{r['cpu_ci'][0]:.3f}-{r['cpu_ci'][1]:.3f}], lower in "
              f"{100 * r['cpu_share_agent_lower']:.0f} % of rounds; mean CPU with background "
              f"{r['cpu_mean_ratio_with_background']:.3f}")
    print("(background: the agent's sender and EMA threads, TensorBoard's writer thread, wandb's threads and its "
          "wandb-core process; not on the training thread, so in no wall or CPU ratio but the last column)")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=25, help="timed steps per mode per round")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--rss-steps", type=int, default=10_000, help="agent steps for the RSS check (0: skip)")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--server", help="send agent modes to this gradwatch server (default: offline spool)")
    p.add_argument("--paired-blocks", type=int, default=12,
                   help="blocks per mode in the paired (single-process) measurement; 0: skip it")
    p.add_argument("--block-steps", type=int, default=6)
    p.add_argument("--interleaved-steps", type=int, default=0,
                   help="steps per copy in the interleaved (two copies, one process) measurement; 0: skip it")
    p.add_argument("--interleaved-mode", default="agent", choices=["agent", "agent-capture", "agent-skip",
                                                                      "agent-rewind"])
    p.add_argument("--interleaved-baseline", default=None,
                   help='JSON agent settings for the second copy instead of bare, e.g. \'{"nan_replay": false}\'')
    p.add_argument("--interleaved-settings", default=None,
                   help='JSON agent settings changed on the agent copy, e.g. \'{"adam_every": 20}\' (a cadence\'s cost)')
    p.add_argument("--versus-steps", type=int, default=0,
                   help="rounds in the side-by-side measurement (bare, agent, tensorboard, wandb: one copy of the "
                        "loop each, stepped in turn in one process); 0: skip it")
    p.add_argument("--versus-modes", default="agent,tensorboard,wandb")
    p.add_argument("--json", help="write raw figures here")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--paired-child", help=argparse.SUPPRESS)
    p.add_argument("--rss-every", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--interleaved-child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--versus-child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    if args.interleaved_child:
        print(json.dumps(interleaved_child(args.interleaved_steps, args.warmup, args.d_model, args.seq, args.batch,
                                           args.server, args.interleaved_mode,
                                           json.loads(args.interleaved_baseline) if args.interleaved_baseline
                                           else None,
                                           json.loads(args.interleaved_settings) if args.interleaved_settings
                                           else None)))
        return 0

    if args.versus_child:
        print(json.dumps(versus_child(args.versus_steps, args.warmup, args.d_model, args.seq, args.batch,
                                      args.versus_modes.split(","))))
        return 0

    if args.paired_child:
        result = paired_child(args.paired_child.split(","), args.paired_blocks, args.block_steps, args.warmup,
                              args.d_model, args.seq, args.batch, args.server)
        print(json.dumps(result))
        return 0
    if args.child:
        result = child(args.child, args.steps, args.warmup, args.d_model, args.seq, args.batch, args.server,
                       args.rss_every)
        print(json.dumps(result))
        return 0

    modes = [m for m in args.modes.split(",") if m]
    skipped = [m for m in modes if not available(m)]
    modes = [m for m in modes if available(m)]
    if "bare" not in modes:
        modes.insert(0, "bare")
    for m in skipped:
        print(f"skipping {m}: package not installed")
    medians: dict[str, list[float]] = {m: [] for m in modes}
    cpu_medians: dict[str, list[float]] = {m: [] for m in modes}
    ratios: dict[str, list[float]] = {m: [] for m in modes if m != "bare"}
    cpu_ratios: dict[str, list[float]] = {m: [] for m in modes if m != "bare"}
    params = None
    sender_cpu: list[float] = []
    for r in range(args.rounds):
        order = modes[r % len(modes):] + modes[:r % len(modes)]   # rotate so no mode always runs first
        round_medians, round_cpu = {}, {}
        for m in order:
            res = run_child(args, m, args.steps, args.warmup, args.d_model, args.seq, args.batch)
            params = res["params"]
            round_medians[m] = statistics.median(res["times"])
            round_cpu[m] = statistics.median(res["cpu_times"])
            medians[m].append(round_medians[m])
            cpu_medians[m].append(round_cpu[m])
            if m == "agent" and res.get("sender_cpu_per_step") is not None:
                sender_cpu.append(res["sender_cpu_per_step"])
        for m in ratios:
            ratios[m].append(round_medians[m] / round_medians["bare"])
            cpu_ratios[m].append(round_cpu[m] / round_cpu["bare"])
        print(f"round {r + 1}/{args.rounds}: " + ", ".join(
            f"{m} {1000 * round_medians[m]:.1f} ms ({1000 * round_cpu[m]:.1f} CPU)" for m in modes), flush=True)

    summary = {}
    if args.rounds:
        print(f"\nreference loop: 12-block pre-norm Transformer, {params} parameter tensors, d_model={args.d_model}, "
              f"seq={args.seq}, batch={args.batch}, AdamW + GradScaler + clip 1.0 + EMA, fp32 CPU, 1 thread")
        print("ratios are per round (same round's bare), then the median over rounds; CPU = process CPU time per step")
        print(f"{'mode':<14} {'wall median':>12} {'wall ratio':>11} {'CPU median':>11} {'CPU ratio':>10}")
        print(f"{'bare':<14} {1000 * statistics.median(medians['bare']):>10.2f}ms {'1.000':>11} "
              f"{1000 * statistics.median(cpu_medians['bare']):>9.2f}ms {'1.000':>10}")
        for m, rs in ratios.items():
            summary[m] = {"wall": statistics.median(rs), "cpu": statistics.median(cpu_ratios[m])}
            print(f"{m:<14} {1000 * statistics.median(medians[m]):>10.2f}ms {summary[m]['wall']:>11.3f} "
                  f"{1000 * statistics.median(cpu_medians[m]):>9.2f}ms {summary[m]['cpu']:>10.3f}")
        if sender_cpu:
            summary["agent_sender_cpu_ms_per_step"] = 1000 * statistics.median(sender_cpu)
            print(f"agent: sender thread CPU per step (its own thread clock, median over rounds): "
                  f"{summary['agent_sender_cpu_ms_per_step']:.3f} ms")

    paired = None
    if args.paired_blocks:
        blocks = _child_json("paired run", ["--paired-child", ",".join(modes), "--paired-blocks",
                                            str(args.paired_blocks), "--block-steps", str(args.block_steps),
                                            "--warmup", str(args.warmup)], args,
                             size=(args.d_model, args.seq, args.batch), timeout=3600)["block_medians"]
        paired = {m: statistics.median(a / b for a, b in zip(blocks[m], blocks["bare"])) for m in modes if m != "bare"}
        print(f"\npaired, one process, {args.paired_blocks} blocks x {args.block_steps} steps per mode, alternating "
              f"(agent attached / detached around its blocks):")
        print(f"{'mode':<14} {'median block':>13} {'ratio to the neighbouring bare block (median)':>47}")
        print(f"{'bare':<14} {1000 * statistics.median(blocks['bare']):>11.2f}ms {'1.000':>47}")
        for m, r in paired.items():
            print(f"{m:<14} {1000 * statistics.median(blocks[m]):>11.2f}ms {r:>47.3f}")

    interleaved = None
    if args.interleaved_steps:
        res = _child_json("interleaved run", ["--interleaved-child", "--interleaved-steps", str(args.interleaved_steps),
                                              "--interleaved-mode", args.interleaved_mode, "--warmup", str(args.warmup)]
                          + (["--interleaved-baseline", args.interleaved_baseline] if args.interleaved_baseline else [])
                          + (["--interleaved-settings", args.interleaved_settings] if args.interleaved_settings else []),
                          args, size=(args.d_model, args.seq, args.batch), timeout=3600)
        med = statistics.median
        interleaved = {
            "wall_ratio": med(res["agent_wall"]) / med(res["bare_wall"]),
            "cpu_ratio": med(res["agent_cpu"]) / med(res["bare_cpu"]),
            "cpu_ratio_with_sender": (sum(res["agent_cpu"]) + res["other_threads_cpu_per_step"] * args.interleaved_steps)
            / sum(res["bare_cpu"]),
            "bare_wall_ms": 1000 * med(res["bare_wall"]), "agent_wall_ms": 1000 * med(res["agent_wall"]),
            "bare_cpu_ms": 1000 * med(res["bare_cpu"]), "agent_cpu_ms": 1000 * med(res["agent_cpu"]),
            "sender_cpu_ms_per_step": 1000 * res["other_threads_cpu_per_step"], "load_at_end": res["load"],
            "sampled": sampled_step_costs(res),
        }
        base_name = f"agent with {args.interleaved_baseline}" if args.interleaved_baseline else "bare"
        agent_name = args.interleaved_mode + (f" with {args.interleaved_settings}" if args.interleaved_settings else "")
        print(f"\ninterleaved, one process, two copies of the loop ({agent_name} / {base_name}) stepped "
              f"alternately, {args.interleaved_steps} steps each:")
        print(f"  step wall median: bare {interleaved['bare_wall_ms']:.2f} ms, agent {interleaved['agent_wall_ms']:.2f} ms"
              f" -> ratio {interleaved['wall_ratio']:.3f}")
        print(f"  training-thread CPU median: bare {interleaved['bare_cpu_ms']:.2f} ms, agent "
              f"{interleaved['agent_cpu_ms']:.2f} ms -> ratio {interleaved['cpu_ratio']:.3f}")
        print(f"  sender (other threads) CPU per step: {interleaved['sender_cpu_ms_per_step']:.2f} ms; "
              f"total CPU ratio with it: {interleaved['cpu_ratio_with_sender']:.3f}")
        sc = interleaved["sampled"]
        fmt = lambda v: "-" if v is None else f"{v:.2f} ms"   # noqa: E731
        print(f"  training-thread CPU, agent minus bare, paired by step: median {fmt(sc['none_ms'])} on the steps that "
              f"sample nothing, {fmt(sc['every_10_ms'])} on the every-10 ones, {fmt(sc['every_100_ms'])} on the "
              f"every-100 ones; mean over all {sc['mean_ms']:.2f} ms (mean CPU ratio {sc['mean_cpu_ratio']:.3f})")

    versus = None
    if args.versus_steps:
        vmodes = ["bare"] + [m for m in args.versus_modes.split(",") if m and m != "bare" and available(m)]
        versus = summarize_versus(_child_json(
            "versus run", ["--versus-child", "--versus-steps", str(args.versus_steps), "--versus-modes",
                           ",".join(vmodes), "--warmup", str(args.warmup)],
            args, size=(args.d_model, args.seq, args.batch), timeout=3600, with_server=False))
        print_versus(versus)

    rss = None
    if args.rss_steps:
        warm = min(500, args.rss_steps // 10)
        every = max(1, args.rss_steps // 20)
        bare = run_child(args, "bare", args.rss_steps // 10, warm, 8, 8, 1, rss_every=every)
        agent_res = run_child(args, "agent", args.rss_steps, warm, 8, 8, 1, rss_every=every)

        def growth(res):
            after_warm = next(v for i, v in res["rss"] if i >= warm)
            return res["rss"][-1][1] - after_warm
        rss = {"steps": args.rss_steps, "bare_growth_mb": growth(bare), "agent_growth_mb": growth(agent_res),
               "agent_rss_mb": agent_res["rss"][-1][1], "bare_rss_mb": bare["rss"][-1][1],
               "bare_steps": args.rss_steps // 10}
        print(f"\nRSS over {args.rss_steps} steps after {warm} warm-up steps (small model, default telemetry): "
              f"agent +{rss['agent_growth_mb']:.1f} MB (bare loop, {rss['bare_steps']} steps: "
              f"+{rss['bare_growth_mb']:.1f} MB) "
              f"(final RSS agent {rss['agent_rss_mb']:.0f} MB, bare {rss['bare_rss_mb']:.0f} MB)")
    if args.json:
        Path(args.json).write_text(json.dumps({"medians": medians, "ratios": ratios, "cpu_medians": cpu_medians,
                                               "cpu_ratios": cpu_ratios, "summary": summary,
                                               "paired": paired, "interleaved": interleaved,
                                               "versus": versus,
                                               "rss": rss, "args": vars(args)}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
