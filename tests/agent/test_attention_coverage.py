"""Coverage the user can see (issue 33): the run says which attention modules the agent measures, and a
Transformer whose attention it cannot see gets an info note (H11) saying how to name the modules. A real
agent training a tiny model, a real server, read back through the run API."""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from gradwatch import agent
from tests.conftest import wait_until

D, HEADS, T = 16, 4, 8


class SelfAttention(nn.Module):
    """``softmax`` over [batch, heads, query, key], or with ``by_hand`` an exp / sum the agent cannot see."""

    def __init__(self, by_hand: bool):
        super().__init__()
        self.by_hand = by_hand
        self.qkv = nn.Linear(D, 3 * D)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (z.view(b, t, HEADS, D // HEADS).transpose(1, 2) for z in self.qkv(x).split(D, -1))
        s = q @ k.transpose(-1, -2) / math.sqrt(D // HEADS)
        w = torch.exp(s - s.amax(-1, keepdim=True)) if self.by_hand else s.softmax(-1)
        w = w / w.sum(-1, keepdim=True) if self.by_hand else w
        return (w @ v).transpose(1, 2).reshape(b, t, D)


class BatchedProducts(nn.Module):
    """3-D batched products and 3-D softmaxes that are not attention (``attention=False``), or, with
    ``attention=True``, the same module computing attention the fairseq way: ``torch.bmm(q, kᵀ)`` on
    ``[batch·heads, query, key]`` and a softmax over its last dimension."""

    def __init__(self, attention: bool):
        super().__init__()
        self.attention = attention
        self.qkv = nn.Linear(D, 3 * D)
        self.mix = nn.Parameter(torch.randn(HEADS, D // HEADS, D // HEADS) * 0.3)
        self.classes = nn.Linear(D, 5)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (z.reshape(b, t, HEADS, D // HEADS).transpose(1, 2).reshape(b * HEADS, t, D // HEADS)
                   for z in self.qkv(x).split(D, -1))
        s = torch.bmm(q, k.transpose(1, 2)) / math.sqrt(D // HEADS)          # [b·heads, t, t]
        if self.attention:
            w = s.softmax(-1)
        else:
            w = torch.sigmoid(s) + s.softmax(dim=1)      # a bmm not followed by a softmax over its last dim
        y = torch.bmm(w, v)
        y = y + F.softmax(torch.bmm(v, self.mix.repeat(b, 1, 1)), dim=-1)   # bmm with a parameter, then softmax
        out = y.reshape(b, HEADS, t, D // HEADS).transpose(1, 2).reshape(b, t, D)
        return out + F.softmax(self.classes(out), dim=-1).sum(-1, keepdim=True)   # a classifier's 3-D softmax


class Net(nn.Module):
    def __init__(self, by_hand: bool, products: bool = None):
        super().__init__()
        self.emb = nn.Embedding(10, D)
        self.blocks = nn.ModuleList((SelfAttention(by_hand) if products is None else BatchedProducts(products))
                                    for _ in range(2))
        self.head = nn.Linear(D, 10)

    def forward(self, idx):
        x = self.emb(idx)
        for blk in self.blocks:
            x = x + blk(x)
        return self.head(x)


def train(srv, tmp_path, run: str, by_hand: bool, products: bool = None) -> dict:
    torch.manual_seed(0)
    model = Net(by_hand, products)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    monitor = agent.attach(model, optimizer=opt, server=srv.url, project="coverage", run=run,
                           spool_dir=str(tmp_path / run), flush_interval=0.1, attn_logits_every=2)
    for _ in range(4):
        idx = torch.randint(0, 10, (3, T))
        opt.zero_grad()
        loss = F.cross_entropy(model(idx).reshape(-1, 10), idx.reshape(-1))
        monitor.log(loss=loss)
        loss.backward()
        opt.step()
    monitor.close()

    def found():
        _, body = srv.get("/api/v1/runs?project=coverage")
        return next((r for r in body["runs"] if r["name"] == run), None)
    summary = wait_until(found, timeout=20, what=f"run {run}")
    _, detail = srv.get(f"/api/v1/runs/{summary['id']}")
    _, alerts = srv.get(f"/api/v1/alerts?run={summary['id']}")
    _, series = srv.get(f"/api/v1/runs/{summary['id']}/series?signal=attn_logit_max&max_points=100")
    return {"detail": detail, "alerts": {a["rule"]: a for a in alerts["alerts"]},
            "attn_logit_max": [(p["step"], p["last"]) for p in series.get("steps", []) if p["last"] is not None]}


def test_the_run_names_the_attention_modules_measured(shared_server, tmp_path):
    got = train(shared_server, tmp_path, "seen", by_hand=False)
    assert got["detail"]["attention_modules"] == ["blocks.0", "blocks.1"]
    assert "H11" not in got["alerts"]


def test_a_transformer_whose_attention_is_not_seen_gets_a_note_saying_how_to_name_it(shared_server, tmp_path):
    got = train(shared_server, tmp_path, "unseen", by_hand=True)
    assert got["detail"]["attention_modules"] == []
    note = got["alerts"]["H11"]
    assert note["severity"] == "info" and note["first_step"] == 0
    assert "attention_modules=" in note["message"] and "blocks.0: SelfAttention" in note["message"]


def test_batched_products_and_3d_softmaxes_that_are_not_attention_are_not_reported(shared_server, tmp_path):
    """A bmm followed by a sigmoid and a softmax over its query dim, a bmm with a parameter followed by a
    softmax, a classifier's 3-D softmax: no attention measured. The same module with its bmm scores
    softmaxed over the key dim: both modules measured, at the sampled steps (every 2nd)."""
    got = train(shared_server, tmp_path, "products", by_hand=False, products=False)
    assert got["detail"]["attention_modules"] == []
    assert got["attn_logit_max"] == []
    seen = train(shared_server, tmp_path, "bmm-attention", by_hand=False, products=True)
    assert seen["detail"]["attention_modules"] == ["blocks.0", "blocks.1"]
    assert [s for s, _ in seen["attn_logit_max"]] == [0, 2]
    assert all(v > 0 for _, v in seen["attn_logit_max"])
