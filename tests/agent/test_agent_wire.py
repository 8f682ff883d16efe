"""What the agent puts on the wire: compact per-layer arrays, strict JSON, null fields left out;
and flush / close racing the sender thread's seal of a stale step."""
from __future__ import annotations

import json
import math
import threading
import time

import numpy as np
import pytest
import torch

from gradwatch import agent
from gradwatch.agent.transport import Delivery
from agent_helpers import RecordingTransport, batches, checklist_step, decode_step
from gradwatch.server.wire.numbers import NULL_F32_BITS, null_mask, unpack_f32_b64, unpack_layer_values


class RawTransport(RecordingTransport):
    """Keeps the exact bodies too, to check them as bytes."""

    def __init__(self):
        super().__init__()
        self.raw: list[bytes] = []

    def post(self, body: bytes) -> Delivery:
        self.raw.append(body)
        return super().post(body)


class PartlyUsedNet(torch.nn.Module):
    """``spare`` never runs: its parameters get no grad and its activations are never measured."""

    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(8, 16)
        self.spare = torch.nn.Linear(16, 16)
        self.fc2 = torch.nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def _strict_json(body: bytes) -> dict:
    def refuse(token):
        raise AssertionError(f"bare {token} token in the body: not strict JSON")
    return json.loads(body, parse_constant=refuse)


def _server_array(text: str) -> tuple[np.ndarray, np.ndarray]:
    """The server's own reading of a compact array: (float32 values, not-measured mask)."""
    arr = unpack_layer_values(unpack_f32_b64(text, max_values=10_000))
    return arr, null_mask(arr)


def test_layer_arrays_are_f32_base64_that_the_server_reads_back_exactly(tmp_path):
    torch.manual_seed(0)
    model = PartlyUsedNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu")
    transport = RawTransport()
    monitor = agent.attach(model, scaler, transport=transport, spool_dir=str(tmp_path / "spool"),
                           flush_interval=0.1, activations_every=2, weights_every=2)
    expected = []
    for x, y in batches(4):
        opt.zero_grad()
        scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
        scaler.unscale_(opt)
        expected.append([None if p.grad is None else p.grad.norm().item() for p in model.parameters()])
        scaler.step(opt)
        scaler.update()
    monitor.close()

    bodies = [_strict_json(b) for b in transport.raw]
    steps = [s for b in bodies for s in b["steps"]]
    assert [s["step"] for s in steps] == [0, 1, 2, 3]
    names = transport.meta()["param_names"]
    assert names[2:4] == ["spare.weight", "spare.bias"]
    for s, want in zip(steps, expected):
        assert None not in s.values(), "fields with nothing measured are left out, not sent as null"
        assert "ema_divergence" not in s and "mem_peak" not in s
        text = s["layers"]["grad_norm"]
        assert isinstance(text, str) and text.startswith("f32:")
        values, missing = _server_array(text)
        assert missing.tolist() == [w is None for w in want]
        assert values[~missing] == pytest.approx([w for w in want if w is not None], rel=1e-6)
        assert (values.view("<u4")[missing] == NULL_F32_BITS).all()
    sampled = [s for s in steps if s["step"] % 2 == 0]
    for s in sampled:
        for stat in ("act_mean", "act_std", "act_absmax", "act_nonfinite"):
            values, missing = _server_array(s["layers"][stat])
            # module order: fc1, spare, fc2 (relu is a function here): only spare never ran
            assert missing.tolist() == [False, True, False], stat
        weights, missing = _server_array(s["layers"]["weight_norm"])
        assert not missing.any() and len(weights) == len(names)
    assert all("act_mean" not in s.get("layers", {}) for s in steps if s["step"] % 2)


def test_a_nan_loss_goes_as_the_string_and_nan_grads_stay_nan_not_null(tmp_path):
    torch.manual_seed(0)
    model = PartlyUsedNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    transport = RawTransport()
    # No scaler: a NaN loss with NaN grads is a critical step (sent at once, top grad norms event).
    monitor = agent.attach(model, optimizer=opt, transport=transport, spool_dir=str(tmp_path / "spool"),
                           flush_interval=60.0)
    x, y = batches(1)[0]
    x = x.clone()
    x[0, 0] = float("nan")
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    monitor.log(loss=loss)
    monitor.close()
    bodies = [_strict_json(b) for b in transport.raw]
    (step,) = [s for b in bodies for s in b["steps"]]
    assert step["loss"] == "NaN" and step["grad_norm"] == "NaN"
    values, missing = _server_array(step["layers"]["grad_norm"])
    assert missing.tolist() == [False, False, True, True, False, False]
    assert np.isnan(values).all()     # NaN where measured, the "not measured" NaN for spare
    assert (values.view("<u4")[~missing] != NULL_F32_BITS).all()
    assert math.isnan(decode_step(step)["loss"])
    top = next(e for b in bodies for e in b["events"] if e["kind"] == "top_grad_norms")
    assert [name for name, _ in top["data"]["params"]][:2] == ["fc1.weight", "fc1.bias"]


class _SlowStaleSeal:
    """Makes the sender thread's seal of a stale record slow, and says when it has begun.

    flush() / close() called while it runs is the race under test: the record is taken out of
    the monitor but not yet in the sender's queue.
    """

    def __init__(self, monitor, delay: float):
        self.started = threading.Event()
        original = monitor._finish_record

        def finish(rec, in_training_thread):
            if not in_training_thread:
                self.started.set()
                time.sleep(delay)
            return original(rec, in_training_thread)
        monitor._finish_record = finish


def _loop_then_stall(transport, tmp_path, steps: int = 3):
    model = PartlyUsedNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu")
    monitor = agent.attach(model, scaler, transport=transport, spool_dir=str(tmp_path / "spool"),
                           flush_interval=60.0, seal_grace=0.05)
    slow = _SlowStaleSeal(monitor, delay=0.5)
    for x, y in batches(steps):
        checklist_step(model, opt, scaler, x, y)
    assert slow.started.wait(10), "the sender thread began sealing the last step"
    assert monitor._open is None
    return monitor


def test_flush_waits_for_a_step_the_sender_thread_is_sealing_right_then(tmp_path):
    transport = RecordingTransport()
    monitor = _loop_then_stall(transport, tmp_path)
    assert monitor.flush(timeout=10)
    assert [s["step"] for s in transport.steps] == [0, 1, 2], "flush shipped the step being sealed"
    monitor.close()
    assert [s["step"] for s in transport.steps] == [0, 1, 2]


def test_close_waits_for_a_step_the_sender_thread_is_sealing_right_then(tmp_path):
    transport = RecordingTransport()
    monitor = _loop_then_stall(transport, tmp_path)
    monitor.close(timeout=10)
    assert [s["step"] for s in transport.steps] == [0, 1, 2], "the step being sealed at close is not lost"
    assert transport.bodies[-1]["status"] == "finished"


def test_no_batch_holds_more_than_max_batch_steps_even_when_one_drain_takes_many(tmp_path):
    transport = RecordingTransport()
    model = PartlyUsedNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu")
    # No tick for a minute: whatever the sender drains in one go must still be cut at 5 steps.
    monitor = agent.attach(model, scaler, transport=transport, spool_dir=str(tmp_path / "spool"),
                           flush_interval=60.0, max_batch_steps=5)
    for x, y in batches(23):
        checklist_step(model, opt, scaler, x, y)
    monitor.close(timeout=10)
    sizes = [len(b["steps"]) for b in transport.bodies]
    assert sum(sizes) == 23 and max(sizes) <= 5, sizes
