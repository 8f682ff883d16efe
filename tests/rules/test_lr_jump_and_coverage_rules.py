"""H10 (an abrupt learning-rate jump) and H11 (a Transformer whose attention logits nobody measures) through
the real ingest path; the end-to-end coverage (a real agent, a real server, the run API) is
tests/agent/test_attention_coverage.py."""
from __future__ import annotations

import math

from tests.rules.conftest import run_name, step


def lr_steps(lr_of, n: int = 200) -> list[dict]:
    return [step(i, loss=2.0 * math.exp(-i / 300) + 0.3, grad_norm=0.5, lr=lr_of(i)) for i in range(n)]


def test_h10_names_the_old_and_new_lr_of_a_tenfold_jump(rdb):
    name = run_name()
    rdb.feed(name, lr_steps(lambda i: 1e-3 if i < 120 else 1e-2), batch=33)
    a = rdb.rules(name)["H10"]
    assert a.severity == "warning" and a.first_step == 120
    assert a.evidence["lr_before"] == 1e-3 and a.evidence["lr"] == 1e-2 and a.evidence["step_before"] == 119
    assert "from 0.001 at step 119 to 0.01 at step 120" in a.message and "10x" in a.message


def test_h10_stays_quiet_through_a_warmup_a_decay_and_a_step_schedule(rdb):
    warm = run_name()
    rdb.feed(warm, lr_steps(lambda i: 1e-3 * min(1.0, i / 50)), batch=40)          # from 0: 0 -> 2e-5 is no jump
    steps = run_name()
    rdb.feed(steps, lr_steps(lambda i: 1e-2 * 0.1 ** (i // 60)), batch=40)         # StepLR: / 10 every 60 steps
    cosine = run_name()
    rdb.feed(cosine, lr_steps(lambda i: 1e-3 * (1 + (i + 1) / 200)), batch=40)    # a warm-up from base/200 on
    assert "H10" not in rdb.rules(warm) and "H10" not in rdb.rules(steps) and "H10" not in rdb.rules(cosine)


def test_h10_leaves_a_declared_restarting_schedule_alone(rdb):
    name = run_name()
    setup = {"step": 0, "kind": "run_setup", "data": {"scheduler": {"class": "CosineAnnealingWarmRestarts",
                                                                    "cosine": True}}}
    rdb.feed(name, lr_steps(lambda i: 1e-3 * (0.5 * (1 + math.cos(math.pi * (i % 50) / 50)) + 1e-4)), batch=40,
             events=[setup])
    assert "H10" not in rdb.rules(name)


def coverage(step_: int, measured: list[str], transformer: bool) -> dict:
    return {"step": step_, "kind": "attention_coverage",
            "data": {"measured": measured, "count": len(measured), "named": [], "transformer": transformer,
                     "attention_like": ["blocks.0.attn: Attention"] if transformer else []}}


def test_h11_says_when_a_transformer_has_no_attention_measured_and_clears_when_it_has(rdb):
    name = run_name()
    rdb.feed(name, lr_steps(lambda i: 1e-3, n=20), events=[coverage(0, [], True)])
    a = rdb.rules(name)["H11"]
    assert a.severity == "info" and a.first_step == 0 and a.evidence["attention_like"] == ["blocks.0.attn: Attention"]
    assert "attention_modules=" in a.message and any("attention_modules=" in x for x in a.actions)
    fine = run_name()
    rdb.feed(fine, lr_steps(lambda i: 1e-3, n=20), events=[coverage(0, ["blocks.0.attn"], True)])
    mlp = run_name()
    rdb.feed(mlp, lr_steps(lambda i: 1e-3, n=20), events=[coverage(0, [], False)])
    assert "H11" not in rdb.rules(fine) and "H11" not in rdb.rules(mlp)


def test_h10_leaves_a_resumed_process_s_first_steps_to_the_resume_rules(rdb):
    """A fresh optimizer and a restored scheduler set the LR twice as a resumed process starts (G2 / G5's
    matter); a jump later in that process is H10's."""
    name = run_name()
    resumed = {"step": 100, "kind": "resume_state", "data": {}}
    rdb.feed(name, lr_steps(lambda i: 1e-3 if i < 100 else 1e-4 if i == 100 else 2e-3 if i < 150 else 2e-2),
             batch=30, events=[resumed])
    a = rdb.rules(name)["H10"]
    assert a.first_step == 150 and a.evidence["lr_before"] == 2e-3
