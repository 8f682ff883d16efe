"""Proof on real runs: for every rule a tiny real training run that shows that failure, and
healthy runs that must stay quiet. All runs stream through the real agent to one real server.

The rule × scenario confusion table of this test run is written into docs/rules.md
(between the ``confusion`` markers) and to test-artifacts/confusion.md.

Scenarios whose rule has a long default window run in the project ``short-windows``,
whose rules file (below) shortens exactly those windows; healthy runs are run in both
projects, so the shortened windows are shown quiet on healthy runs too.
"""
from __future__ import annotations

import math
import os
import re
import subprocess
import sys
import time
import importlib
import pkgutil
from pathlib import Path
from typing import Callable, Optional

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from gradwatch.server.rules.catalogue import RULES, SEVERITY_RANK
from tests.conftest import ARTIFACTS, REPO_ROOT, LiveServer, free_port, wait_until
from tests.resume.loop import ResumedRun
from tests.scenarios.training import AGENT_CONFIG, Loop, Scenario, classification_data, mlp, regression_data

RULES_FILE = """
# scenarios whose rule has a long default window (B2 500, C1 200, D1 500, E2 1000 steps) or timeout (F2 300 s)
[projects.short-windows.rules.B2]
window = 100
[projects.short-windows.rules.C1]
window = 100
min_history = 60
[projects.short-windows.rules.D1]
window = 100
[projects.short-windows.rules.E2]
window = 100
[projects.short-windows.rules.F2]
timeout_s = 2
"""
DEFAULT, SHORT = "scenarios", "short-windows"


# --------------------------------------------------------------------------- failing runs

def a1_log_sigmoid_bce() -> Loop:
    """BCE written as log(sigmoid(z)) on separable data: once a logit passes ~17, 1 - sigmoid(z)
    rounds to 0 in fp32 and log(0) = -inf, while the grad norm is perfectly normal."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    w_true = torch.randn(8, 1, generator=g)
    model = nn.Linear(8, 1)

    def batch(step):
        x = torch.randn(64, 8, generator=g) * 4
        return x, (x @ w_true > 0).float()

    def naive_bce(z, y):
        p = torch.sigmoid(z)
        return -(y * torch.log(p) + (1 - y) * torch.log(1 - p)).mean()
    return Loop(model, torch.optim.Adam(model.parameters(), lr=0.05), batch, naive_bce, steps=60)


def a2_lr_jump() -> Loop:
    torch.manual_seed(1)
    model = mlp()

    def jump(step, loop):
        if step == 100:
            for g in loop.optimizer.param_groups:
                g["lr"] *= 100.0
    return Loop(model, torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9), regression_data(1),
                F.mse_loss, steps=130, clip=None, before_step=jump)


class RowStandardize(nn.Module):
    """(x - mean) / std per row: 0/0 = NaN on a constant row."""

    def forward(self, x):
        return (x - x.mean(dim=1, keepdim=True)) / x.std(dim=1, keepdim=True)


def a3_division_by_zero() -> Loop:
    torch.manual_seed(2)
    model = nn.Sequential(RowStandardize(), nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))
    data = regression_data(2)

    def batch(step):
        x, y = data(step)
        if step >= 80:
            x[0] = 1.0            # a constant sample (a padding row) from step 80 on
        return x, y
    return Loop(model, torch.optim.Adam(model.parameters(), lr=1e-3), batch, F.mse_loss, steps=100)


def a4_nan_inputs() -> Loop:
    torch.manual_seed(3)
    model = mlp()
    data = regression_data(3)

    def batch(step):
        x, y = data(step)
        if step >= 80 and step % 7 == 0:
            x[3, 2] = math.nan    # a corrupt record every 7th batch
        return x, y
    return Loop(model, torch.optim.Adam(model.parameters(), lr=1e-3), batch, F.mse_loss, steps=100)


def a5_absurd_init_scale() -> Loop:
    torch.manual_seed(4)
    model = mlp()
    return Loop(model, torch.optim.Adam(model.parameters(), lr=1e-3), regression_data(4), F.mse_loss, steps=40,
                amp=torch.float16, scaler=torch.amp.GradScaler("cpu", init_scale=2.0 ** 40))


def b1_saturated_sigmoid() -> Loop:
    torch.manual_seed(5)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1), nn.Sigmoid())
    with torch.no_grad():
        model[2].bias.fill_(100.0)          # a bad init drives the output sigmoid to its flat end
    data = regression_data(5)

    def batch(step):
        x, y = data(step)
        return x, (y > 0).float()
    return Loop(model, torch.optim.Adam(model.parameters(), lr=1e-3), batch, F.mse_loss, steps=45)


def b2_lr_too_low() -> Loop:
    torch.manual_seed(6)
    model = mlp()
    return Loop(model, torch.optim.Adam(model.parameters(), lr=1e-7), regression_data(6), F.mse_loss, steps=150)


def b2_lr_too_low_default_window() -> Loop:
    torch.manual_seed(26)
    model = mlp()
    return Loop(model, torch.optim.Adam(model.parameters(), lr=1e-7), regression_data(26), F.mse_loss, steps=600)


def b3_scale_collapse() -> Loop:
    """fp16 gradients that overflow at any scale >= 1: the scaler halves below 1."""
    torch.manual_seed(7)
    model = nn.Linear(8, 1)
    g = torch.Generator().manual_seed(7)

    def batch(step):
        x = torch.randn(64, 8, generator=g) * 300
        return x, torch.full((64, 1), 1000.0)
    return Loop(model, torch.optim.SGD(model.parameters(), lr=1e-9), batch, F.mse_loss, steps=40,
                amp=torch.float16, clip=None)


def b4_lr_schedule_to_zero() -> Loop:
    torch.manual_seed(8)
    model = mlp()
    return Loop(model, torch.optim.Adam(model.parameters(), lr=1e-3), regression_data(8), F.mse_loss, steps=110,
                schedule=lambda s: max(0.0, 1.0 - s / 80))


class TwoBranch(nn.Module):
    def __init__(self):
        super().__init__()
        self.main = nn.Linear(8, 16)
        self.side = nn.Linear(8, 16)
        self.head = nn.Linear(16, 1)

    def forward(self, x):
        return self.head(torch.tanh(self.main(x)) + torch.tanh(self.side(x)).detach())   # the stray detach()


def b5_detached_branch() -> Loop:
    torch.manual_seed(9)
    model = TwoBranch()
    return Loop(model, torch.optim.Adam(model.parameters(), lr=1e-3), regression_data(9), F.mse_loss, steps=70)


def b6_fp16_underflow() -> Loop:
    """fp16 autocast with loss scaling turned off (GradScaler(init_scale=1), no growth) and, from step 60, a
    loss divided by a huge normaliser (a token count summed over a long accumulation): the gradients fall
    below fp16's smallest subnormal (~6e-8) in the backward pass and flush to exact zeros."""
    torch.manual_seed(6)
    model = mlp()
    weight = {"k": 1.0}

    def loss(out, y):
        return F.mse_loss(out, y) * weight["k"]

    def shrink(step, loop):
        if step == 60:
            weight["k"] = 1e-7
    return Loop(model, torch.optim.Adam(model.parameters(), lr=1e-3), regression_data(6), loss, steps=100,
                amp=torch.float16, scaler=torch.amp.GradScaler("cpu", init_scale=1.0, growth_interval=10**6),
                before_step=shrink)


def c1_lr_too_high() -> Loop:
    torch.manual_seed(10)
    model = mlp()
    return Loop(model, torch.optim.SGD(model.parameters(), lr=0.3, momentum=0.9), regression_data(10, batch=16),
                F.mse_loss, steps=170)


def c2_max_norm_too_small() -> Loop:
    torch.manual_seed(11)
    model = mlp()
    return Loop(model, torch.optim.Adam(model.parameters(), lr=1e-3), regression_data(11), F.mse_loss, steps=210,
                clip=1e-3)


def c3_poisoned_batch() -> Loop:
    torch.manual_seed(12)
    model = mlp()
    data = regression_data(12)

    def batch(step):
        x, y = data(step)
        return (x, y * 100.0) if step == 100 else (x, y)     # one batch with broken labels
    return Loop(model, torch.optim.Adam(model.parameters(), lr=1e-3), batch, F.mse_loss, steps=130)


def d1_decayed_lr_drifting_data() -> Loop:
    torch.manual_seed(13)
    model = mlp()
    data = regression_data(13)

    def batch(step):
        x, y = data(step)
        return x, y + max(0, step - 60) * 0.02     # the data keeps moving after the LR has decayed
    return Loop(model, torch.optim.Adam(model.parameters(), lr=1e-2), batch, F.mse_loss, steps=180,
                schedule=lambda s: 0.01 + 0.99 * 0.5 * (1 + math.cos(math.pi * min(s, 60) / 60)))


def d2_ema_decay_too_high() -> Loop:
    """Fine-tuning a trained model with EMA decay 0.9999: when the new task's data arrives the
    weights move on and the EMA stays where it was."""
    torch.manual_seed(14)
    model = mlp()
    data = regression_data(14)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    for step in range(150):                      # pre-training, before the monitored fine-tuning run
        x, y = data(step)
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()
    for g in opt.param_groups:
        g["lr"] = 1e-3                           # the usual lower fine-tuning LR

    def batch(step):
        x, y = data(step)
        return (x, -3 * y + 2) if step >= 80 else (x, y)      # the fine-tuning task proper starts at 80
    return Loop(model, opt, batch, F.mse_loss, steps=140, ema_decay=0.9999)


def d3_bn_shifted_data() -> Loop:
    torch.manual_seed(15)
    model = nn.Sequential(nn.Linear(8, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 4))
    data = classification_data(15)

    def batch(step):
        x, y = data(step)
        return (x * 30 + 5, y) if step >= 130 else (x, y)      # fine-tuning on data with another scale
    return Loop(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), batch, F.cross_entropy,
                steps=200)


def e1_weight_surgery() -> Loop:
    torch.manual_seed(16)
    model = mlp()

    def surgery(step, loop):
        if step == 100:
            with torch.no_grad():
                loop.model[2].weight.mul_(30.0)              # a bad checkpoint merge scales one layer
    return Loop(model, torch.optim.Adam(model.parameters(), lr=1e-3), regression_data(16), F.mse_loss, steps=130,
                before_step=surgery)


def e2_weights_growing() -> Loop:
    """Logistic regression on separable data, large LR, no weight decay: the weights grow without bound."""
    torch.manual_seed(17)
    g = torch.Generator().manual_seed(17)
    w_true = torch.randn(8, 1, generator=g)
    model = nn.Linear(8, 1)

    def batch(step):
        x = torch.randn(64, 8, generator=g)
        return x, (x @ w_true > 0).float()
    return Loop(model, torch.optim.Adam(model.parameters(), lr=0.05), batch, F.binary_cross_entropy_with_logits,
                steps=150, clip=None)


def e3_lr_far_too_high() -> Loop:
    torch.manual_seed(18)
    model = mlp()
    return Loop(model, torch.optim.Adam(model.parameters(), lr=0.2), regression_data(18), F.mse_loss, steps=120)


def f2_hung_job() -> Loop:
    torch.manual_seed(19)
    model = mlp()

    def hang(step, loop):
        if step == 60:
            time.sleep(5.0)              # a hung collective / a stuck data loader
    return Loop(model, torch.optim.Adam(model.parameters(), lr=1e-3), regression_data(19), F.mse_loss, steps=80,
                before_step=hang)


# --------------------------------------------------------------------------- healthy runs

def h_mlp_regression(seed: int, hidden: int = 32, depth: int = 2, act=nn.Tanh, steps: int = 300) -> Callable[[], Loop]:
    def build():
        torch.manual_seed(seed)
        model = mlp(hidden=hidden, depth=depth, act=act)
        return Loop(model, torch.optim.AdamW(model.parameters(), lr=1e-3), regression_data(seed), F.mse_loss,
                    steps=steps)
    return build


def h_bn_classifier() -> Loop:
    torch.manual_seed(21)
    model = nn.Sequential(nn.Linear(8, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 4))
    return Loop(model, torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9), classification_data(21),
                F.cross_entropy, steps=300,
                schedule=lambda s: 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * s / 300)))   # cosine to base/10


def h_tiny_transformer() -> Loop:
    from gradwatch.agent.demo import TinyLM, make_batch

    torch.manual_seed(22)
    g = torch.Generator().manual_seed(22)
    model = TinyLM(vocab=32, d=32, layers=1, heads=2, seq=16)
    return Loop(model, torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01),
                lambda s: make_batch(g, 8, 16, 32), lambda out, y: F.cross_entropy(out.reshape(-1, 32), y.reshape(-1)),
                steps=150)


def h_fp16() -> Loop:
    torch.manual_seed(23)
    model = mlp()
    return Loop(model, torch.optim.Adam(model.parameters(), lr=1e-3), regression_data(23), F.mse_loss, steps=60,
                amp=torch.float16)


SCENARIOS = [
    Scenario("log_sigmoid_bce", "A1", DEFAULT, a1_log_sigmoid_bce, "BCE as log(sigmoid(z)) on separable data"),
    Scenario("lr_jump_100x", "A2", DEFAULT, a2_lr_jump, "LR x100 at step 100 (SGD momentum, no clipping)"),
    Scenario("division_by_zero", "A3", DEFAULT, a3_division_by_zero, "row standardisation meets a constant row"),
    Scenario("nan_inputs", "A4", DEFAULT, a4_nan_inputs, "a corrupt record (NaN feature) every 7th batch"),
    Scenario("absurd_init_scale", "A5", DEFAULT, a5_absurd_init_scale, "fp16, GradScaler(init_scale=2**40)"),
    Scenario("saturated_sigmoid", "B1", DEFAULT, b1_saturated_sigmoid, "output sigmoid saturated (bias init 100)"),
    Scenario("lr_too_low", "B2", SHORT, b2_lr_too_low, "Adam at lr 1e-7 (B2 window 100)"),
    Scenario("lr_too_low_default_window", "B2", DEFAULT, b2_lr_too_low_default_window,
             "Adam at lr 1e-7, B2 at its default 500-step window"),
    Scenario("scale_collapse", "B3", DEFAULT, b3_scale_collapse, "fp16 grads that overflow at any scale >= 1"),
    Scenario("lr_schedule_to_zero", "B4", DEFAULT, b4_lr_schedule_to_zero, "linear decay to 0 at step 80"),
    Scenario("detached_branch", "B5", DEFAULT, b5_detached_branch, "a stray .detach() on one branch"),
    Scenario("fp16_underflow", "B6", DEFAULT, b6_fp16_underflow,
             "fp16, loss scaling off (init_scale 1), loss x1e-7 from step 60"),
    Scenario("lr_too_high_sgd", "C1", SHORT, c1_lr_too_high, "SGD lr 0.3 momentum 0.9, batch 16 (C1 window 100)"),
    Scenario("max_norm_too_small", "C2", DEFAULT, c2_max_norm_too_small, "clip_grad_norm_ max_norm=1e-3"),
    Scenario("poisoned_batch", "C3", DEFAULT, c3_poisoned_batch, "one batch with labels x100 at step 100"),
    Scenario("decayed_lr_drifting_data", "D1", SHORT, d1_decayed_lr_drifting_data,
             "cosine to 1% of peak, then the targets drift (D1 window 100)"),
    Scenario("ema_decay_too_high", "D2", DEFAULT, d2_ema_decay_too_high, "fine-tuning with EMA decay 0.9999; new task at step 80"),
    Scenario("bn_shifted_data", "D3", DEFAULT, d3_bn_shifted_data, "BatchNorm net fed x*30+5 from step 130"),
    Scenario("weight_surgery", "E1", DEFAULT, e1_weight_surgery, "one layer's weights x30 at step 100"),
    Scenario("separable_logreg", "E2", SHORT, e2_weights_growing,
             "logistic regression, separable data, no weight decay (E2 window 100)"),
    Scenario("lr_far_too_high_adam", "E3", DEFAULT, e3_lr_far_too_high, "Adam at lr 0.2"),
    Scenario("hung_job", "F2", SHORT, f2_hung_job, "the loop hangs 5 s at step 60 (F2 timeout 2 s)"),
    # resume sanity (checklist 7.3): 30 steps, torch.save, a resume under the same name forgetting one state
    Scenario("resume_without_scaler", "G1", DEFAULT, lambda: ResumedRun(("scaler",)),
             "resumed without scaler.load_state_dict (scale back at 2^10)"),
    Scenario("resume_without_optimizer", "G2", DEFAULT, lambda: ResumedRun(("optimizer",)),
             "resumed with a fresh AdamW (empty state)"),
    Scenario("resume_without_ema", "G3", DEFAULT, lambda: ResumedRun(("ema",)),
             "resumed with the EMA shadow re-initialised from the weights"),
    Scenario("resume_without_bn_buffers", "G4", DEFAULT, lambda: ResumedRun(("batchnorm",)),
             "resumed with BatchNorm running stats reset"),
    Scenario("resume_without_scheduler", "G5", DEFAULT, lambda: ResumedRun(("scheduler",)),
             "resumed with a fresh warm-up LambdaLR"),
    Scenario("resume_without_rng", "G6", DEFAULT, lambda: ResumedRun(("rng",)),
             "resumed without torch.set_rng_state"),
    Scenario("healthy_mlp_seed0", None, DEFAULT, h_mlp_regression(0), "MLP regression, AdamW 1e-3"),
    Scenario("healthy_mlp_relu_wide", None, DEFAULT, h_mlp_regression(24, hidden=64, depth=3, act=nn.ReLU),
             "wider, deeper ReLU MLP"),
    Scenario("healthy_bn_classifier", None, DEFAULT, h_bn_classifier, "BatchNorm classifier, SGD, cosine to base/10"),
    Scenario("healthy_tiny_transformer", None, DEFAULT, h_tiny_transformer, "pre-norm Transformer LM, AdamW"),
    Scenario("healthy_fp16", None, DEFAULT, h_fp16, "fp16 autocast + GradScaler"),
    Scenario("healthy_mlp_short_windows", None, SHORT, h_mlp_regression(25), "MLP regression, shortened windows"),
    Scenario("healthy_resumed_fully_restored", None, DEFAULT, lambda: ResumedRun(),
             "checkpoint and resume restoring model, optimizer, scheduler, scaler, EMA, BN buffers and RNG"),
]


def _early_warning_scenarios() -> list[Scenario]:
    """The scenarios of every ``tests/scenarios/early_*.py`` module (its ``SCENARIOS`` list): each such
    module also runs on its own, ``python -m tests.scenarios.early_<x> --dry``, to show the pathology
    with plain PyTorch and no agent."""
    found: list[Scenario] = []
    for info in sorted(pkgutil.iter_modules([str(Path(__file__).parent)]), key=lambda m: m.name):
        if info.name.startswith("early_"):
            found += importlib.import_module(f"tests.scenarios.{info.name}").SCENARIOS
    return found


# the early-warning scenarios' faults before the healthy runs, as in the table
_first_healthy = next(i for i, s in enumerate(SCENARIOS) if s.target is None)
SCENARIOS[_first_healthy:_first_healthy] = [s for s in _early_warning_scenarios() if s.target]
SCENARIOS += [s for s in _early_warning_scenarios() if not s.target]
F1_SCENARIO = "one_rank_nan"

RESULTS: dict[str, dict] = {}


@pytest.fixture(scope="module")
def scenario_server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("scenarios")
    rules = tmp / "rules.toml"
    rules.write_text(RULES_FILE)
    srv = LiveServer(db_url=f"sqlite:///{tmp / 'scenarios.db'}", data_dir=tmp, port=free_port(),
                     extra_args=["--rules", str(rules)], env={"GRADWATCH_PUBLIC_URL": "http://gradwatch.test"})
    srv.migrate()
    srv.start()
    yield srv
    srv.stop()
    if len(RESULTS) == len(SCENARIOS) + 1:
        write_confusion_table()


def run_alerts(srv, project: str, run: str, *, settle: float = 0.3) -> list[dict]:
    def run_id():
        _, body = srv.get(f"/api/v1/runs?project={project}")
        return next((r["id"] for r in body["runs"] if r["name"] == run), None)
    rid = wait_until(run_id, timeout=20, what=f"run {run}")
    time.sleep(settle)          # the final batch's rules have run when close() returned; this is slack only
    _, body = srv.get(f"/api/v1/alerts?run={rid}")
    return body["alerts"]


def record(name: str, target: Optional[str], project: str, what: str, alerts: list[dict], info: dict) -> None:
    fired: dict[str, str] = {}
    for a in alerts:
        if a["rule"] not in fired or SEVERITY_RANK[a["severity"]] > SEVERITY_RANK[fired[a["rule"]]]:
            fired[a["rule"]] = a["severity"]
    first = {a["rule"]: a["first_step"] for a in alerts}
    RESULTS[name] = {"target": target, "project": project, "what": what, "fired": fired, "first": first, **info}
    summary = ", ".join(f"{r}:{s}@{first[r]}" for r, s in sorted(fired.items())) or "nothing"
    print(f"\n[scenario] {name:<28} target {target or '-':<3} fired {summary}")


@pytest.mark.parametrize("scenario", SCENARIOS, ids=[s.name for s in SCENARIOS])
def test_scenario(scenario_server, scenario: Scenario):
    loop = scenario.build()
    t0 = time.perf_counter()
    info = loop.run(server=scenario_server.url, project=scenario.project, run=scenario.name)
    info["seconds"] = round(time.perf_counter() - t0, 1)
    losses = info.pop("losses", None)
    alerts = run_alerts(scenario_server, scenario.project, scenario.name)
    if scenario.onset is not None:
        first = min((a["first_step"] for a in alerts if a["rule"] == scenario.target), default=None)
        info["onset"] = scenario.onset(losses)
        info["lead"] = None if first is None or info["onset"] is None else info["onset"] - first
    record(scenario.name, scenario.target, scenario.project, scenario.what, alerts, info)
    if scenario.target is None:
        loud = [(a["rule"], a["severity"], a["message"]) for a in alerts if a["severity"] != "info"]
        assert not loud, f"a healthy run raised alerts: {loud}"
    else:
        fired = {a["rule"]: a for a in alerts}
        assert scenario.target in fired, f"{scenario.target} did not fire; fired: {sorted(fired)}; run: {info}"
        alert = fired[scenario.target]
        assert alert["diagnosis"] and alert["actions"] and alert["evidence"]
    if scenario.onset is not None and scenario.target is not None:
        assert info["onset"] is not None, f"the fault run's loss never spiked or went NaN: {info}"
        assert info["lead"] >= scenario.min_lead, (f"{scenario.target} warned {info['lead']} steps before the loss "
                                                   f"(onset at step {info['onset']}); at least {scenario.min_lead} needed")
    if scenario.target == "A1":
        assert fired["A1"]["evidence"]["cause"] == "loss_computation"     # grad norm was normal before
    if scenario.target == "A3":
        assert fired["A3"]["evidence"]["module"] == "0"                    # RowStandardize is module "0"
    if scenario.target == "B5":
        assert set(fired["B5"]["evidence"]["params"]) == {"side.weight", "side.bias"}
    if scenario.target == "B6":
        assert fired["B6"]["first_step"] >= 60                           # not before the loss shrank
    if scenario.target == "F2":
        assert fired["F2"]["status"] == "resolved"                         # data came back after the hang


# --------------------------------------------------------------------------- F1: two ranks, one feeds NaN

F1_WORKER = r'''
import os, sys, math, torch, torch.nn as nn, torch.nn.functional as F, torch.distributed as dist
sys.path.insert(0, os.environ["REPO"])
from tests.scenarios.training import Loop, mlp, regression_data
rank = int(os.environ["RANK"])
dist.init_process_group("gloo", rank=rank, world_size=2)
torch.manual_seed(30)
model = nn.parallel.DistributedDataParallel(mlp())
data = regression_data(30 + rank)
def batch(step):
    x, y = data(step)
    if rank == 1 and step >= 40:
        x = x * math.nan          # rank 1's data shard is corrupt from step 40 on
    return x, y
Loop(model, torch.optim.Adam(model.parameters(), lr=1e-3), batch, F.mse_loss, steps=70,
     ema_decay=None).run(server=os.environ["SERVER"], project="scenarios", run="one_rank_nan")
dist.destroy_process_group()
'''


def test_f1_one_rank_of_two_feeds_nan(scenario_server, tmp_path):
    script = tmp_path / "rank.py"
    script.write_text(F1_WORKER)
    port = free_port()
    procs = []
    for rank in (0, 1):
        env = {**os.environ, "REPO": str(REPO_ROOT), "SERVER": scenario_server.url, "RANK": str(rank),
               "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}
        procs.append(subprocess.Popen([sys.executable, str(script)], env=env, cwd=REPO_ROOT,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    t0 = time.perf_counter()
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    alerts = run_alerts(scenario_server, "scenarios", F1_SCENARIO, settle=1.0)
    record(F1_SCENARIO, "F1", "scenarios", "2 ranks (DDP, gloo); rank 1's shard is NaN from step 40", alerts,
           {"seconds": round(time.perf_counter() - t0, 1)})
    f1 = [a for a in alerts if a["rule"] == "F1"]
    assert f1 and {a["rank"] for a in f1} == {1}, alerts
    assert f1[0]["first_step"] == 40


def test_a1_scenario_on_both_databases(server_factory, db_url):
    """The NaN-loss scenario end to end on SQLite and on PostgreSQL."""
    srv = server_factory(db_url)
    a1_log_sigmoid_bce().run(server=srv.url, project="db", run="log_sigmoid_bce")
    alerts = {a["rule"]: a for a in run_alerts(srv, "db", "log_sigmoid_bce")}
    assert alerts["A1"]["evidence"]["cause"] == "loss_computation"


# --------------------------------------------------------------------------- the confusion table

def write_confusion_table() -> None:
    held = {s.name for s in SCENARIOS if s.held_out}
    names = [s.name for s in SCENARIOS if s.target and s.name not in held] + [F1_SCENARIO] + \
        [s.name for s in SCENARIOS if not s.target and s.name not in held]
    block = _table_block(names, "Generated by `pytest tests/scenarios`")
    held_names = [s.name for s in SCENARIOS if s.held_out and s.target] + \
        [s.name for s in SCENARIOS if s.held_out and not s.target]
    held_block = _table_block(held_names, "Held-out runs (tests/scenarios/early_heldout.py: models and settings the "
                                          "early-warning thresholds were not tuned on), generated by the same "
                                          "`pytest tests/scenarios`")
    ARTIFACTS.mkdir(exist_ok=True)
    (ARTIFACTS / "confusion.md").write_text(block + "\n" + held_block)
    doc = REPO_ROOT / "docs" / "rules.md"
    if doc.exists():
        text = doc.read_text()
        new = re.sub(r"(<!-- confusion:start -->\n).*?(<!-- confusion:end -->)",
                     lambda m: m.group(1) + block + m.group(2), text, flags=re.S)
        new = re.sub(r"(<!-- heldout:start -->\n).*?(<!-- heldout:end -->)",
                     lambda m: m.group(1) + held_block + m.group(2), new, flags=re.S)
        if new != text:
            doc.write_text(new)
    print("\n" + block + "\n" + held_block)


def _table_block(names: list[str], intro: str) -> str:
    ids = [r.id for r in RULES]
    mark = {"critical": "C", "warning": "W", "info": "i"}
    lines = ["| scenario | target | " + " | ".join(ids) + " | lead | s |",
             "| --- | --- | " + " | ".join("---" for _ in ids) + " | --- | --- |"]
    for name in names:
        r = RESULTS[name]
        cells = []
        for rid in ids:
            sev = r["fired"].get(rid)
            cell = mark[sev] if sev else "·"
            if rid == r["target"]:
                cell = f"**{cell}**" if sev else "**MISSED**"
            cells.append(cell)
        lead = "" if "onset" not in r else ("no onset" if r["onset"] is None else
                                            f"{r['lead']} (loss at {r['onset']})" if r["lead"] is not None else "—")
        lines.append(f"| {name} | {r['target'] or 'healthy'} | " + " | ".join(cells) + f" | {lead} | {r.get('seconds', '')} |")
    hits = sum(1 for n in names if RESULTS[n]["target"] in RESULTS[n]["fired"])
    targets = sum(1 for n in names if RESULTS[n]["target"])
    healthy = [n for n in names if not RESULTS[n]["target"]]
    loud = sum(1 for n in healthy if any(s != "info" for s in RESULTS[n]["fired"].values()))
    stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    table = "\n".join(lines)
    return (f"{intro} on {stamp}: each row is one real training run; "
            f"C / W / i = the rule fired at critical / warning / info, · = silent, **bold** = the rule the "
            f"scenario is about, lead = for an early warning, the steps between its first alert and the first loss spike or NaN (the step in brackets), s = seconds the run took. Target rules fired: {hits}/{targets}; healthy runs "
            f"with an alert above info: {loud}/{len(healthy)}.\n\n{table}\n\nFirst step of each target alert: "
            + ", ".join(f"{n} {RESULTS[n]['target']}@{RESULTS[n]['first'].get(RESULTS[n]['target'])}"
                        for n in names if RESULTS[n]["target"]) + ".\n")
