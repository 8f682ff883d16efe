"""A mixture of experts' router, seen by the attention mode (``AttentionLogitMode``, agent/capture/attention.py):
a 2-D softmax over the last dimension whose output the forward routes by (topk, max, argmax) is a router's, and
its figure equals the spread of the logits the router computed (recorded by a forward hook on the gate, the
ground truth); a classifier's 2-D softmax that nothing routes by is not taken, and neither is a routing call on
a copy of the probabilities."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from gradwatch.agent.capture.attention import AttentionLogitMode


class Mixtral(nn.Module):
    """Mixtral's sparse MoE block, as Hugging Face writes it: softmax over the flattened tokens' gate logits
    in float32, then the top-2 experts, renormalised."""

    def __init__(self, width: int = 16, experts: int = 4, route: str = "topk"):
        super().__init__()
        self.gate = nn.Linear(width, experts, bias=False)
        self.experts = nn.ModuleList(nn.Linear(width, width) for _ in range(experts))
        self.route = route
        self.gate.register_forward_hook(lambda m, a, out: setattr(self, "logits", out.detach().clone()))

    def forward(self, x):
        flat = x.reshape(-1, x.shape[-1])
        weights = F.softmax(self.gate(flat), dim=1, dtype=torch.float)
        if self.route == "topk":
            weights, chosen = torch.topk(weights, 2, dim=-1)
        elif self.route == "max":
            weights, chosen = weights.max(dim=-1, keepdim=True)
        else:                                     # a copy first: not seen (the module docstring says so)
            weights, chosen = torch.topk(weights.to(torch.bfloat16), 2, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            rows, slot = (chosen == e).nonzero(as_tuple=True)
            out = out.index_add(0, rows, expert(flat[rows]) * weights[rows, slot, None].to(out.dtype))
        return out.reshape(x.shape)


class Classifier(nn.Module):
    """A head that returns probabilities: a 2-D softmax nothing routes by."""

    def __init__(self, width: int = 16, classes: int = 5):
        super().__init__()
        self.head = nn.Linear(width, classes)

    def forward(self, x):
        return F.softmax(self.head(x.mean(dim=1)), dim=-1)


class Side(nn.ModuleList):
    """Each child on the same input (a router block and a classifier head side by side)."""

    def forward(self, x):
        return [m(x) for m in self]


def routed(model: Side) -> tuple[dict, list]:
    """The router figures the mode hands over (module position -> value), and any attention it reports."""
    got, attention = {}, []
    owners = {id(m): i for i, m in enumerate(model)}
    mode = AttentionLogitMode(owners, lambda p, v: attention.append((p, v)), lambda e: None,
                              lambda p, v: got.__setitem__(p, float(v)))
    torch.manual_seed(0)
    x = torch.randn(3, 5, 16) * 4
    mode.enter()
    model(x)
    mode.leave()
    return got, attention


def spread(logits: torch.Tensor) -> float:
    """The largest max - min of one token's logits, in float64 (plain PyTorch)."""
    l64 = logits.double()
    return float((l64.max(dim=-1).values - l64.min(dim=-1).values).max())


@pytest.mark.parametrize("route", ["topk", "max"])
def test_a_router_is_credited_to_its_block_with_the_spread_it_computed(route):
    torch.manual_seed(1)
    model = Side([Mixtral(route=route), Classifier(), Mixtral(route=route)])
    got, attention = routed(model)
    assert sorted(got) == [0, 2] and attention == []
    for i in (0, 2):
        assert got[i] == pytest.approx(spread(model[i].logits), rel=1e-6)


def test_probabilities_nothing_routes_by_and_a_routing_call_on_a_copy_are_not_taken():
    torch.manual_seed(2)
    got, _ = routed(Side([Classifier(), Mixtral(route="copy")]))
    assert got == {}
