"""The early-warning logit signals (agent/collectors/early_logits.py) against plain PyTorch.

Several attention forms get a tiny model; the max attention logit the agent sends for each module
must equal max(q·kᵀ·scale) over every unmasked logit (all samples, heads and positions; the causal
mask where the module uses one) computed here independently from the module's own weights, and the
output's max logit and mean log Z must equal torch's; in fp32 and under bf16 autocast. The wider zoo
(Hugging Face architectures, timm, hand-written styles) is tests/agent/test_attention_zoo.py.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from gradwatch import agent
from gradwatch.agent.collectors.early_logits import find_attention

D, HEADS, T = 16, 4, 10


class PairAttention(nn.Module):
    """q_proj / k_proj / v_proj with ``num_heads``; optionally grouped-query (2 key heads) or qk-layernorm."""

    causal = True

    def __init__(self, kv_heads: int = HEADS, qk_norm: bool = False):
        super().__init__()
        self.num_heads, self.head_dim, self.kv_heads = HEADS, D // HEADS, kv_heads
        self.q_proj = nn.Linear(D, D)
        self.k_proj = nn.Linear(D, kv_heads * D // HEADS)
        self.v_proj = nn.Linear(D, kv_heads * D // HEADS)
        self.q_norm = nn.LayerNorm(self.head_dim) if qk_norm else None
        self.k_norm = nn.LayerNorm(self.head_dim) if qk_norm else None

    def qk(self, x):
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, HEADS, self.head_dim)
        k = self.k_proj(x).view(b, t, self.kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return q, k

    def forward(self, x):
        b, t, _ = x.shape
        q, k = self.qk(x)
        v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim)
        rep = HEADS // self.kv_heads
        k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return y.transpose(1, 2).reshape(b, t, D)


class KeysFirst(PairAttention):
    """Makes its keys before its queries (no mask)."""

    causal = False

    def forward(self, x):
        b, t, _ = x.shape
        k = self.k_proj(x).view(b, t, HEADS, self.head_dim)
        q = self.q_proj(x).view(b, t, HEADS, self.head_dim)
        v = self.v_proj(x).view(b, t, HEADS, self.head_dim)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        return y.transpose(1, 2).reshape(b, t, D)


class FusedAttention(nn.Module):
    """nanoGPT's form: one c_attn Linear making [q | k | v], ``n_head``."""

    causal = True

    def __init__(self):
        super().__init__()
        self.n_head = HEADS
        self.c_attn = nn.Linear(D, 3 * D)
        self.c_proj = nn.Linear(D, D)

    def qk(self, x):
        b, t, _ = x.shape
        q, k, _ = self.c_attn(x).split(D, dim=2)
        return q.view(b, t, HEADS, D // HEADS), k.view(b, t, HEADS, D // HEADS)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (z.view(b, t, HEADS, D // HEADS).transpose(1, 2) for z in self.c_attn(x).split(D, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(b, t, D))


class MHA(nn.Module):
    causal = False

    def __init__(self, batch_first: bool):
        super().__init__()
        self.batch_first = batch_first
        self.mha = nn.MultiheadAttention(D, HEADS, batch_first=batch_first)

    def qk(self, x):
        """As nn.MultiheadAttention projects self-attention: one GEMM over the packed weight, on the
        sequence-first layout it works in (under autocast the rounding depends on both)."""
        m = self.mha
        b, t, _ = x.shape
        q, k, _ = F.linear(x.transpose(0, 1), m.in_proj_weight, m.in_proj_bias).chunk(3, dim=-1)
        return (q.transpose(0, 1).reshape(b, t, HEADS, D // HEADS), k.transpose(0, 1).reshape(b, t, HEADS, D // HEADS))

    def forward(self, x):
        h = x if self.batch_first else x.transpose(0, 1)
        y = self.mha(h, h, h, need_weights=False)[0]
        return y if self.batch_first else y.transpose(0, 1)


class LM(nn.Module):
    def __init__(self, make_attn, vocab: int = 12, layers: int = 2):
        super().__init__()
        self.tok = nn.Embedding(vocab, D)
        self.attns = nn.ModuleList(make_attn() for _ in range(layers))
        self.head = nn.Linear(D, vocab)

    def forward(self, idx):
        x = self.tok(idx)
        for a in self.attns:
            x = x + a(x)
        return self.head(x)


FORMS = {
    "q_proj/k_proj": lambda: PairAttention(),
    "grouped-query": lambda: PairAttention(kv_heads=2),
    "qk-layernorm": lambda: PairAttention(qk_norm=True),
    "keys before queries": lambda: KeysFirst(),
    "fused c_attn": lambda: FusedAttention(),
    "MultiheadAttention batch_first": lambda: MHA(True),
    "MultiheadAttention seq first": lambda: MHA(False),
}


def plain_max_logit(attn: nn.Module, x: torch.Tensor) -> float:
    """The independent computation: the module's own q, k (as the model makes them: under autocast, in
    bf16), their products in fp32 over every sample, head and position pair, the causal mask applied
    where the module attends causally."""
    q, k = attn.qk(x)
    with torch.autocast("cpu", enabled=False):
        q, k = q.float().transpose(1, 2), k.float().transpose(1, 2)         # (batch, heads, t, d)
        if k.shape[1] != q.shape[1]:
            k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        s = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
        if attn.causal:
            t = s.shape[-1]
            s = s.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), -math.inf)
        return float(s.amax())


def run(model, recorder, settings, amp, steps=3, **kw):
    torch.manual_seed(1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    inputs: dict[int, torch.Tensor] = {}
    hooks = [a.register_forward_pre_hook(lambda m, args, i=i: inputs.__setitem__(i, args[0].detach()))
             for i, a in enumerate(model.attns)]
    monitor = agent.attach(model, scaler, optimizer=opt, transport=recorder, **{**settings, **kw})
    expected = []
    for step in range(steps):
        idx = torch.randint(0, 12, (3, T))
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
            out = model(idx)
            with torch.no_grad():
                per = [plain_max_logit(a, inputs[i]) for i, a in enumerate(model.attns)]
        o = out.detach().float()
        expected.append((per, float(o.amax()), float(o.logsumexp(-1).mean())))
        loss = F.cross_entropy(out.float().reshape(-1, 12), idx.reshape(-1))
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    monitor.close()
    for h in hooks:
        h.remove()
    return expected, monitor


@pytest.mark.parametrize("amp", [False, True], ids=["fp32", "bf16-autocast"])
@pytest.mark.parametrize("form", list(FORMS))
def test_max_attention_logit_and_output_log_z_equal_plain_pytorch(form, amp, recorder, agent_settings):
    model = LM(FORMS[form])
    expected, _ = run(model, recorder, agent_settings, amp, attn_logits_every=1, output_logits_every=1)
    names = recorder.meta()["module_names"]
    site = "attns.{}.mha" if form.startswith("MultiheadAttention") else "attns.{}"   # the attention module
    where = [names.index(site.format(i)) for i in range(2)]
    rel = 1e-5
    steps = recorder.steps
    assert [s["step"] for s in steps] == [0, 1, 2]
    for s, (per, out_max, log_z) in zip(steps, expected):
        got = s["layers"]["attn_logit_max"]
        assert len(got) == len(names)
        assert [got[i] for i in where] == pytest.approx(per, rel=rel)
        assert all(v is None for i, v in enumerate(got) if i not in where)      # no other module is attention
        assert s["attn_logit_max"] == pytest.approx(max(per), rel=rel)
        assert s["output_logit_max"] == pytest.approx(out_max, rel=1e-5)
        assert s["output_log_z"] == pytest.approx(log_z, rel=1e-5)


def test_the_cadence_setting_samples_every_kth_step_and_zero_turns_it_off(recorder, agent_settings):
    run(LM(FORMS["fused c_attn"]), recorder, agent_settings, False, steps=4, attn_logits_every=2,
        output_logits_every=0)
    steps = recorder.steps
    assert [s["step"] for s in steps if "attn_logit_max" in (s.get("layers") or {})] == [0, 2]
    assert all(s.get("output_log_z") is None and s.get("output_logit_max") is None for s in steps)


class HandSoftmax(PairAttention):
    """Attention whose softmax is written out (exp / sum): no function the agent's mode sees, so it is
    measured only when named, from its q_proj / k_proj (the first sample's positions, no mask)."""

    causal = False

    def forward(self, x):
        b, t, _ = x.shape
        q, k = (z.transpose(1, 2) for z in self.qk(x))
        v = self.v_proj(x).view(b, t, HEADS, self.head_dim).transpose(1, 2)
        s = q @ k.transpose(-1, -2) / math.sqrt(self.head_dim)
        w = torch.exp(s - s.amax(-1, keepdim=True))
        return ((w / w.sum(-1, keepdim=True)) @ v).transpose(1, 2).reshape(b, t, D)


def test_attention_the_mode_cannot_see_is_measured_once_named(recorder, agent_settings):
    model = LM(HandSoftmax)
    expected, _ = run(model, recorder, agent_settings, False, attn_logits_every=1)
    assert all("attn_logit_max" not in (s.get("layers") or {}) for s in recorder.steps)   # not seen unnamed
    recorder.bodies.clear()
    assert [s.name for s in find_attention(model, [n for n, _ in model.named_modules() if n], "attns.*")] == \
        ["attns.0", "attns.1"]
    run(model, recorder, agent_settings, False, attention_modules="attns.*", attn_logits_every=1, run="r2")
    names = recorder.meta()["module_names"]
    where = [names.index(f"attns.{i}") for i in range(2)]
    for s in recorder.steps:
        got = [s["layers"]["attn_logit_max"][i] for i in where]
        assert all(v is not None and math.isfinite(v) for v in got)


def test_a_regression_output_has_no_log_z(recorder, agent_settings):
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = agent.attach(model, None, optimizer=opt, transport=recorder, **agent_settings)
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(5, 4)).pow(2).mean().backward()
        opt.step()
    monitor.close()
    steps = recorder.steps
    assert len(steps) == 2 and all(s.get("output_log_z") is None and s.get("attn_logit_max") is None for s in steps)


@pytest.mark.parametrize("entry", ["blocks.*.attn:four", "blocks.*.attn:0", ":4"])
def test_a_bad_attention_modules_entry_is_refused_at_attach(entry):
    with pytest.raises(ValueError, match="attention_modules"):
        agent.attach(nn.Linear(2, 2), None, mode="disabled", attention_modules=entry)


def test_a_transformers_gpt2_is_recognised_and_measured(recorder, agent_settings):
    """GPT-2 in transformers (its default attention implementation): every causal logit of every sample,
    credited to ``GPT2Attention``, and a ``CausalLMOutput`` whose ``.logits`` are the output."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(vocab_size=12, n_positions=T, n_embd=D, n_layer=2, n_head=HEADS,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg)
    qkv: dict[int, torch.Tensor] = {}
    for i, blk in enumerate(model.transformer.h):
        blk.attn.c_attn.register_forward_hook(lambda m, a, out, i=i: qkv.__setitem__(i, out.detach()))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    monitor = agent.attach(model, None, optimizer=opt, transport=recorder, attn_logits_every=1,
                           output_logits_every=1, **agent_settings)
    expected = []
    for _ in range(2):
        idx = torch.randint(0, 12, (3, T))
        opt.zero_grad()
        out = model(input_ids=idx, labels=idx)
        per = []
        causal = torch.ones(T, T, dtype=torch.bool).triu(1)
        for i in range(2):
            q, k, _ = qkv[i].split(D, dim=-1)
            q, k = q.view(3, T, HEADS, -1).transpose(1, 2), k.view(3, T, HEADS, -1).transpose(1, 2)
            s = (q @ k.transpose(-1, -2)) / math.sqrt(D // HEADS)
            per.append(float(s.masked_fill(causal, -math.inf).amax()))
        lg = out.logits.detach().float()
        expected.append((per, float(lg.amax()), float(lg.logsumexp(-1).mean())))
        out.loss.backward()
        opt.step()
    monitor.close()
    names = recorder.meta()["module_names"]
    where = [names.index(f"transformer.h.{i}.attn") for i in range(2)]
    assert [s["step"] for s in recorder.steps] == [0, 1]
    for s, (per, out_max, log_z) in zip(recorder.steps, expected):
        assert [s["layers"]["attn_logit_max"][i] for i in where] == pytest.approx(per, rel=1e-5)
        assert s["output_logit_max"] == pytest.approx(out_max, rel=1e-5)
        assert s["output_log_z"] == pytest.approx(log_z, rel=1e-5)


def test_a_fast_growing_logit_is_sampled_every_step_until_it_stops_growing(recorder, agent_settings):
    """Cadence for lead time: once the max logit is >= 10 and 1.5x what it was one interval before, every
    step is sampled for two intervals; when it stops growing, the cadence goes back to every 4th step."""
    from gradwatch.agent.collectors.early_logits import BOOST_FLOOR, BOOST_GROWTH

    torch.manual_seed(0)
    model = LM(FORMS["q_proj/k_proj"], layers=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)     # the weights move only as the test scales them
    monitor = agent.attach(model, None, optimizer=opt, transport=recorder, attn_logits_every=4, **agent_settings)
    idx = torch.randint(0, 12, (3, T))
    for step in range(40):
        if 4 <= step < 16:       # the queries grow 1.25x a step (x2.4 over an interval of 4) for 12 steps
            with torch.no_grad():
                model.attns[0].q_proj.weight.mul_(1.25)
                model.attns[0].q_proj.bias.mul_(1.25)
        opt.zero_grad()
        loss = F.cross_entropy(model(idx).reshape(-1, 12), idx.reshape(-1))
        monitor.log(loss=loss)
        loss.backward()
        opt.step()
    monitor.close()
    sampled = {s["step"]: s["attn_logit_max"] for s in recorder.steps if s.get("attn_logit_max") is not None}
    # the independent reading: which steps qualify, from the values sent (every 4th step is always sampled)
    steps = sorted(sampled)
    assert {0, 4, 8, 12, 16, 20, 24, 28, 32, 36} <= set(steps)
    extra = [s for s in steps if s % 4]
    assert extra, f"no denser sampling while the logit grew: {sampled}"
    first = extra[0] - 1                                              # the sample that triggered it
    value, before = sampled[first], sampled[max(s for s in steps if s <= first - 4)]
    assert value >= BOOST_FLOOR and value >= BOOST_GROWTH * before
    assert all(s in steps for s in range(first + 1, first + 9))      # every step for two intervals
    assert not any(s % 4 for s in steps if s > 30)                    # back to every 4th once growth stops


def test_by_default_the_attention_logits_are_sampled_every_25_steps_and_nothing_else_joins_them(recorder,
                                                                                                agent_settings):
    """Issue 41: the attention logits' default cadence is 25 steps (the widest interval that, replayed on the
    early-warning benchmark, notices a growth as early as every step), while the output logits stay at 50 and
    the other layer statistics at their own: step 25 samples the attention logits alone."""
    torch.manual_seed(0)
    model = LM(FORMS["fused c_attn"], layers=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)     # a flat logit: no denser sampling while it grows
    monitor = agent.attach(model, None, optimizer=opt, transport=recorder, **agent_settings)
    idx = torch.randint(0, 12, (3, T))
    for _ in range(51):
        opt.zero_grad()
        loss = F.cross_entropy(model(idx).reshape(-1, 12), idx.reshape(-1))
        loss.backward()
        opt.step()
    monitor.close()
    by_step = {s["step"]: s for s in recorder.steps}
    assert [k for k, s in sorted(by_step.items()) if s.get("attn_logit_max") is not None] == [0, 25, 50]
    assert [k for k, s in sorted(by_step.items()) if s.get("output_log_z") is not None] == [0, 50]
    # step 25 carries what every step carries (step 24's layer stats: the grad norms) and the attention logits
    assert set(by_step[25]["layers"]) == set(by_step[24]["layers"]) | {"attn_logit_max"}, by_step[25]["layers"].keys()
    assert "attn_logit_max" in by_step[50]["layers"] and len(by_step[50]["layers"]) > 1
