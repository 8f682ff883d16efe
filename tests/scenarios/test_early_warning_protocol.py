"""The early-warning evaluation protocol's own machinery (bench/early_warning, docs/early-warning.md), on a
CI-sized slice: one generated case, divergent and control, through the real agent to a real server.

What is checked is the machinery, not a figure: the divergence rule, the frozen split (its hash), the
oracle (bench/early_warning/oracle.py, independent of the agent) against the agent's stored values on the
sampled steps, and the lead and oracle-lead computations against the alerts the server stored.
"""
from __future__ import annotations

import hashlib
import json
import math
from collections import Counter

import pytest
import torch

from bench.early_warning import models, report, sweep
from bench.early_warning.divergence import diverged_at, learned
from bench.early_warning.space import (BUDGET, CONTROL_DIVISOR, EARLIEST, HFMOE_ARCHS, HFMOE_FIRST, HFMOE_N,
                                       KINDS_ARCHS, KINDS_FIRST, KINDS_N, LEARNED,
                                       MOE_ARCHS, MOE_FIRST, MOE_N, NOATTN_ARCHS, NOATTN_FIRST, NOATTN_N, PRECISIONS,
                                       draw)

# the split committed in cf1ec9a, before any tuning: it must never change
SPLIT_SHA256 = "6ff479e9243d0dc5658e9f934dcb40e114c4ec7e750c85660bd17c78987a4eb1"
# a tuning-half case that the blind LR search (sweep.lr_search) lands at this LR (bench/early_warning/results.jsonl)
CASE, LR = 4, 2.080830178640878


def test_the_divergence_rule():
    assert diverged_at([3.0, 2.0, 1.0, 1.6, 1.7, 1.8, 1.9, 2.0]) == 3      # 5 in a row above 1.5 x the min
    assert diverged_at([3.0, 2.0, 1.0, 1.6, 1.7, 1.8, 1.9, 1.4, 1.6]) is None   # 4 in a row only
    assert diverged_at([3.0, 2.0, 1.0, 1.5, 1.5, 1.5, 1.5, 1.5]) is None    # at 1.5 x, not above
    assert diverged_at([3.0, 1.0, 1.6, float("inf")]) == 3                  # the first non-finite loss
    assert diverged_at([3.0, 1.1, 1.7, 1.7, 1.6, 1.7, 1.7]) is None        # 1.6 is not above 1.5 x 1.1
    assert diverged_at([3.0, 1.1, 1.7, 1.7, 1.7, 1.7, 1.7]) == 2
    assert learned([3.0, 2.5, 9.0], until=2, fraction=0.85) and not learned([3.0, 2.9, 9.0], until=2)


def test_the_split_is_the_frozen_one():
    raw = sweep.SPLIT.read_bytes()
    assert hashlib.sha256(raw).hexdigest() == SPLIT_SHA256
    split = json.loads(raw)
    assert not set(split["tuning"]) & set(split["held_out"])
    assert sorted(split["tuning"] + split["held_out"]) == list(range(100)) and len(split["tuning"]) == 50
    assert CASE in split["tuning"]


def stored_logits_match_the_oracle(srv, name: str, run: dict) -> int:
    """Asserts that the server's stored max attention logit of run ``name`` (the largest over its modules) equals
    the oracle's true max logit (``run["logits"]``, oracle.py) at every sampled step; returns how many steps it
    compared."""
    _, runs = srv.get(f"/api/v1/runs?project={sweep.PROJECT}")
    rid = {r["name"]: r["id"] for r in runs["runs"]}[name]
    status, m = srv.get(f"/api/v1/runs/{rid}/layers?stat=attn_logit_max&max_steps=10000&max_layers=10000")
    assert status == 200 and m["bucket_size"] == 1
    truth = report.true_max(run)
    compared = 0
    for c, step in enumerate(m["steps"]):               # values: one row per module, one column per step
        vals = [row[c] for row in m["values"] if isinstance(row[c], (int, float)) and math.isfinite(row[c])]
        if vals and step < len(truth) and math.isfinite(truth[step]):
            assert max(vals) == pytest.approx(truth[step], rel=1e-3), step
            compared += 1
    return compared


def test_a_generated_case_through_agent_and_server(server_factory, sqlite_url):
    srv = server_factory(sqlite_url)
    case = draw(CASE)
    assert case.arch == "sdpa_alibi" and case.optimizer == "sgd_momentum"
    div = sweep.train(case, LR, BUDGET, server=srv.url, run="div")
    ctl = sweep.train(case, LR / CONTROL_DIVISOR, BUDGET, server=srv.url, run="ctl", stop_after_divergence=False)
    d = div["diverged_at"]
    losses = [math.nan if x is None else x for x in div["losses"]]
    # the run diverges inside the window after learning, and stopped 5 steps after the divergence step
    assert d is not None and EARLIEST <= d < BUDGET and learned(losses, d, LEARNED)
    assert div["steps"] == d + 5 and diverged_at(losses) == d
    assert all(x > 1.5 * min(losses[:d]) for x in losses[d:d + 5])
    # the control trains the whole budget, learns and does not diverge
    assert ctl["steps"] == BUDGET and ctl["diverged_at"] is None
    assert learned([math.nan if x is None else x for x in ctl["losses"]], None, LEARNED)

    # the oracle, recorded beside the agent, equals the agent's stored max attention logit where it sampled
    assert stored_logits_match_the_oracle(srv, "div", div) >= 3

    # the lead: divergence step minus the first alert above info of the rule, none when after it
    div["alerts"] = sweep.alerts_of(srv.url, "div")
    ctl["alerts"] = sweep.alerts_of(srv.url, "ctl")
    loud = [a for a in div["alerts"] if a["severity"] != "info"]
    assert loud, "the divergent run raised nothing: the lead computation is not exercised"
    for rule in {a["rule"] for a in loud}:
        first = min(a["first_step"] for a in loud if a["rule"] == rule)
        assert report.lead(d, report.first_warning(div["alerts"], [rule])) == (d - first if first <= d else None)
    assert report.lead(100, 101) is None and report.lead(100, 40) == 60
    # H13 knew the optimizer from the agent's run_setup event (SGD: a doubling limit of 10 steps, where any run
    # that did not say would get the adaptive 5): it warned the divergent run well ahead, and not the control,
    # whose fastest doubling at the agent's samples is ~15 steps
    h13 = [a for a in div["alerts"] if a["rule"] == "H13"]
    assert h13 and all("healthy run with this optimizer (sgd)" in a["message"] for a in h13), h13
    assert report.lead(d, report.first_warning(div["alerts"], ["H13"])) >= 20
    assert not [a for a in ctl["alerts"] if a["rule"] == "H13"]
    # the oracle lead: the first step above the control's highest true logit
    hi = max(v for v in report.true_max(ctl) if math.isfinite(v))
    above = next((s for s, v in enumerate(report.true_max(div)) if s <= d and v > hi), None)
    got = report.oracle_lead({"divergent": div, "control": ctl})
    assert got == (None if above is None else d - above)
    s = report.summary([10, None, 60, 30])
    assert (s["warned"], s["misses"], s["median"], s["p25"], s["ge20"], s["ge50"]) == (3, 1, 10, "miss", 2, 1)


# the later spaces' splits (space.py), each committed alone before any sweep of its ids: the other kinds (ids
# 100-159, in 2b91248), no attention (ids 200-279, in 8d90954) and mixture of experts (ids 300-359)
LATER_SPLITS = [("kinds", "7bfa76e41e50532dcf72cb042ca4590132b97e247508c5042e15400b78a6e3cf", KINDS_FIRST, KINDS_N),
                ("noattn", "3e6dd2ea6b38b369a075a443950a6775e6dd6d9b796be55554759cd0e58a992e", NOATTN_FIRST, NOATTN_N),
                ("moe", "ec7ff81d542884f511c09e346e8d4e435bac6d3b8a1a5a6984f0a9a2a0d95e67", MOE_FIRST, MOE_N),
                # Hugging Face's MoEs (ids 400-439): every id held out, none tuned on
                ("hfmoe", "e00ee91795d386b89f522426e3e3a06ebb0de5084ffb8f833eda39baba257058", HFMOE_FIRST, HFMOE_N)]


@pytest.mark.parametrize("name, sha256, first, n", LATER_SPLITS)
def test_the_later_splits_are_the_frozen_ones(name, sha256, first, n):
    raw = sweep.SPLITS[name].read_bytes()
    assert hashlib.sha256(raw).hexdigest() == sha256
    split = json.loads(raw)
    assert not set(split["tuning"]) & set(split["held_out"])
    assert len(split["tuning"]) == (0 if name == "hfmoe" else n // 2)
    assert sorted(split["tuning"] + split["held_out"]) == list(range(first, first + n)) == sweep.case_ids(name)
    halves = sweep.halves()                       # every split, as report.split_cases reads them
    assert sorted(halves) == (list(range(KINDS_FIRST + KINDS_N)) + list(range(NOATTN_FIRST, NOATTN_FIRST + NOATTN_N))
                              + list(range(MOE_FIRST, MOE_FIRST + MOE_N))
                              + list(range(HFMOE_FIRST, HFMOE_FIRST + HFMOE_N)))
    assert sweep.case_ids(None) == list(range(100))


def test_the_other_kinds_space():
    drawn = Counter((draw(i).arch, draw(i).precision) for i in range(KINDS_FIRST, KINDS_FIRST + KINDS_N))
    assert drawn == {(a, p): 5 for a in KINDS_ARCHS for p in PRECISIONS}
    assert {draw(i).precision for i in range(100)} == {"fp32"}
    with pytest.raises(ValueError, match="case ids run"):
        draw(KINDS_FIRST + KINDS_N)
    drawn = Counter((draw(i).arch, draw(i).precision) for i in range(NOATTN_FIRST, NOATTN_FIRST + NOATTN_N))
    assert drawn == {(a, p): 10 for a in NOATTN_ARCHS for p in PRECISIONS}
    drawn = Counter((draw(i).arch, draw(i).precision) for i in range(MOE_FIRST, MOE_FIRST + MOE_N))
    assert drawn == {(a, p): 10 for a in MOE_ARCHS for p in PRECISIONS}
    drawn = Counter((draw(i).arch, draw(i).precision) for i in range(HFMOE_FIRST, HFMOE_FIRST + HFMOE_N))
    assert drawn == {(a, p): 5 for a in HFMOE_ARCHS for p in PRECISIONS}


@pytest.mark.parametrize("case_id, lr", [(100, 0.3), (106, 0.01), (107, 0.02), (201, 0.3), (202, 0.005),
                                        (203, 0.003), (205, 0.003), (206, 0.003), (207, 0.005), (300, 0.005),
                                        (301, 0.005), (304, 0.3), (403, 0.01), (405, 0.01)])
def test_the_other_kinds_learn_in_their_precision(case_id, lr):
    """No attention (an MLP, a CNN, a GRU) and a mixture of experts (moe_lm, and with no attention moe_mlp_lm with a
    top-1 router and moe2_mlp_lm with a top-2 one; Hugging Face's Switch Transformers and Qwen2-MoE) learn the
    task; a bf16 case's forward
    runs under bf16 autocast (its last Linear's output is bf16), an fp32 case's does not."""
    case = draw(case_id)
    assert (case.arch, case.precision) == {100: ("mlp_lm", "fp32"), 106: ("mlp_lm", "bf16"),
                                           107: ("moe_lm", "bf16"), 201: ("mlp_cls", "fp32"),
                                           202: ("conv_cls", "fp32"), 203: ("gru_lm", "fp32"),
                                           205: ("mlp_cls", "bf16"), 206: ("conv_cls", "bf16"),
                                           207: ("gru_lm", "bf16"), 300: ("moe_mlp_lm", "fp32"),
                                           301: ("moe2_mlp_lm", "fp32"), 304: ("moe2_mlp_lm", "bf16"),
                                           403: ("hf_switch", "fp32"), 405: ("hf_qwen2_moe", "bf16")}[case_id]
    model, batch, _ = models.build(case)
    out = models.forward(model, case, batch(0))
    out = getattr(out, "logits", out)            # a Hugging Face language model's output
    assert out.dtype == (torch.bfloat16 if case.precision == "bf16" else torch.float32)
    r = sweep.train(case, lr, 100)          # case 107 warms up over 400 steps: its LR is still small here
    assert r["diverged_at"] is None and r["losses"][-1] < 0.95 * r["losses"][0], r["losses"][::10]


def test_a_mixture_of_experts_in_bf16_through_agent_and_server(server_factory, sqlite_url):
    """The agent measures the MoE Transformer's attention under bf16 autocast as the oracle records it."""
    srv = server_factory(sqlite_url)
    case = draw(107)
    run = sweep.train(case, 0.005, 60, server=srv.url, run="moe")
    assert stored_logits_match_the_oracle(srv, "moe", run) >= 3


@pytest.mark.parametrize("case_id, lr", [(301, 0.02), (305, 0.02), (400, 0.02), (407, 0.02)])
def test_a_routers_spread_through_agent_and_server(server_factory, sqlite_url, case_id, lr):
    """The agent measures each MoE router's logit spread (max - min of one token's logits, the largest over the
    tokens and routers) as this benchmark's own mode records it (router.py, written apart from the agent), at
    every sampled step: a top-2 router with no attention (301, fp32) and a top-1 Switch router behind attention
    under bf16 autocast (305), Hugging Face's Mixtral (400, fp32) and Switch Transformers (407, bf16: its router
    softmaxes over ``[batch, seq, experts]`` and casts back before its argmax); the layer is credited to the
    module that calls the softmax."""
    from bench.early_warning.router import RouterLogits, series

    srv = server_factory(sqlite_url)
    case = draw(case_id)
    assert (case.arch, case.precision) == {301: ("moe2_mlp_lm", "fp32"), 305: ("moe_lm", "bf16"),
                                           400: ("hf_mixtral", "fp32"), 407: ("hf_switch", "bf16")}[case_id]
    oracle = RouterLogits()
    run = sweep.train(case, lr, 60, server=srv.url, run="router", oracle=oracle)
    truth = series({"router": oracle.steps}, "spread")
    if case.arch != "moe2_mlp_lm":
        # the attention beside the router: the agent's and the oracle's, neither taking the router's softmax
        # for attention (Switch's is 3-D, as attention's can be; a router's logits run larger than these)
        assert stored_logits_match_the_oracle(srv, "router", run) >= 3
    _, runs = srv.get(f"/api/v1/runs?project={sweep.PROJECT}")
    rid = {r["name"]: r["id"] for r in runs["runs"]}["router"]
    status, m = srv.get(f"/api/v1/runs/{rid}/layers?stat=router_logit_spread&max_steps=10000&max_layers=10000")
    assert status == 200 and m["bucket_size"] == 1
    measured = [name for name, row in zip(m["layers"], m["values"])
                if any(isinstance(v, (int, float)) for v in row)]
    where = {"hf_mixtral": "model.layers.{}.mlp.gate", "hf_switch": "encoder.encoder.block.{}.layer.1.mlp.router"}
    assert measured == [where.get(case.arch, "blocks.{}.mlp").format(i) for i in range(case.depth)], measured
    compared = 0
    for c, step in enumerate(m["steps"]):
        vals = [row[c] for row in m["values"] if isinstance(row[c], (int, float)) and math.isfinite(row[c])]
        if vals:
            assert max(vals) == pytest.approx(truth[step], rel=1e-4), step
            compared += 1
    assert compared >= 3


def test_the_profiles_parse_and_the_balanced_one_gates_h12_at_h13s_limits():
    """bench/early_warning/profiles (docs/early-warning.md, the quiet and balanced profiles): each is a valid rules
    file, and the balanced one gates H12 at H13's own limits, so a change to H13's defaults shows here."""
    from pathlib import Path

    from gradwatch.server.rules.catalog.early_forecast import AttentionLogitRunaway
    from gradwatch.server.rules.config import parse_rules_toml

    folder = Path(sweep.__file__).parent / "profiles"
    parsed = {p.stem: parse_rules_toml(p.read_text()).every_project for p in sorted(folder.glob("*.toml"))}
    assert set(parsed) == {"balanced", "quiet"}
    assert parsed["quiet"] == {"H2": {"severity": "info"}, "H12": {"severity": "info"}}
    h13 = {k: p.default for k, p in AttentionLogitRunaway.params.items()}
    limits = {k: v for k, v in h13.items() if k.startswith("doubling_")}
    assert parsed["balanced"] == {"H2": {"severity": "info"}, "H12": limits}
