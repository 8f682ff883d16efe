"""Collectors write the signal table's own names (agent/signals.py), and declare them: a misnamed part
fails at attach instead of going missing from a run; the wire step is read off the table."""
from __future__ import annotations

import math

import pytest
import torch

from gradwatch import agent
from gradwatch.agent import collectors as collector_kinds
from gradwatch.agent.collectors.base import Collector
from gradwatch.agent.config import EVERY_STEP, AgentConfig
from gradwatch.agent.monitor import Monitor
from gradwatch.agent.record import StepRecord
from gradwatch.agent.sealer import Sealer
from gradwatch.agent.step_builder import StepBuilder
from gradwatch.agent.derived import DERIVE
from gradwatch.agent.signals import (CUSTOM_PART_PREFIX, LAYER_STATS, STEP_SIGNALS, derived_inputs,
                                     unknown_record_names)
from agent_helpers import ShadowEMA, TinyNet, batches, checklist_step

# what the step builder and the sealer themselves write (agent/step_builder.py, agent/sealer.py), beside the
# collectors: the loss, the skip guard's decision, the host clocks (declared like a collector's, agent/owners.py)
BUILDER_NAMES = set(StepBuilder.emits) | set(Sealer.emits)


def _config(settings: dict) -> AgentConfig:
    return AgentConfig.from_sources({**settings, "mode": "disabled"}, env={})


class Misnamed(Collector):
    name = "misnamed"
    emits = ("grad_norms",)     # the private name the wire step used to rename by hand


def test_a_collector_emitting_a_name_the_table_does_not_declare_fails_at_attach(agent_settings):
    with pytest.raises(ValueError, match="emits 'grad_norms', which the signal table"):
        Monitor(TinyNet(), collectors=collector_kinds.DEFAULT + (Misnamed,), config=_config(agent_settings))


def test_a_derived_signal_is_computed_not_emitted(agent_settings):
    class Clips(Collector):
        name = "clips"
        emits = ("clipped",)     # derived from grad_norm and clip_max_norm (agent/derived.py)

    with pytest.raises(ValueError, match="'clipped'"):
        Monitor(TinyNet(), collectors=(Clips,), config=_config(agent_settings))


def test_every_derived_signal_has_its_one_function_and_inputs_named_in_the_table():
    derived = [d.name for d in (*STEP_SIGNALS, *LAYER_STATS) if d.derived_from]
    # grad_zero_fraction is both a step signal and a per-layer statistic: one function, numbers or sequences
    assert sorted(set(derived)) == sorted(DERIVE) == ["clipped", "ema_divergence", "grad_zero_fraction",
                                                      "update_ratio"]
    assert set(derived_inputs()) == {"ema_diff", "ema_ref", "layers.update_norm", "grad_zero_count", "numel",
                                     "layers.grad_zero_count", "layers.numel"}
    assert unknown_record_names([n for d in (*STEP_SIGNALS, *LAYER_STATS) for n in d.derived_from]) == []


def _recording(kind: type) -> type:
    """``kind`` with its step-end and seal parts recorded per collector class."""
    def names_added(rec, before_parts, before_host):
        return ({k for k, _ in rec.parts[before_parts:]}
                | {k for k in rec.host if k not in before_host and rec.host[k] is not None})

    def end_step(self, step, rec):
        n, host = len(rec.parts), set(rec.host)
        kind.end_step(self, step, rec)
        ADDED.setdefault(kind, set()).update(names_added(rec, n, host))

    def at_seal(self, rec, in_training_thread, submit):
        n, host = len(rec.parts), set(rec.host)
        taken = kind.at_seal(self, rec, in_training_thread, submit)
        ADDED.setdefault(kind, set()).update(names_added(rec, n, host))
        return taken

    return type(kind.__name__, (kind,), {"end_step": end_step, "at_seal": at_seal})


ADDED: dict[type, set] = {}
# host values the step's plumbing carries besides signals (never on the wire under their own name); the rest of
# it travels in the record's named fields (losses, custom values, reports, scaler state, the NaN replay's finding)
PLUMBING = {"events", "time"}


def test_every_collector_writes_only_the_names_it_declares_and_every_part_is_the_tables(recorder, agent_settings,
                                                                                       monkeypatch):
    """A real loop with every collector on every step (GradScaler, clipping, EMA, BatchNorm, AdamW): what
    each collector adds to the records is among its ``emits``, and every part any record holds is a name
    of the signal table, so the wire step loses nothing."""
    ADDED.clear()
    torch.manual_seed(0)
    model = TinyNet(bn=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu")
    ema = ShadowEMA(model)
    kinds = tuple(_recording(k) for k in collector_kinds.DEFAULT)
    parts: set = set()    # of every sealed record, whichever thread added them (a CPU model's EMA: its worker)
    seal = StepRecord.seal

    def recorded_seal(rec):
        parts.update(k for k, _ in rec.parts)
        seal(rec)

    monkeypatch.setattr(StepRecord, "seal", recorded_seal)
    monitor = Monitor(model, scaler, optimizer=opt, ema=ema, transport=recorder, collectors=kinds,
                      config=AgentConfig.from_sources({**agent_settings, **EVERY_STEP}, env={}))
    for x, y in batches(4):
        checklist_step(model, opt, scaler, x, y, ema=ema)
    monitor.close()
    assert not monitor._disabled, monitor._disabled
    assert len(recorder.steps) == 4

    for kind, added in ADDED.items():
        declared = set(kind.emits)
        if declared:   # a collector that declares nothing is held to the table below
            assert added <= declared | PLUMBING, (kind.__name__, added - declared)
        assert unknown_record_names(sorted(added - PLUMBING)) == [], kind.__name__
    written = {n for added in ADDED.values() for n in added} | parts
    assert unknown_record_names(sorted(n for n in written - PLUMBING if not n.startswith(CUSTOM_PART_PREFIX))) == []
    seen = written
    for expected in ("grad_norm", "layers.grad_norm", "loss_scale", "overflow", "layers.weight_norm",
                     "layers.update_norm", "layers.act_std", "layers.bn_var_norm", "ema_diff", "ema_ref",
                     "input_nonfinite", "lr", "adam_g2_over_v_max", "layers.linear_out_rms"):
        assert expected in seen, expected
    assert BUILDER_NAMES & parts == {"loss"}
    assert BUILDER_NAMES == {"loss", "skipped_update", "step_time", "data_time", "samples_per_s", "tokens_per_s"}


def test_the_wire_step_holds_the_derived_signals_from_the_one_function(recorder, agent_settings):
    """clipped, ema_divergence and update_ratio on the wire equal agent/derived.py's values of the measured
    inputs, computed here from PyTorch's own numbers."""
    torch.manual_seed(0)
    model = TinyNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    scaler = torch.amp.GradScaler("cpu")
    ema = ShadowEMA(model)
    monitor = agent.attach(model, scaler, optimizer=opt, ema=ema, transport=recorder, weights_every=1, ema_every=1,
                           **agent_settings)
    expected = []
    for x, y in batches(3):
        before = [p.detach().clone() for p in model.parameters()]
        _, total = checklist_step(model, opt, scaler, x, y, ema=ema, max_norm=0.2)
        ups = [float((p.detach() - b).norm()) for p, b in zip(model.parameters(), before)]
        ws = [float(p.detach().norm()) for p in model.parameters()]
        diff = math.sqrt(sum(float((ema.shadow[n] - p.detach()).pow(2).sum()) for n, p in model.named_parameters()))
        ref = math.sqrt(sum(float(p.detach().pow(2).sum()) for p in model.parameters()))
        expected.append((float(total), DERIVE["update_ratio"](ups, ws), DERIVE["ema_divergence"](diff, ref)))
    monitor.close()
    steps = recorder.steps
    assert len(steps) == 3 and any(s["clipped"] for s in steps)
    for s, (total, ratios, divergence) in zip(steps, expected):
        assert s["clipped"] is DERIVE["clipped"](total, 0.2)
        assert s["layers"]["update_ratio"] == pytest.approx(ratios, rel=1e-4)
        assert s["ema_divergence"] == pytest.approx(divergence, rel=1e-4)
