"""``params_without_grad``: trainable parameter tensors whose ``.grad`` is None at the optimizer step.

The stored count equals the one read from the model's own ``p.grad`` right before ``optimizer.step()``,
on the sampled steps (``weights_every``) and only on those; a real server stores and serves it.
"""
from __future__ import annotations

import torch

from gradwatch import agent
from agent_helpers import batches, find_run


class BranchNet(torch.nn.Module):
    """A head used on even steps only: on odd steps its two tensors get no gradient (set_to_none zero_grad)."""

    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(8, 16)
        self.fc2 = torch.nn.Linear(16, 4)
        self.extra = torch.nn.Linear(16, 4)
        self.use_extra = True

    def forward(self, x):
        h = torch.relu(self.fc1(x))
        return self.fc2(h) + (self.extra(h) if self.use_extra else 0)


def test_the_stored_count_is_the_models_own_on_sampled_steps(shared_server, tmp_path):
    srv = shared_server
    torch.manual_seed(0)
    model = BranchNet()
    model.fc1.bias.requires_grad_(False)   # frozen: not watched, so never counted
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.05)
    monitor = agent.attach(model, optimizer=opt, server=srv.url, project="grad-presence", run="branch",
                           spool_dir=str(tmp_path / "spool"), flush_interval=0.1, weights_every=2)
    expected = {}
    for i, (x, y) in enumerate(batches(12)):
        model.use_extra = i % 4 == 0
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        expected[i] = sum(p.grad is None for p in model.parameters() if p.requires_grad)
        opt.step()
        monitor.log(loss=loss.detach())
    monitor.close()
    run = find_run(srv, "grad-presence", "branch")
    status, body = srv.get(f"/api/v1/runs/{run['id']}/series?signal=params_without_grad&max_points=100000")
    assert status == 200, body
    stored = {p["step"]: p["last"] for p in body["steps"] if p["last"] is not None}
    assert stored == {i: expected[i] for i in range(0, 12, 2)}
    assert set(stored.values()) == {0, 2}   # both: the head used (steps 0, 4, 8) and not (2, 6, 10)
