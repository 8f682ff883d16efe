"""Sampled collectors: activations, NaN origin, inputs, EMA forms, BatchNorm, weights, failures."""
from __future__ import annotations

import copy
import logging
import math

import pytest
import torch

from gradwatch import agent
from agent_helpers import RecordingTransport, ShadowEMA, TinyNet, batches, checklist_step, tiny_loop


def _attach(model, scaler, recorder, settings, **kw):
    return agent.attach(model, scaler, transport=recorder, **{**settings, **kw})


def test_activation_stats_are_sampled_every_k_steps_and_hooks_exist_only_then(recorder, agent_settings):
    model, opt, scaler = tiny_loop()
    seen = {}
    model.fc1.register_forward_hook(lambda m, a, out: seen.setdefault("fc1", []).append(out.detach().clone()))
    monitor = _attach(model, scaler, recorder, agent_settings, activations_every=3)
    for x, y in batches(7):
        checklist_step(model, opt, scaler, x, y)
        assert all(len(m._forward_hooks) == (1 if m is model.fc1 else 0)
                   for m in model.modules() if m is not model)
    monitor.close()
    steps = recorder.steps
    sampled = [s["step"] for s in steps if "act_mean" in s.get("layers", {})]
    assert sampled == [0, 3, 6]
    assert recorder.meta()["module_names"] == ["fc1", "bn", "act", "fc2"]
    for i in sampled:
        layers = steps[i]["layers"]
        out = seen["fc1"][i]
        assert layers["act_mean"][0] == pytest.approx(out.mean().item(), rel=1e-5, abs=1e-7)
        assert layers["act_std"][0] == pytest.approx(out.std(correction=0).item(), rel=1e-5)
        assert layers["act_absmax"][0] == pytest.approx(out.abs().max().item(), rel=1e-6)
        assert layers["act_nonfinite"] == [0, 0, 0, 0]


class Faulty(torch.nn.Module):
    """Produces NaN once ``broken`` is set, like a log() of a value that went negative."""

    def __init__(self):
        super().__init__()
        self.broken = False

    def forward(self, x):
        return torch.log(x - 1e9) if self.broken else x


class FaultyNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(8, 16)
        self.faulty = Faulty()
        self.act = torch.nn.GELU()
        self.fc2 = torch.nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(self.act(self.faulty(self.fc1(x))))


def test_nan_origin_names_the_first_module_that_produced_a_nonfinite_value(recorder, agent_settings):
    torch.manual_seed(0)
    model = FaultyNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu")
    # the hunt over the following steps (the fallback when the failing step cannot be replayed;
    # the replay of the step itself: tests/origin)
    monitor = _attach(model, scaler, recorder, agent_settings, activations_every=0, flush_interval=0.02,
                      nan_replay=False)
    for i, (x, y) in enumerate(batches(12)):
        model.faulty.broken = i >= 4
        checklist_step(model, opt, scaler, x, y)
        if i >= 4:
            monitor.flush(timeout=5)   # lets the sender see the NaN before the next step, as time would
    monitor.close()
    steps = recorder.steps
    assert math.isnan(steps[4]["loss"])
    origins = [e for e in recorder.events if e["kind"] == "nan_origin"]
    assert len(origins) == 1
    assert origins[0]["data"] == {"module": "faulty", "where": "activation"}
    assert origins[0]["step"] > 4
    hunted = steps[origins[0]["step"]]["layers"]
    assert hunted["act_nonfinite"][0] == 0 and hunted["act_nonfinite"][1] > 0
    assert [e for e in recorder.events if e["kind"] == "top_grad_norms" and e["step"] == 4]


def test_nan_origin_is_found_at_once_when_activations_were_sampled_that_step(recorder, agent_settings):
    model = FaultyNet()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    monitor = _attach(model, None, recorder, agent_settings, optimizer=opt, activations_every=1)
    for i, (x, y) in enumerate(batches(4)):
        model.faulty.broken = i == 2
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        monitor.log(loss=loss)
    monitor.close()
    origins = [e for e in recorder.events if e["kind"] == "nan_origin"]
    assert origins and origins[0] == {"step": 2, "kind": "nan_origin",
                                      "data": {"module": "faulty", "where": "activation"}}


def test_nonfinite_values_in_the_input_batch_are_counted_on_sampled_steps(recorder, agent_settings):
    model = TinyNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    scaler = torch.amp.GradScaler("cpu")
    monitor = _attach(model, scaler, recorder, agent_settings, inputs_every=2)
    for i, (x, y) in enumerate(batches(4)):
        if i == 2:
            x = x.clone()
            x[0, :3] = float("nan")
        checklist_step(model, opt, scaler, x, y)
    monitor.close()
    assert [s["input_nonfinite"] for s in recorder.steps] == [0, None, 3, None]


def _ema_forms(model):
    shadow = ShadowEMA(model, decay=0.5)
    swa = torch.optim.swa_utils.AveragedModel(
        model, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(0.5))
    module_copy = copy.deepcopy(model)
    return {
        "dict": (shadow.shadow, lambda: None, lambda: shadow.shadow),
        "shadow-object": (shadow, lambda: shadow.update(model), lambda: shadow.shadow),
        "AveragedModel": (swa, lambda: swa.update_parameters(model), lambda: dict(swa.module.named_parameters())),
        "module": (module_copy, lambda: None, lambda: dict(module_copy.named_parameters())),
    }


@pytest.mark.parametrize("form", ["dict", "shadow-object", "AveragedModel", "module"])
def test_ema_divergence_is_measured_for_each_ema_form(form, recorder, agent_settings):
    torch.manual_seed(0)
    model = TinyNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    scaler = torch.amp.GradScaler("cpu")
    ema, update, weights = _ema_forms(model)[form]
    monitor = _attach(model, scaler, recorder, agent_settings, ema=ema, ema_every=1)
    expected = []
    for x, y in batches(3):
        checklist_step(model, opt, scaler, x, y)
        update()
        w = weights()
        num = math.sqrt(sum((w[n] - p).norm().item() ** 2 for n, p in model.named_parameters()))
        den = math.sqrt(sum(p.norm().item() ** 2 for p in model.parameters()))
        expected.append(num / den)
    monitor.close()
    got = [s["ema_divergence"] for s in recorder.steps]
    assert got == pytest.approx(expected, rel=1e-4)
    assert got[-1] > 0


def test_an_unusable_ema_is_refused_at_attach_with_a_message(agent_settings):
    with pytest.raises(ValueError, match="ema="):
        agent.attach(TinyNet(), ema=object(), **agent_settings)


def test_batchnorm_running_stat_norms_are_sampled(recorder, agent_settings):
    model = TinyNet(bn=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu")
    monitor = _attach(model, scaler, recorder, agent_settings, bn_every=2)
    expected = {}
    for i, (x, y) in enumerate(batches(4)):
        checklist_step(model, opt, scaler, x, y)
        expected[i] = (model.bn.running_mean.norm().item(), model.bn.running_var.norm().item())
    monitor.close()
    assert recorder.meta()["bn_names"] == ["bn"]
    for s in recorder.steps:
        layers = s.get("layers", {})
        if s["step"] % 2:
            assert "bn_mean_norm" not in layers
        else:
            assert layers["bn_mean_norm"] == pytest.approx([expected[s["step"]][0]], rel=1e-5)
            assert layers["bn_var_norm"] == pytest.approx([expected[s["step"]][1]], rel=1e-5)


def test_weight_norms_and_update_ratios_are_sampled(recorder, agent_settings):
    model = TinyNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    monitor = _attach(model, scaler, recorder, agent_settings, weights_every=2)
    expected = {}
    for i, (x, y) in enumerate(batches(4)):
        before = [p.detach().clone() for p in model.parameters()]
        checklist_step(model, opt, scaler, x, y)
        expected[i] = ([p.norm().item() for p in model.parameters()],
                       [(p - b).norm().item() / p.norm().item() for p, b in zip(model.parameters(), before)])
    monitor.close()
    for s in recorder.steps:
        layers = s.get("layers", {})
        if s["step"] % 2:
            assert "weight_norm" not in layers
        else:
            assert layers["weight_norm"] == pytest.approx(expected[s["step"]][0], rel=1e-5)
            assert layers["update_ratio"] == pytest.approx(expected[s["step"]][1], rel=1e-3)


class SparseOut(torch.nn.Module):
    """A real module whose output the activation statistics cannot handle (sparse)."""

    def forward(self, x):
        return x.to_sparse()


class SparseNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(8, 4)
        self.sparse = SparseOut()

    def forward(self, x):
        return self.sparse(self.fc1(x)).to_dense()


class FlakyEMA:
    """A user EMA whose ``shadow`` breaks after a while (e.g. a refactor mid-run)."""

    def __init__(self, model):
        self._shadow = {n: p.detach().clone() for n, p in model.named_parameters()}
        self.reads = 0

    @property
    def shadow(self):
        self.reads += 1
        if self.reads > 3:
            raise RuntimeError("shadow moved to another device group")
        return self._shadow


def test_a_failing_collector_is_logged_once_turns_itself_off_and_training_goes_on(recorder, agent_settings,
                                                                                  caplog):
    model = SparseNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu")
    ema = FlakyEMA(model)
    caplog.set_level(logging.WARNING, logger="gradwatch.agent")
    monitor = _attach(model, scaler, recorder, agent_settings, ema=ema, ema_every=1, activations_every=1)
    for x, y in batches(6, d_out=4):
        checklist_step(model, opt, scaler, x, y)
    monitor.close()
    steps = recorder.steps
    assert [s["step"] for s in steps] == list(range(6))
    assert all(s["loss"] is not None and s["grad_norm"] is not None for s in steps)
    messages = [r.getMessage() for r in caplog.records]
    assert sum("ema collector failed" in m for m in messages) == 1
    assert sum("activations collector failed" in m for m in messages) == 1
    assert steps[-1]["ema_divergence"] is None
    assert "act_mean" not in steps[-1].get("layers", {})
    for m in model.modules():
        assert not m._forward_hooks


def test_logged_tensors_and_numbers_arrive_as_custom_scalars(recorder, agent_settings):
    model = TinyNet()
    opt = torch.optim.SGD([{"params": model.fc1.parameters(), "lr": 0.1},
                           {"params": model.fc2.parameters(), "lr": 0.01}])
    scaler = torch.amp.GradScaler("cpu")
    monitor = _attach(model, scaler, recorder, agent_settings)
    for x, y in batches(2):
        checklist_step(model, opt, scaler, x, y)
        monitor.log(acc=torch.tensor(0.75), tokens_seen=128)
    monitor.close()
    for s in recorder.steps:
        assert s["custom"] == {"acc": 0.75, "tokens_seen": 128.0, "lr/1": 0.01}
        assert s["lr"] == 0.1


def test_tokens_per_second_is_inferred_from_token_id_inputs(recorder, agent_settings):
    class TinyLM(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(50, 8)
            self.head = torch.nn.Linear(8, 50)

        def forward(self, idx):
            return self.head(self.embed(idx))

    model = TinyLM()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    monitor = _attach(model, None, recorder, agent_settings, optimizer=opt)
    for _ in range(3):
        idx = torch.randint(0, 50, (4, 6))
        loss = torch.nn.functional.cross_entropy(model(idx).view(-1, 50), idx.view(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        monitor.log(loss=loss)
    monitor.close()
    for s in recorder.steps[1:]:
        assert s["samples_per_s"] > 0 and s["tokens_per_s"] == pytest.approx(6 * s["samples_per_s"])


class EmbeddingNet(torch.nn.Module):
    """Rows of the embedding that a batch does not use get exactly zero gradient."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(50, 8)
        self.fc = torch.nn.Linear(8, 4)
        self.unused = torch.nn.Linear(4, 4)      # never called: its parameters have no grad

    def forward(self, tokens):
        return self.fc(self.emb(tokens).mean(dim=1))


def test_the_zero_gradient_share_equals_pytorchs_count_per_parameter_and_overall(recorder, agent_settings):
    torch.manual_seed(0)
    model = EmbeddingNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    monitor = _attach(model, scaler, recorder, agent_settings, weights_every=2)
    expected = {}
    for i in range(5):
        tokens = torch.randint(0, 10 + 5 * i, (4, 6))            # a growing share of the rows is used
        opt.zero_grad()
        loss = model(tokens).pow(2).mean()
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        grads = [p.grad for p in model.parameters()]
        expected[i] = ([None if g is None else (g == 0).float().mean().item() for g in grads],
                       sum(int((g == 0).sum()) for g in grads if g is not None) /
                       sum(g.numel() for g in grads if g is not None))
    monitor.close()
    seen = 0
    for s in recorder.steps:
        layers = s.get("layers", {})
        if s["step"] % 2:
            assert "grad_zero_fraction" not in layers and s.get("grad_zero_fraction") is None
            continue
        per, overall = expected[s["step"]]
        got = layers["grad_zero_fraction"]
        assert [g is None for g in got] == [e is None for e in per]
        assert [g for g in got if g is not None] == pytest.approx([e for e in per if e is not None], rel=1e-6)
        assert s["grad_zero_fraction"] == pytest.approx(overall, rel=1e-6)
        assert per[0] > 0.5 and per[-1] is None          # the embedding's unused rows; the unused layer
        seen += 1
    assert seen == 3


def test_scatter_measured_places_each_value_at_its_slot_in_any_order():
    """The per-layer arrays' "not measured" scatter (collectors.base): the values of a subset of slots, or
    of every slot in another order (attention sites grouped by shape), each land on their own slot."""
    import struct

    from gradwatch.agent.collectors.base import device_index, scatter_measured
    from gradwatch.agent.nonfinite import NULL_F32_BITS

    def bits(x: float) -> int:
        return struct.unpack("<I", struct.pack("<f", x))[0]
    everything = scatter_measured(torch.tensor([1.0, 2.0, 3.0]), [2, 0, 1], 3)
    assert everything.tolist() == [2.0, 3.0, 1.0]
    ordered = torch.tensor([4.0, 5.0], dtype=torch.float64)
    assert scatter_measured(ordered, [0, 1], 2).dtype == torch.float32
    some = scatter_measured(torch.tensor([7.0, 9.0]), [3, 1], 5)
    assert [bits(v) for v in some.tolist()] == [NULL_F32_BITS, bits(9.0), NULL_F32_BITS, bits(7.0), NULL_F32_BITS]
    assert device_index([3, 1], torch.device("cpu")) is device_index((3, 1), torch.device("cpu"))   # cached
