"""Configuration advice at step 0 (H5-H9, docs/early-warning-advice.md) through a real agent and a real server.

Each note: one real run whose setup departs from the checklist (the note fires, at its severity, at the
first step) and its healthy counterpart (nothing). The hardware branch of H5 (native bf16, which this
CPU machine cannot have) is fed the way a GPU run sends it: a ``run_setup`` event through the real
ingest API, with the facts an A100 reports; the CPU run shows that the agent reads the autocast dtype
and that a run without a CUDA device gets no H5.
"""
from __future__ import annotations

import time
import uuid

import pytest
import torch

from tests.conftest import start_sqlite_server, wait_until
from tests.advice.setup_loop import PROJECT, train

SETUP_RULES = {"H5", "H6", "H7", "H8", "H9"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = start_sqlite_server(tmp_path_factory.mktemp("advice"))
    yield srv
    srv.stop()


def run_id_of(server, run: str, project: str = PROJECT) -> int:
    def find():
        _, body = server.get(f"/api/v1/runs?project={project}&name={run}")
        return next((r["id"] for r in body["runs"] if r["name"] == run), None)
    return wait_until(find, timeout=20, what=f"run {run}")


def notes(server, run: str) -> dict[str, dict]:
    """The run's H5-H9 alerts by rule id."""
    status, body = server.get(f"/api/v1/alerts?run={run_id_of(server, run)}")
    assert status == 200, body
    return {a["rule"]: a for a in body["alerts"] if a["rule"] in SETUP_RULES}


def setup_event(server, run: str) -> dict:
    status, body = server.get(f"/api/v1/runs/{run_id_of(server, run)}/events?kind=run_setup")
    assert status == 200, body
    events = body["events"] if isinstance(body, dict) else body
    assert len(events) == 1, events
    return events[0]


def only(found: dict, rule: str, severity: str = "info") -> dict:
    assert set(found) == {rule}, found
    a = found[rule]
    assert a["severity"] == severity and a["first_step"] == 0, a
    return a


# --------------------------------------------------------------------------- H5: fp16 where bf16 is native

A100 = {"name": "NVIDIA A100-SXM4-80GB", "capability": [8, 0], "bf16_native": True}
H100 = {"name": "NVIDIA H100 80GB HBM3", "capability": [9, 0], "bf16_native": True}
V100 = {"name": "Tesla V100-SXM2-32GB", "capability": [7, 0], "bf16_native": False}
RTX4090 = {"name": "NVIDIA GeForce RTX 4090", "capability": [8, 9], "bf16_native": True}   # checklist 10: FP16


def ingest_setup(server, run: str, data: dict) -> None:
    """One step and a run_setup event, as the agent of a CUDA run sends them (POST /api/v1/ingest)."""
    body = {"batch_id": uuid.uuid4().hex, "project": PROJECT, "run": run, "rank": 0, "world_size": 1,
            "steps": [{"step": 0, "time": time.time(), "loss": 1.0, "grad_norm": 0.5, "loss_scale": 65536.0}],
            "events": [{"step": 0, "kind": "run_setup", "data": data}],
            "meta": {"param_names": ["w"], "module_names": [], "config": {}}}
    status, reply = server.post("/api/v1/ingest", body)
    assert status == 200, reply


def cuda_setup(hardware: dict, dtype: str, scaler: bool) -> dict:
    return {"device": "cuda", "hardware": hardware, "scaler_enabled": scaler,
            "autocast": {"enabled": True, "dtype": dtype, "device": "cuda"},
            "model": {"params": 1000, "transformer": False, "attention": []},
            "clip": {"calls": 1, "max_norm": 1.0, "stages": ["unscaled"] if scaler else []}}


@pytest.mark.parametrize("hardware,sm", [(A100, "sm 8.0"), (H100, "sm 9.0")], ids=["a100", "h100"])
def test_h5_fp16_with_scaler_on_native_bf16_hardware(server, hardware, sm):
    run = f"h5-{sm.replace(' ', '')}-fp16"
    ingest_setup(server, run, cuda_setup(hardware, "float16", scaler=True))
    a = only(wait_until(lambda: notes(server, run), what="H5"), "H5")
    assert hardware["name"] in a["message"] and sm in a["message"], a["message"]
    assert "checklist 10 recommends bf16" in a["message"] and "fp16 autocast and a GradScaler" in a["message"]


@pytest.mark.parametrize("hardware,dtype,scaler", [(A100, "bfloat16", False), (V100, "float16", True),
                                                   (RTX4090, "float16", True)],
                         ids=["a100-bf16", "v100-fp16", "rtx4090-fp16"])
def test_h5_quiet_on_bf16_or_without_native_bf16(server, hardware, dtype, scaler):
    run = f"h5-{hardware['name'][:10].replace(' ', '')}-{dtype}"
    ingest_setup(server, run, cuda_setup(hardware, dtype, scaler))
    run_id_of(server, run)
    assert notes(server, run) == {}


def test_h5_cpu_run_records_autocast_and_has_no_hardware_note(server):
    """The agent reads the first forward's autocast dtype; a CPU run has no native-bf16 device: no H5."""
    train(server.url, "h5-cpu-fp16", amp=torch.float16)
    data = setup_event(server, "h5-cpu-fp16")["data"]
    assert data["autocast"] == {"enabled": True, "dtype": "float16", "device": "cpu"}
    assert data["scaler_enabled"] is True and data["device"] == "cpu" and "hardware" not in data
    assert notes(server, "h5-cpu-fp16") == {}


# --------------------------------------------------------------------------- H6: a Transformer unclipped

def test_h6_transformer_without_clipping(server):
    train(server.url, "h6-unclipped", transformer=True, clip=None)
    a = only(notes(server, "h6-unclipped"), "H6")
    assert "blocks.0.attn: MultiheadAttention" in a["message"] and "max_norm=1.0" in a["message"], a["message"]
    data = setup_event(server, "h6-unclipped")["data"]
    assert data["model"]["transformer"] is True and data["clip"]["calls"] == 0


def test_h6_quiet_when_the_transformer_clips(server):
    train(server.url, "h6-clipped", transformer=True, clip=1.0)
    assert notes(server, "h6-clipped") == {}
    assert setup_event(server, "h6-clipped")["data"]["clip"] == {"calls": 1, "max_norm": 1.0, "stages": ["unscaled"]}


def test_h6_quiet_for_an_unclipped_mlp(server):
    train(server.url, "h6-mlp-unclipped", clip=None)
    assert notes(server, "h6-mlp-unclipped") == {}


# --------------------------------------------------------------------------- H7: EMA decay far from the range

def test_h7_ema_decay_far_too_low(server):
    train(server.url, "h7-decay-0.5", ema=0.5)
    a = only(notes(server, "h7-decay-0.5"), "H7")
    assert "EMA decay 0.5 too low" in a["message"] and "0.99-0.9999" in a["message"], a["message"]


def test_h7_quiet_on_a_sane_decay_read_from_averaged_model(server):
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    train(server.url, "h7-averaged-0.999",
          ema=lambda m: AveragedModel(m, multi_avg_fn=get_ema_multi_avg_fn(0.999)))
    assert setup_event(server, "h7-averaged-0.999")["data"]["ema"] == {"class": "AveragedModel", "decay": 0.999}
    assert notes(server, "h7-averaged-0.999") == {}


# --------------------------------------------------------------------------- H8: cosine below base / 10

def cosine_to(eta_min_fraction: float):
    return lambda opt: torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=100,
                                                                  eta_min=1e-3 * eta_min_fraction)


def hf_cosine(min_lr_rate):
    def make(opt):
        from transformers import get_cosine_schedule_with_warmup, get_cosine_with_min_lr_schedule_with_warmup

        if min_lr_rate is None:
            return get_cosine_schedule_with_warmup(opt, num_warmup_steps=10, num_training_steps=100)
        return get_cosine_with_min_lr_schedule_with_warmup(opt, num_warmup_steps=10, num_training_steps=100,
                                                           min_lr_rate=min_lr_rate)
    return make


def warmup_then_cosine(opt):
    sched = torch.optim.lr_scheduler
    return sched.SequentialLR(opt, [sched.LinearLR(opt, 0.1, total_iters=10),
                                    sched.CosineAnnealingLR(opt, T_max=90, eta_min=0.0)], milestones=[10])


@pytest.mark.parametrize("make,final", [(cosine_to(0.0), "0"), (hf_cosine(None), "0"),
                                        (warmup_then_cosine, "0")],
                         ids=["CosineAnnealingLR-eta_min-0", "hf-cosine-with-warmup", "SequentialLR-warmup-cosine"])
def test_h8_cosine_decays_below_base_over_10(server, make, final):
    run = f"h8-{uuid.uuid4().hex[:8]}"
    train(server.url, run, scheduler=make)
    a = only(notes(server, run), "H8")
    assert f"ends at lr {final} from 0.001" in a["message"] and "base_lr / 10" in a["message"], a["message"]


@pytest.mark.parametrize("make", [cosine_to(0.1), hf_cosine(0.1)], ids=["eta_min-base-over-10", "hf-min_lr_rate-0.1"])
def test_h8_quiet_at_a_floor_of_base_over_10(server, make):
    """The floor exactly at base / 10 (as h_bn_classifier's schedule ends) is the checklist's, not below it."""
    run = f"h8-ok-{uuid.uuid4().hex[:8]}"
    train(server.url, run, scheduler=make)
    data = setup_event(server, run)["data"]["scheduler"]
    assert data["cosine"] is True and data["final_lrs"][0] == pytest.approx(1e-4, rel=1e-12)
    assert notes(server, run) == {}


# --------------------------------------------------------------------------- H9: clipping scaled gradients

@pytest.mark.parametrize("order,words", [("clip_without_unscale", "clips the scaled gradients"),
                                         ("clip_after_step", "after scaler.step()")])
@pytest.mark.parametrize("given", [True, False], ids=["optimizer-given", "optimizer-from-scaler-step"])
def test_h9_clip_order_is_a_warning(server, order, words, given):
    """With ``attach(model, scaler)`` the optimizer is unknown at the first clip: any optimizer's stage counts."""
    run = f"h9-{order}-{given}"
    train(server.url, run, order=order, with_optimizer=given)
    a = only(notes(server, run), "H9", severity="warning")
    assert words in a["message"] and "checklist 6.1" in a["message"], a["message"]


@pytest.mark.parametrize("given", [True, False], ids=["optimizer-given", "optimizer-from-scaler-step"])
def test_h9_quiet_when_unscale_comes_first(server, given):
    run = f"h9-unscale-first-{given}"
    train(server.url, run, order="unscale_clip_step", with_optimizer=given)
    assert notes(server, run) == {}
    data = setup_event(server, run)["data"]
    assert data["clip"]["stages"] == ["unscaled"]
    # the optimizer's class (H13's doubling-time limit), also when the agent learns the optimizer at scaler.step
    assert data["optimizer"] == {"class": "AdamW"}
