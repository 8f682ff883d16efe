"""SDPA calls are scored when the sampled forward is over (``AttentionLogitMode._defer``): the values equal
the logits the call computed, a call whose ``q`` or ``k`` changed in place since is not scored (never a
wrong value), and calls autograd does not keep tensors for are scored at once."""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from gradwatch.agent.capture.attention import AttentionLogitMode


class Attention(nn.Module):
    """Causal self-attention through SDPA; keeps copies of the q and k it hands over (the ground truth)."""

    def __init__(self, width: int = 16, heads: int = 2, change_after: bool = False):
        super().__init__()
        self.q, self.k, self.v = nn.Linear(width, width), nn.Linear(width, width), nn.Linear(width, width)
        self.heads, self.change_after = heads, change_after

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = (p(x).view(b, t, self.heads, c // self.heads).transpose(1, 2) for p in (self.q, self.k, self.v))
        self.given = (q.detach().clone(), k.detach().clone())
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        if self.change_after:
            k.mul_(3.0)   # in place after the call (a backward would refuse it; the forward allows it)
        return out.transpose(1, 2).reshape(b, t, c)


def true_max(q: torch.Tensor, k: torch.Tensor) -> float:
    """The largest logit the causal SDPA call computed, from the explicit scores (plain PyTorch)."""
    s = (q.double() @ k.double().transpose(-2, -1)) / math.sqrt(q.shape[-1])
    hidden = torch.ones(s.shape[-2], s.shape[-1], dtype=torch.bool).triu(1)
    return float(s.masked_fill(hidden, -math.inf).amax())


def run(model: nn.Sequential, grad: bool):
    got: list[tuple] = []
    owners = {id(m): i for i, m in enumerate(model)}
    mode = AttentionLogitMode(owners, lambda position, value: got.append((position, float(value))), lambda e: None)
    torch.manual_seed(0)
    x = torch.randn(2, 6, 16)
    with torch.set_grad_enabled(grad):
        mode.enter()
        model(x)
        before_leave = list(got)
        mode.leave()
    return before_leave, dict(got)


def test_deferred_calls_equal_the_logits_each_call_computed():
    torch.manual_seed(1)
    model = nn.Sequential(Attention(), Attention())
    before_leave, got = run(model, grad=True)
    assert before_leave == []   # kept until the forward was over
    assert sorted(got) == [0, 1]
    for i, m in enumerate(model):
        assert abs(got[i] - true_max(*m.given)) <= 1e-5 * abs(true_max(*m.given))


def test_a_call_whose_key_changed_in_place_afterwards_is_not_scored():
    torch.manual_seed(2)
    model = nn.Sequential(Attention(change_after=True), Attention())
    _, got = run(model, grad=True)
    assert 0 not in got   # its k is no longer what the call saw: nothing, rather than a wrong value
    assert abs(got[1] - true_max(*model[1].given)) <= 1e-5 * abs(true_max(*model[1].given))


def test_without_grad_each_call_is_scored_at_once():
    torch.manual_seed(3)
    model = nn.Sequential(Attention(change_after=True), Attention())
    before_leave, got = run(model, grad=False)
    assert [p for p, _ in before_leave] == [0, 1]   # nothing kept: autograd holds no q, k here
    for i, m in enumerate(model):
        assert abs(got[i] - true_max(*m.given)) <= 1e-5 * abs(true_max(*m.given))
