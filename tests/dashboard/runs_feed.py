"""Synthetic training runs, sent to a real server through the public ingest API.

Deterministic (seeded), so a test knows exactly which values a chart must hold.
"""
from __future__ import annotations

import math
import random
import time
import uuid
from typing import Any, Optional

PARAM_NAMES = ["embed.weight", "blocks.0.attn.qkv.weight", "blocks.0.mlp.fc.weight",
               "blocks.1.attn.qkv.weight", "blocks.1.mlp.fc.weight", "head.weight"]
MODULE_NAMES = ["embed", "blocks.0.attn", "blocks.0.mlp", "blocks.1.attn", "blocks.1.mlp", "head"]


def make_steps(n: int, *, start: int = 0, seed: int = 0, overflow_every: int = 0, layers_every: int = 10,
               loss0: float = 3.0, t0: Optional[float] = None) -> list[dict]:
    """``n`` healthy AMP steps: decaying loss, grad norm around 0.8, a few clipped steps, LR warmup.

    ``overflow_every``: every that many steps the scaler skips the step and halves the scale.
    """
    rng = random.Random(seed)
    t0 = time.time() - n * 0.05 if t0 is None else t0
    scale = 65536.0
    overflows = 0
    out = []
    for i in range(start, start + n):
        overflow = bool(overflow_every) and i > 0 and i % overflow_every == 0
        if overflow:
            overflows += 1
        grad = 0.8 * math.exp(rng.gauss(0, 0.25))
        step = {
            "step": i,
            "time": t0 + i * 0.05,
            "loss": loss0 * math.exp(-i / 400) + 0.5 + rng.gauss(0, 0.03),
            "grad_norm": grad,
            "clip_max_norm": 1.0,
            "clipped": grad > 1.0,
            "loss_scale": scale,
            "overflow": overflow,
            "overflow_count": overflows,
            "lr": 3e-4 * min(1.0, (i + 1) / 50),
            "step_time": 0.05 + rng.random() * 0.005,
            "samples_per_s": 1200.0 + rng.gauss(0, 20),
            "tokens_per_s": None,
            "mem_peak": 2.5 * (1 << 30) + rng.random() * (1 << 26),
            "ema_divergence": 0.01 * math.exp(-i / 300) + 1e-4,
            "input_nonfinite": 0,
            "data_time": 0.004 + 0.001 * math.sin(i / 10),
        }
        if overflow:
            scale /= 2
        if layers_every and i % layers_every == 0:
            step["grad_zero_fraction"] = 0.01 + 0.001 * (i % 7)
            step["params_without_grad"] = i % 3   # sampled with the weights, as the agent does (0: healthy)
            # the early-warning signals, sampled on the same steps as the agent samples them (healthy values)
            step["attn_logit_max"] = 6.0 + 0.2 * math.sin(i / 20)
            step["output_logit_max"] = 9.0 + 0.3 * math.sin(i / 30)
            step["output_log_z"] = 4.2 + 0.05 * math.sin(i / 25)
            step["adam_g2_over_v_max"] = 1.5 + 0.1 * math.sin(i / 15)
            step["layers"] = {
                "grad_norm": [grad * (0.2 + 0.1 * k) for k in range(len(PARAM_NAMES))],
                "weight_norm": [10.0 + k + i * 0.001 for k in range(len(PARAM_NAMES))],
                "update_ratio": [1e-3 * (1 + 0.1 * k) for k in range(len(PARAM_NAMES))],
                "act_std": [1.0 + 0.05 * k for k in range(len(MODULE_NAMES))],
                "grad_zero_fraction": [0.005 * k for k in range(len(PARAM_NAMES))],
                "adam_g2_over_v": [0.8 + 0.05 * k for k in range(len(PARAM_NAMES))],
                "linear_out_rms": [0.9 + 0.02 * k for k in range(len(MODULE_NAMES))],
                "attn_logit_max": [5.0 + 0.1 * k for k in range(len(MODULE_NAMES))],
            }
        out.append(step)
    return out


def ingest(server, *, project: str, run: str, steps: list[dict], status: Optional[str] = None,
           events: Optional[list[dict]] = None, batch: int = 500, meta: bool = True) -> int:
    """POST ``steps`` in batches; returns the run id. Raises on any non-200 answer."""
    run_id = None
    chunks = [steps[i:i + batch] for i in range(0, len(steps), batch)] or [[]]
    for k, chunk in enumerate(chunks):
        body: dict[str, Any] = {"batch_id": uuid.uuid4().hex, "project": project, "run": run, "rank": 0,
                                "world_size": 1, "steps": chunk}
        if meta and k == 0:
            body["meta"] = {"param_names": PARAM_NAMES, "module_names": MODULE_NAMES,
                            "config": {"max_norm": 1.0, "amp_dtype": "float16"}, "host": "test-node"}
        if k == len(chunks) - 1:
            if events:
                body["events"] = events
            if status:
                body["status"] = status
        code, answer = server.post("/api/v1/ingest", body)
        assert code == 200, f"ingest answered {code}: {answer}"
        run_id = answer["run_id"]
    return run_id
