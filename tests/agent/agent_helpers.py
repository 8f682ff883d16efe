"""Agent test helpers: tiny real models, the checklist's training loops, a recording transport."""
from __future__ import annotations

import base64
import json
import math
import struct
import threading
from typing import Any, Optional

import torch

from gradwatch.agent.transport import Delivery


class RecordingTransport:
    """Stands in for the HTTP transport (STYLE point 7: injected through ``transport=``).

    Keeps every batch body it was given; ``status`` makes it answer errors.
    """

    def __init__(self, status: int = 200):
        self.status = status
        self.bodies: list[dict] = []
        self._lock = threading.Lock()

    def post(self, body: bytes) -> Delivery:
        with self._lock:
            if self.status >= 300 or self.status == 0:
                return Delivery(self.status, "refused")
            self.bodies.append(json.loads(body))
            return Delivery(self.status, '{"accepted": 1}')

    @property
    def steps(self) -> list[dict]:
        """Steps as values (see :func:`decode_step`); ``raw_steps`` has them as they went on the wire."""
        return [decode_step(s) for s in self.raw_steps]

    @property
    def raw_steps(self) -> list[dict]:
        with self._lock:
            return [s for b in self.bodies for s in b["steps"]]

    @property
    def events(self) -> list[dict]:
        with self._lock:
            return [e for b in self.bodies for e in b.get("events", [])]

    def meta(self) -> Optional[dict]:
        with self._lock:
            return next((b["meta"] for b in self.bodies if b.get("meta")), None)


# The optional step fields of docs/wire-format.md: absent means null ("not measured").
OPTIONAL_STEP_FIELDS = ("loss", "grad_norm", "clip_max_norm", "clipped", "loss_scale", "overflow", "grad_zero_fraction",
                        "overflow_count", "lr", "step_time", "samples_per_s", "tokens_per_s", "mem_peak",
                        "ema_divergence", "input_nonfinite")
_WIRE_NONFINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}
NULL_F32_BITS = 0x7FC0DEAD


def wire_value(v: Any) -> Any:
    """A wire float as a Python float: the strings "NaN" / "Infinity" / "-Infinity" become floats."""
    return _WIRE_NONFINITE[v] if isinstance(v, str) else v


def decode_layer_array(v: Any) -> list:
    """A per-layer array in either wire form -> floats, None where "not measured" (spec's decoding)."""
    if not isinstance(v, str):
        return [wire_value(x) for x in v]
    assert v.startswith("f32:"), v[:20]
    raw = base64.b64decode(v[4:], validate=True)
    assert len(raw) % 4 == 0
    bits = struct.unpack(f"<{len(raw) // 4}I", raw)
    values = struct.unpack(f"<{len(raw) // 4}f", raw)
    return [None if b == NULL_F32_BITS else x for b, x in zip(bits, values)]


def decode_step(step: dict) -> dict:
    """A wire step as the values it stands for, as the server reads it: absent optional fields
    are None, non-finite strings are floats, compact layer arrays are lists."""
    out = {k: None for k in OPTIONAL_STEP_FIELDS}
    for k, v in step.items():
        if k == "layers":
            out[k] = {name: decode_layer_array(a) for name, a in v.items()}
        elif k == "custom":
            out[k] = {name: wire_value(x) for name, x in v.items()}
        else:
            out[k] = wire_value(v)
    return out


class TinyNet(torch.nn.Module):
    def __init__(self, d_in: int = 8, hidden: int = 16, d_out: int = 4, bn: bool = False):
        super().__init__()
        self.fc1 = torch.nn.Linear(d_in, hidden)
        self.bn = torch.nn.BatchNorm1d(hidden) if bn else torch.nn.Identity()
        self.act = torch.nn.GELU()
        self.fc2 = torch.nn.Linear(hidden, d_out)

    def forward(self, x):
        return self.fc2(self.act(self.bn(self.fc1(x))))


def tiny_loop(lr: float = 0.05):
    """(TinyNet, SGD, a CPU GradScaler): the loop most agent tests train; seed before calling for fixed weights."""
    model = TinyNet()
    return model, torch.optim.SGD(model.parameters(), lr=lr), torch.amp.GradScaler("cpu")


class ShadowEMA:
    """The checklist's EMA class (section 4.4), verbatim in behaviour."""

    def __init__(self, model, decay=0.9):
        self.shadow = {}
        self.decay = decay
        for name, param in model.named_parameters():
            if param.requires_grad:
                self.shadow[name] = param.data.clone()

    def update(self, model):
        for name, param in model.named_parameters():
            if param.requires_grad:
                new_average = (1.0 - self.decay) * param.data + self.decay * self.shadow[name]
                self.shadow[name] = new_average.clone()


def batches(n: int, batch: int = 16, d_in: int = 8, d_out: int = 4, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, d_in, generator=g), torch.randn(batch, d_out, generator=g)) for _ in range(n)]


def checklist_step(model, opt, scaler, x, y, ema=None, max_norm=1.0, amp=False):
    """One iteration of the checklist's loop (sections 2.4 / 9.1); ``amp``: fp16 autocast on ``x``'s device."""
    opt.zero_grad()
    with torch.autocast(x.device.type, dtype=torch.float16, enabled=amp):
        loss = torch.nn.functional.mse_loss(model(x), y)
    scaler.scale(loss).backward()
    scaler.unscale_(opt)
    total = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=max_norm)
    scaler.step(opt)
    scaler.update()
    if ema is not None:
        ema.update(model)
    return loss.detach(), total


# --------------------------------------------------------------------------- reading a real server back

def find_run(srv, project: str, run: str) -> Optional[dict]:
    status, body = srv.get(f"/api/v1/runs?project={project}&name={run}")
    if status != 200:
        return None
    return next((r for r in body["runs"] if r["name"] == run and r["project"] == project), None)


def stored_counts(srv, project: str, run: str, signal: str = "loss", rank: int = 0) -> dict[int, int]:
    """step → how many rows the server holds for it (raw, one bucket per step)."""
    r = find_run(srv, project, run)
    if r is None:
        return {}
    status, body = srv.get(f"/api/v1/runs/{r['id']}/series?signal={signal}&max_points=100000&rank={rank}")
    assert status == 200, body
    assert body["bucket_size"] == 1, body["bucket_size"]
    return {b["step"]: b["count"] for b in body["steps"]}


def stored_events(srv, project: str, run: str, kind: Optional[str] = None) -> list[dict]:
    r = find_run(srv, project, run)
    if r is None:
        return []
    status, body = srv.get(f"/api/v1/runs/{r['id']}/events" + (f"?kind={kind}" if kind else ""))
    assert status == 200, body
    return body["events"]


def spooled_steps(directory) -> list[int]:
    """Step numbers held in a spool directory tree, in file order."""
    from pathlib import Path
    out = []
    for d in sorted({p.parent for p in Path(directory).rglob("*.json")}):
        for p in sorted(d.glob("*.json")):
            out.extend(s["step"] for s in json.loads(p.read_bytes())["steps"])
    return out


class StubbornServer:
    """A real HTTP server on loopback that answers every POST with ``status``, or never answers (hang)."""

    def __init__(self, status: int = 500, hang: bool = False, port: Optional[int] = None, hang_s: float = 60.0):
        import http.server
        import socket
        import time as _time

        if port is None:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
        self.port = port
        self.requests: list[dict] = []
        self._stop = threading.Event()
        owner = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802
                length = int(self.headers.get("Content-Length") or 0)
                self.rfile.read(length)
                owner.requests.append(dict(self.headers.items()))
                if hang:
                    owner._stop.wait(hang_s)   # stop() ends it sooner
                    return
                self.send_response(status)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args):
                pass

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self._stop.set()
        self._server.shutdown()
        self._server.server_close()
