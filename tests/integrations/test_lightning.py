"""GradwatchCallback on a real Lightning ``Trainer.fit`` with a tiny randomly initialised model.

The references are Lightning's own numbers: ``trainer.global_step`` (optimizer
steps), the loss each ``training_step`` returned (averaged over the
micro-batches of an optimizer step, which is what Lightning back-propagates
in total), and the grad norm Lightning's ``grad_norm`` utility reports in
``on_before_optimizer_step`` (after unscaling, before clipping).
"""
from __future__ import annotations

import pytest
import torch

from tests.conftest import wait_until
from tests.integrations.conftest import assert_close, require, run_of, series

L = require("lightning.pytorch")

from gradwatch.agent.integrations.lightning import GradwatchCallback  # noqa: E402


class TinyModule(L.LightningModule):
    def __init__(self, lr: float = 0.05):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
        self.lr = lr
        self.batch_losses: list[tuple[int, float]] = []   # (global_step when computed, loss)
        self.step_grad_norms: list[float] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x).float(), y)
        self.batch_losses.append((self.trainer.global_step, loss.detach().float().item()))
        return loss

    def on_before_optimizer_step(self, optimizer):
        from lightning.pytorch.utilities import grad_norm

        self.step_grad_norms.append(float(grad_norm(self.net, norm_type=2)["grad_2.0_norm_total"]))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


def loader(n: int = 48, batch: int = 4):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 8, generator=g)
    y = x[:, :1] * 2.0 + 0.1 * torch.randn(n, 1, generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=batch, shuffle=False)


def fit(callback, *, accumulation: int, precision: str, max_steps: int, tmp_path, plugins=None):
    torch.manual_seed(0)
    module = TinyModule()
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_steps=max_steps, accumulate_grad_batches=accumulation,
        gradient_clip_val=1.0, precision=None if plugins else precision, plugins=plugins, callbacks=[callback],
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=str(tmp_path),
    )
    trainer.fit(module, loader())
    return trainer, module


def expected_step_losses(module: TinyModule) -> list[float]:
    """Mean of the micro-batch losses of each optimizer step (what Lightning back-propagates in sum)."""
    by_step: dict[int, list[float]] = {}
    for step, loss in module.batch_losses:
        by_step.setdefault(step, []).append(loss)
    return [sum(v) / len(v) for _, v in sorted(by_step.items())]


@pytest.mark.parametrize("precision,accumulation", [("32-true", 3), ("bf16-mixed", 2)])
def test_fit_steps_loss_and_grad_norm_match_lightning(gw_server, tmp_path, run_name, precision, accumulation):
    max_steps = 4
    cb = GradwatchCallback(project="pl", run=run_name, server=gw_server.url, flush_interval=0.1)
    trainer, module = fit(cb, accumulation=accumulation, precision=precision, max_steps=max_steps, tmp_path=tmp_path)

    assert trainer.global_step == max_steps
    assert len(module.batch_losses) == max_steps * accumulation
    assert cb.scaler is None and cb.monitor is None
    # the final batch (status finished) may still be on its way on a loaded machine: wait, do not race it
    run = wait_until(lambda: (r := run_of(gw_server, "pl", run_name))["status"] == "finished" and r, timeout=20,
                     what="the run's final batch")
    loss = series(gw_server, run["id"], "loss")
    assert sorted(loss) == list(range(max_steps)), "one gradwatch step per optimizer step"
    assert_close([loss[s] for s in sorted(loss)], expected_step_losses(module), rel=1e-5, what="loss")
    grad_norm = series(gw_server, run["id"], "grad_norm")
    assert_close([grad_norm[s] for s in sorted(grad_norm)], module.step_grad_norms, rel=1e-4, what="grad_norm")
    lr = series(gw_server, run["id"], "lr")
    assert set(lr.values()) == {0.05}


def test_fp16_precision_plugin_scaler_is_monitored(gw_server, tmp_path, run_name):
    """``16-mixed`` brings a real GradScaler (here on the CPU): the callback attaches to it."""
    from lightning.pytorch.plugins.precision import MixedPrecision

    plugin = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=2.0 ** 10))
    max_steps, accumulation = 3, 2
    cb = GradwatchCallback(project="pl", run=run_name, server=gw_server.url, flush_interval=0.1)
    trainer, module = fit(cb, accumulation=accumulation, precision="16-mixed", max_steps=max_steps,
                          tmp_path=tmp_path, plugins=[plugin])

    assert cb.scaler is plugin.scaler
    run = run_of(gw_server, "pl", run_name)
    loss = series(gw_server, run["id"], "loss")
    scale = series(gw_server, run["id"], "loss_scale")
    overflow = series(gw_server, run["id"], "overflow")
    assert sorted(loss) == list(range(trainer.global_step)) == sorted(scale)
    assert set(scale.values()) == {2.0 ** 10}
    assert set(overflow.values()) == {0.0}
    # the agent sums the unscaled tensors Lightning passes to scaler.scale(): the loss / accumulation
    assert_close([loss[s] for s in sorted(loss)], expected_step_losses(module), rel=1e-3, what="loss")
    grad_norm = series(gw_server, run["id"], "grad_norm")
    assert_close([grad_norm[s] for s in sorted(grad_norm)], module.step_grad_norms, rel=1e-3, what="grad_norm")


def test_a_fit_resumed_from_its_checkpoint_continues_its_steps_and_raises_no_resume_rule(gw_server, tmp_path,
                                                                                          run_name):
    """``trainer.fit(ckpt_path=...)`` restores the module and the optimizer before train start: the resumed
    steps follow the stored ones (the callback passes ``step=trainer.global_step``) and no G rule speaks."""
    first = L.Trainer(accelerator="cpu", devices=1, max_steps=4, logger=False, enable_progress_bar=False,
                      enable_model_summary=False, default_root_dir=str(tmp_path),
                      callbacks=[GradwatchCallback(project="pl", run=run_name, server=gw_server.url,
                                                   flush_interval=0.1)])
    torch.manual_seed(0)
    first.fit(TinyModule(), loader())
    ckpt = tmp_path / "four.ckpt"
    first.save_checkpoint(str(ckpt))
    cb = GradwatchCallback(project="pl", run=run_name, server=gw_server.url, flush_interval=0.1)
    resumed = L.Trainer(accelerator="cpu", devices=1, max_steps=7, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=str(tmp_path), callbacks=[cb])
    module = TinyModule()
    resumed.fit(module, loader(), ckpt_path=str(ckpt))
    assert resumed.global_step == 7

    run = run_of(gw_server, "pl", run_name)
    loss = series(gw_server, run["id"], "loss")
    assert sorted(loss) == list(range(7))
    assert_close([loss[s] for s in range(4, 7)], expected_step_losses(module), what="resumed loss")
    _, body = gw_server.get(f"/api/v1/alerts?run={run['id']}")
    assert [a["rule"] for a in body["alerts"] if a["rule"].startswith("G")] == []
    _, body = gw_server.get(f"/api/v1/runs/{run['id']}/events?kind=resume_state")
    (resume,) = [e for e in body["events"] if e["step"] == 4]
    assert resume["data"]["before"]["step"] == 3 and resume["data"]["optimizer"]["state_entries"] > 0
