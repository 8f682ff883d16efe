"""The training thread's per-step shortcuts give the same numbers as the general paths."""
from __future__ import annotations

import pytest
import torch

from gradwatch import agent
from gradwatch.agent.capture.ema_pairs import EmaMatcher, ema_divergence
from gradwatch.agent.capture.norms import grad_norms
from gradwatch.agent.record import StepRecord
from agent_helpers import TinyNet, batches, checklist_step


def _values(rec: StepRecord) -> dict:
    vals = rec.read()
    return {k: vals.floats(k) for k in vals.keys()}


def test_seal_promotes_mixed_dtypes_and_flattens():
    rec = StepRecord(0)
    rec.add("loss", torch.tensor(2.5, dtype=torch.bfloat16))
    rec.add("grad_norms", torch.tensor([1.0, 2.0], dtype=torch.float16))
    rec.add("count", torch.tensor(3))                       # int64
    rec.add("act", torch.tensor([[1.0, 2.0], [3.0, 4.0]], dtype=torch.float64))
    rec.seal()
    assert rec.vector.dtype == torch.float32 and rec.vector.dim() == 1
    assert _values(rec) == {"loss": [2.5], "grad_norms": [1.0, 2.0], "count": [3.0], "act": [1.0, 2.0, 3.0, 4.0]}


def test_seal_copies_and_detaches():
    w = torch.ones(2, requires_grad=True)
    loss = (w * 3).sum()
    rec = StepRecord(0)
    rec.add("loss", loss)
    rec.seal()
    assert not rec.vector.requires_grad
    with torch.no_grad():
        w.add_(1.0)
    assert _values(rec) == {"loss": [6.0]}


def test_grad_norms_with_and_without_missing_grads():
    ps = [torch.nn.Parameter(torch.ones(2)) for _ in range(3)]
    for p, v in zip(ps, (3.0, 4.0, 12.0)):
        p.grad = torch.full((2,), v)
    all_index = [0, 1, 2]
    per, index, total = grad_norms(ps, all_index)
    assert index is all_index
    assert total.item() == pytest.approx(torch.linalg.vector_norm(per).item())
    ps[1].grad = None
    per, index, total = grad_norms(ps, all_index)
    assert index == [0, 2] and per.shape == (2,)
    ps[0] = torch.nn.Parameter(torch.ones(2, dtype=torch.float16))
    ps[0].grad = torch.full((2,), 3.0, dtype=torch.float16)
    per, _, total = grad_norms(ps, all_index)
    assert per.dtype == torch.float32 and per.tolist() == pytest.approx([18 ** 0.5, 288 ** 0.5], rel=1e-3)
    for p in ps:
        p.grad = None
    assert grad_norms(ps, all_index) is None


def test_ema_matcher_follows_replaced_and_resized_tensors():
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    names = [n for n, _ in model.named_parameters()]
    params = list(model.parameters())
    shadow = {n: p.detach() + 0.1 for n, p in model.named_parameters()}
    matcher = EmaMatcher(names, params)

    def plain():
        return ema_divergence(shadow, names, params)

    with torch.no_grad():
        for _ in range(2):   # second call takes the remembered pairs
            got, want = ema_divergence(shadow, names, params, matcher), plain()
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        shadow["weight"] = shadow["weight"] + 1.0   # the EMA replaced a tensor
        got, want = ema_divergence(shadow, names, params, matcher), plain()
        assert torch.equal(got[0], want[0])
        shadow["weight"].resize_(4)                  # changed shape in place: no longer matches
        got, want = ema_divergence(shadow, names, params, matcher), plain()
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_forward_post_hook_only_on_sampled_steps(recorder, agent_settings):
    torch.manual_seed(0)
    model = TinyNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    monitor = agent.attach(model, scaler, transport=recorder, **{**agent_settings, "activations_every": 2})
    assert not model._forward_hooks
    for x, y in batches(4):
        checklist_step(model, opt, scaler, x, y)
        assert not model._forward_hooks and not any(m._forward_hooks for m in model.modules())
    monitor.close()
    steps = recorder.steps
    assert [("act_mean" in s.get("layers", {})) for s in steps] == [True, False, True, False]
