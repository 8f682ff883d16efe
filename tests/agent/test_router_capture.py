"""A mixture of experts' router, seen by the attention mode (``AttentionLogitMode``, agent/capture/attention.py):
a 2-D ``[tokens, experts]`` or 3-D ``[batch, seq, experts]`` softmax over the last dimension whose output (or a
cast of it) the forward routes by (topk, max, argmax) is a router's, and its figure equals the spread of the
logits the router computed (recorded by a forward hook on the gate, the ground truth: for the Hugging Face models,
the router logits their own router module returns); a classifier's softmax that nothing routes by is not taken,
and neither is a routing call on probabilities changed by arithmetic."""
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
        elif self.route == "copy":                # a cast first: the router's own distribution, seen through it
            weights, chosen = torch.topk(weights.to(torch.bfloat16), 2, dim=-1)
        else:                                     # arithmetic first: no longer its distribution, not seen
            weights, chosen = torch.topk(weights * 1.0, 2, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            rows, slot = (chosen == e).nonzero(as_tuple=True)
            out = out.index_add(0, rows, expert(flat[rows]) * weights[rows, slot, None].to(out.dtype))
        return out.reshape(x.shape)


class Switch(nn.Module):
    """Switch Transformers' top-1 router as Hugging Face writes it: the softmax over ``[batch, seq, experts]``
    in float32, cast back to the input's dtype, then ``argmax`` (its block dispatches by the one-hot index)."""

    def __init__(self, width: int = 16, experts: int = 4):
        super().__init__()
        self.classifier = nn.Linear(width, experts, bias=False)
        self.experts = nn.ModuleList(nn.Linear(width, width) for _ in range(experts))
        self.classifier.register_forward_hook(lambda m, a, out: setattr(self, "logits", out.detach().clone()))

    def forward(self, x):
        h = x.to(torch.bfloat16)               # a half-precision residual stream: the cast back is a real copy
        probs = F.softmax(self.classifier(h.float()), dim=-1, dtype=torch.float32).to(h.dtype)
        chosen = torch.argmax(probs, dim=-1)
        top = probs.max(dim=-1).values.unsqueeze(-1).float()
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            out = torch.where((chosen == e).unsqueeze(-1), expert(x) * top, out)
        return out


class TokenClassifier(nn.Module):
    """Per-token probabilities over 5 classes, ``[batch, seq, classes]``, that nothing routes by."""

    def __init__(self, width: int = 16, classes: int = 5):
        super().__init__()
        self.head = nn.Linear(width, classes)

    def forward(self, x):
        return F.softmax(self.head(x), dim=-1)


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


@pytest.mark.parametrize("route", ["topk", "max", "copy"])
def test_a_router_is_credited_to_its_block_with_the_spread_it_computed(route):
    torch.manual_seed(1)
    model = Side([Mixtral(route=route), Classifier(), Mixtral(route=route)])
    got, attention = routed(model)
    assert sorted(got) == [0, 2] and attention == []
    for i in (0, 2):
        assert got[i] == pytest.approx(spread(model[i].logits), rel=1e-6)


def test_a_3d_router_cast_back_before_its_argmax_is_seen_and_per_token_probabilities_are_not():
    torch.manual_seed(3)
    model = Side([TokenClassifier(), Switch(), Classifier(), Switch()])
    got, attention = routed(model)
    assert sorted(got) == [1, 3] and attention == []
    for i in (1, 3):
        assert got[i] == pytest.approx(spread(model[i].logits), rel=1e-6)


def test_probabilities_nothing_routes_by_and_a_routing_call_after_arithmetic_are_not_taken():
    torch.manual_seed(2)
    got, _ = routed(Side([Classifier(), TokenClassifier(), Mixtral(route="arithmetic")]))
    assert got == {}


def _hf_moe(kind: str) -> nn.Module:
    """A tiny Hugging Face mixture of experts built from its config (eager attention)."""
    import transformers as tf
    common = dict(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1, max_position_embeddings=64, attn_implementation="eager")
    if kind == "mixtral":
        return tf.MixtralForCausalLM(tf.MixtralConfig(**common, num_local_experts=4, num_experts_per_tok=2))
    if kind == "qwen2_moe":
        return tf.Qwen2MoeForCausalLM(tf.Qwen2MoeConfig(**common, num_experts=4, num_experts_per_tok=2,
                                                        moe_intermediate_size=16, shared_expert_intermediate_size=16))
    if kind == "olmoe":
        return tf.OlmoeForCausalLM(tf.OlmoeConfig(**common, num_experts=4, num_experts_per_tok=2, eos_token_id=None))
    # Switch Transformers' encoder: every block sparse, a 3-D router, jitter off so the hook sees what it softmaxes
    return tf.SwitchTransformersEncoderModel(tf.SwitchTransformersConfig(
        vocab_size=32, d_model=16, d_kv=8, d_ff=32, num_layers=2, num_heads=2, num_experts=4, expert_capacity=64,
        num_sparse_encoder_layers=2, router_jitter_noise=0.0, attn_implementation="eager"))


@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe", "olmoe", "switch"])
def test_hugging_face_routers_match_the_router_logits_their_modules_return(kind):
    """Every router module of a Hugging Face MoE is credited with the spread of the logits it returned (its own
    output, hooked), and nothing else is: the load-balancing loss's second pass over every layer's logits (the
    model's own forward, ``output_router_logits=True``) belongs to no watched module, as under the agent."""
    torch.manual_seed(4)
    model = _hf_moe(kind).train()
    named = [(n, m) for n, m in model.named_modules() if n]      # the agent's watched modules leave the root out
    owners = {id(m): i for i, (_, m) in enumerate(named)}
    truth: dict[str, torch.Tensor] = {}
    for n, m in named:
        if type(m).__name__.endswith("Router"):
            logits_at = 2 if kind == "switch" else 0           # (index, probs, logits) / (logits, scores, indices)
            m.register_forward_hook(lambda mod, a, out, n=n, i=logits_at: truth.__setitem__(n, out[i].detach()))
    got, unplaced, attention = {}, [], []

    def router(position, value):
        if position is None:
            unplaced.append(float(value))
        else:
            got[named[position][0]] = float(value)
    mode = AttentionLogitMode(owners, lambda p, v: attention.append(named[p][0]), lambda e: None, router)
    ids = torch.randint(0, 32, (3, 7))
    mode.enter()
    if kind == "switch":
        model(input_ids=ids, output_router_logits=True)
    else:
        out = model(input_ids=ids, labels=ids, output_router_logits=True)
        assert out.aux_loss is not None                          # the load-balancing pass did run
    mode.leave()
    assert len(truth) == 2 and sorted(got) == sorted(truth)
    for n, logits in truth.items():
        assert got[n] == pytest.approx(spread(logits), rel=1e-6), n
    if kind == "switch":
        assert unplaced == []
    else:   # the layers' spreads again, layer by layer (transformers 5) or all layers at once (4.x): the same max
        assert unplaced and all(any(u == pytest.approx(g, rel=1e-6) for g in got.values()) for u in unplaced)
        assert max(unplaced) == pytest.approx(max(got.values()), rel=1e-6)
    assert len(attention) == 2 and all(n.endswith(("self_attn", "SelfAttention")) for n in attention)
