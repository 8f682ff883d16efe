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


class Net(nn.Module):
    def __init__(self, by_hand: bool):
        super().__init__()
        self.emb = nn.Embedding(10, D)
        self.blocks = nn.ModuleList(SelfAttention(by_hand) for _ in range(2))
        self.head = nn.Linear(D, 10)

    def forward(self, idx):
        x = self.emb(idx)
        for blk in self.blocks:
            x = x + blk(x)
        return self.head(x)


def train(srv, tmp_path, run: str, by_hand: bool) -> dict:
    torch.manual_seed(0)
    model = Net(by_hand)
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
    return {"detail": detail, "alerts": {a["rule"]: a for a in alerts["alerts"]}}


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
