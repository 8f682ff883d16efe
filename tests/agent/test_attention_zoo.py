"""The attention-logit zoo (tests/agent/zoo_models.py): the agent's stored attention logits against the
logits each model really computed.

The definition under test (docs/early-warning-logits.md, "The attention-logit zoo"): on a sampled
step's first training forward, every attention computation's logits are (a) the input of a softmax
over the last dim of a 4-D [batch, heads, query, key] tensor, or of a 3-D [batch·heads, query, key]
tensor computed from a batched product (bmm / baddbmm), (b) q·kᵀ·scale (+ a float mask; bool
mask / causal entries left out; grouped-query key heads repeated) of an
``F.scaled_dot_product_attention`` call, (c) per head (q·kᵀ)/√head_dim (+ masks) of an
``nn.MultiheadAttention``; a module's value is the max over its unmasked entries and over every call
credited to it (the innermost module on the stack; an ``nn.Softmax`` credits its parent); the step's
``attn_logit_max`` is the max over modules.

The ground truth here takes another road than the agent's (a ``TorchFunctionMode``): right after each
training forward the test replays the same forward (same weights, same inputs, grad on, dropout 0;
its output is checked to be the training forward's) with

* the module stack kept by forward pre/post hooks on every module of the model;
* ``F.softmax``, ``torch.softmax`` and ``Tensor.softmax`` wrapped (monkeypatched) to note the max of
  their 4-D input, whatever computed it, and of their 3-D input (over its last dim): no zoo model
  softmaxes a 3-D tensor that is not attention scores, which the module check below holds to (a
  3-D softmax in a module the zoo does not declare as attention would fail it);
* ``F.scaled_dot_product_attention`` wrapped to compute the logits itself, one (batch, head) at a time
  in float64 (:func:`reference_sdpa_logits`), before calling the original;
* ``nn.MultiheadAttention`` modules' logits computed from their own ``in_proj_weight`` per head.

Three checks keep the ground truth honest: its logits reproduce SDPA's own attention weights
(:func:`test_the_reference_logits_reproduce_sdpas_own_attention_weights`); the same weights under two
implementations (eager softmax vs SDPA in transformers, timm's fused vs manual path, nanoGPT's flash
vs manual) give the same per-module maxima (rel 1e-5), which shows that the SDPA recomputation —
after rotary, with grouped-query heads, T5's position bias, sliding windows, padding and the
``scale`` argument — is what the eager softmax really sees; and the modules it credits equal the
modules the zoo declares as attention (by class), in number too.

Why a replay and not the training forward itself: the ground truth must not share a forward with the agent
it checks — its own wrappers around torch's functions would be what the agent's mode is handed (the agent
does see through pass-through wrappers:
:func:`test_a_pass_through_wrapper_around_the_attention_function_hides_nothing`).
"""
from __future__ import annotations

import inspect
import math
import threading
from typing import Any, Optional

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from gradwatch import agent
from agent_helpers import find_run, stored_events
from tests.conftest import wait_until
from zoo_models import ZOO, ZooModel, model_inputs

STEPS = 3
REL = 1e-3        # the bound for stored values (they travel as float32)
TWIN_REL = 1e-5   # eager vs sdpa of the same weights: float32 rounding only


# --------------------------------------------------------------------------- the independent ground truth

def reference_sdpa_logits(q: torch.Tensor, k: torch.Tensor, attn_mask: Optional[torch.Tensor] = None,
                          is_causal: bool = False, scale: Optional[float] = None,
                          enable_gqa: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """What ``F.scaled_dot_product_attention(q, k, v, attn_mask, is_causal=, scale=, enable_gqa=)`` feeds
    its softmax, written out one (batch, head) at a time in float64: (logits, valid) of shape
    [batch, heads, query, key]; ``valid`` is False where a bool mask says False or, with ``is_causal``,
    above the diagonal (top-left aligned)."""
    assert q.dim() == 4 and k.dim() == 4, "the zoo's SDPA calls are 4-D"
    q, k = q.detach().double(), k.detach().double()
    nb, hq, L, e = q.shape
    hk, S = k.shape[1], k.shape[2]
    if hq != hk:
        assert enable_gqa and hq % hk == 0, (hq, hk)
    s = scale if scale is not None else 1.0 / math.sqrt(e)
    mask = None if attn_mask is None else attn_mask.detach().expand(nb, hq, L, S)
    logits = torch.empty(nb, hq, L, S, dtype=torch.float64)
    valid = torch.ones(nb, hq, L, S, dtype=torch.bool)
    for b in range(nb):
        for h in range(hq):
            kh = h // (hq // hk)                        # SDPA's grouping: query head h reads key head h // group
            x = (q[b, h] @ k[b if k.shape[0] > 1 else 0, kh].T) * s
            ok = torch.ones(L, S, dtype=torch.bool)
            if is_causal:
                ok = ok.tril()
            if mask is not None:
                m = mask[b, h]
                if m.dtype == torch.bool:
                    ok = ok & m
                else:
                    x = x + m.double()
            logits[b, h], valid[b, h] = x, ok
    return logits, valid


def reference_mha_max(mha: nn.MultiheadAttention, query, key, key_padding_mask=None, attn_mask=None) -> float:
    """nn.MultiheadAttention's logits per head from its own in-projection: (q·kᵀ)/√head_dim, float masks
    added, bool masks (True = not allowed, MultiheadAttention's convention) left out."""
    assert mha.bias_k is None and not mha.add_zero_attn
    if mha.batch_first:
        query, key = query.transpose(0, 1), key.transpose(0, 1)
    e, h = mha.embed_dim, mha.num_heads
    hd = e // h
    if mha._qkv_same_embed_dim:
        wq, wk, _ = mha.in_proj_weight.detach().chunk(3)
    else:
        wq, wk = mha.q_proj_weight.detach(), mha.k_proj_weight.detach()
    bq = bk = None
    if mha.in_proj_bias is not None:
        bq, bk, _ = mha.in_proj_bias.detach().chunk(3)
    with torch.no_grad():    # projected as the model projects them (under autocast: its dtype), then float64
        q, k = F.linear(query, wq, bq).double(), F.linear(key, wk, bk).double()   # (L, N, E), (S, N, E)
    L, n = q.shape[:2]
    S = k.shape[0]
    best = -math.inf
    for b in range(n):
        for i in range(h):
            x = q[:, b, i * hd:(i + 1) * hd] @ k[:, b, i * hd:(i + 1) * hd].T / math.sqrt(hd)
            ok = torch.ones(L, S, dtype=torch.bool)
            for m in (attn_mask if attn_mask is None or attn_mask.dim() == 2 else attn_mask[b * h + i],
                      None if key_padding_mask is None else key_padding_mask[b][None, :].expand(L, S)):
                if m is None:
                    continue
                if m.dtype == torch.bool:
                    ok = ok & ~m
                else:
                    x = x + m.double()
            if ok.any():
                best = max(best, float(x[ok].max()))
    return best


_MISSING = object()
_MHA_SIGNATURE = inspect.signature(nn.MultiheadAttention.forward)


class GroundTruth:
    """Within ``with``: every attention computation of ``model``'s forward, as (module, source, max logit)."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.name_of = {id(m): n for n, m in model.named_modules()}
        self.stack: list[nn.Module] = []
        self.calls: list[tuple[str, str, float]] = []
        self.unmasked: list[tuple[str, float]] = []      # (module, max logit had the masks been ignored)
        self._inside = threading.local()

    # --- the module stack: pre/post forward hooks, not the Python frames the agent reads
    def _push(self, module, args):
        self.stack.append(module)

    def _pop(self, module, args, output):
        assert self.stack and self.stack[-1] is module
        self.stack.pop()

    def owner(self) -> Optional[str]:
        for m in reversed(self.stack):
            if not isinstance(m, nn.Softmax):
                return self.name_of[id(m)]
        return None

    def _note(self, source: str, value: float, module: Optional[str] = None) -> None:
        self.calls.append((module if module is not None else self.owner(), source, value))

    # --- the wrapped functions
    def _softmax(self, original):
        def softmax(input, *args, **kwargs):
            if not getattr(self._inside, "busy", False) and isinstance(input, torch.Tensor) and input.dim() in (3, 4):
                dim = kwargs.get("dim", args[0] if args else None)
                if dim in (-1, input.dim() - 1):
                    self._note("softmax", float(input.detach().double().amax()))
            self._inside.busy = True            # F.softmax calls Tensor.softmax: note it once
            try:
                return original(input, *args, **kwargs)
            finally:
                self._inside.busy = False
        return softmax

    def _sdpa(self, original):
        def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False,
                 **kwargs):
            if not getattr(self._inside, "busy", False):
                logits, valid = reference_sdpa_logits(query, key, attn_mask, is_causal, scale, enable_gqa)
                if valid.any():
                    self._note("sdpa", float(logits[valid].max()))
                    bare, _ = reference_sdpa_logits(query, key, None, False, scale, enable_gqa)
                    self.unmasked.append((self.owner(), float(bare.max())))
            return original(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                            scale=scale, enable_gqa=enable_gqa, **kwargs)
        return sdpa

    def _mha(self, module, args, kwargs):
        a = _MHA_SIGNATURE.bind(module, *args, **kwargs)
        a.apply_defaults()
        p = a.arguments
        name = self.name_of[id(module)]
        self._note("mha", reference_mha_max(module, p["query"], p["key"], p["key_padding_mask"], p["attn_mask"]),
                   module=name)
        self.unmasked.append((name, reference_mha_max(module, p["query"], p["key"])))

    def __enter__(self) -> "GroundTruth":
        self._handles = []
        for m in self.model.modules():
            self._handles.append(m.register_forward_pre_hook(self._push))
            self._handles.append(m.register_forward_hook(self._pop, always_call=True))
            if isinstance(m, nn.MultiheadAttention):
                self._handles.append(m.register_forward_pre_hook(self._mha, with_kwargs=True))
        self._patched = []
        for owner, name, wrap in ((F, "softmax", self._softmax), (torch, "softmax", self._softmax),
                                  (torch.Tensor, "softmax", self._softmax),
                                  (F, "scaled_dot_product_attention", self._sdpa)):
            self._patched.append((owner, name, vars(owner).get(name, _MISSING)))
            setattr(owner, name, wrap(getattr(owner, name)))
        return self

    def __exit__(self, *exc) -> None:
        for owner, name, saved in reversed(self._patched):
            if saved is _MISSING:
                delattr(owner, name)
            else:
                setattr(owner, name, saved)
        for h in self._handles:
            h.remove()
        assert not self.stack

    def per_module(self) -> dict[str, float]:
        """Each module's max logit; an nn.MultiheadAttention's from its own in-projection (the "mha" note),
        not from the 3-D softmax inside it (need_weights=True), whose scores autocast rounds to bf16."""
        mha = {m for m, source, _ in self.calls if source == "mha"}
        out: dict[str, float] = {}
        for module, source, v in self.calls:
            if not (module in mha and source == "softmax"):
                out[module] = max(out.get(module, -math.inf), v)
        return out

    def masked_away(self) -> list[str]:
        """Modules whose max logit would be larger had their SDPA / MultiheadAttention masks been ignored."""
        truth = self.per_module()
        return sorted({m for m, v in self.unmasked if v > truth[m] + 1e-3 * abs(truth[m])})

    def sources(self, module: str) -> dict[str, float]:
        out: dict[str, float] = {}
        for m, source, v in self.calls:
            if m == module:
                out[source] = max(out.get(source, -math.inf), v)
        return out


def main_tensor(out: Any) -> torch.Tensor:
    return (out.logits if hasattr(out, "logits") else out).detach()


def declared_attention(z: ZooModel, model: nn.Module) -> set[str]:
    names = {n for n, m in model.named_modules() if type(m).__name__ in z.attention_types}
    assert len(names) == z.expected_count, (z.id, sorted(names))
    return names


def rel_err(got: float, want: float) -> float:
    return abs(got - want) / max(abs(want), 1e-12)


def check_ground_truth(z: ZooModel, model: nn.Module, gt: GroundTruth) -> dict[str, float]:
    truth = gt.per_module()
    assert set(truth) == declared_attention(z, model), f"{z.id}: the ground truth credits {sorted(truth)}"
    for module in truth:       # an nn.MultiheadAttention's own logits equal those of the SDPA call inside it
        src = gt.sources(module)
        if "mha" in src and "sdpa" in src:
            assert rel_err(src["sdpa"], src["mha"]) <= TWIN_REL, (module, src)
        # with need_weights=True it computes them itself: baddbmm, then a softmax over [N·H, L, S] (3-D),
        # the same logits (in the autocast dtype there: compared at bf16's precision)
        if "mha" in src and "softmax" in src:
            assert rel_err(src["softmax"], src["mha"]) <= 1e-2, (module, src)
        calls = [s for m, s, _ in gt.calls if m == module and not ("mha" in src and s in ("sdpa", "softmax"))]
        assert len(calls) == z.calls_per_module, (z.id, module, calls)
    return truth


# --------------------------------------------------------------------------- training with the agent attached

def train(z: ZooModel, settings: dict, amp: bool = False, loop: str = "plain",
          **attach) -> tuple[nn.Module, list[dict[str, float]], list[GroundTruth]]:
    """``STEPS`` real optimizer steps with the agent attached (attn_logits_every=1); per step the ground
    truth of that step's first training forward, from a replay of it before the weights move. ``amp``:
    the forwards under bf16 autocast. ``loop``: "eval-first" (a no-grad evaluation forward on other
    inputs before each step's training forward), "accumulate" (a second micro-batch after it),
    "checkpointing" (transformers' activation checkpointing on): what is measured is still the step's
    first training forward."""
    model = z.build()
    if loop == "checkpointing":   # transformers 5 renamed it; >= 4.46 (the hf extra) has the old name
        (getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable)()
    opt = torch.optim.AdamW(model.parameters(), lr=z.lr)
    monitor = agent.attach(model, None, optimizer=opt, attn_logits_every=1, **settings, **attach)
    truths, replays = [], []
    for step in range(STEPS):
        batch, inputs = model_inputs(z, step)
        opt.zero_grad()
        if loop == "eval-first":
            with torch.no_grad():
                model(**model_inputs(z, 50 + step)[1])
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
            out = model(**inputs)
            loss = z.loss(out, batch)
            with GroundTruth(model) as gt:
                again = model(**inputs)
        # the replay computed what the training forward computed
        torch.testing.assert_close(main_tensor(again), main_tensor(out), rtol=0, atol=0)
        truths.append(check_ground_truth(z, model, gt))
        replays.append(gt)
        loss.float().backward()
        if loop == "accumulate":
            more, more_inputs = model_inputs(z, 90 + step)
            z.loss(model(**more_inputs), more).backward()
        opt.step()
    monitor.close()
    return model, truths, replays


def measured(recorder, step: int) -> tuple[dict[str, float], Optional[float]]:
    names = recorder.meta()["module_names"]
    s = next(s for s in recorder.steps if s["step"] == step)
    per = (s.get("layers") or {}).get("attn_logit_max") or [None] * len(names)
    assert len(per) == len(names)
    return {names[i]: v for i, v in enumerate(per) if v is not None}, s.get("attn_logit_max")


@pytest.mark.parametrize("amp", [False, True], ids=["fp32", "bf16-autocast"])
@pytest.mark.parametrize("model_id", list(ZOO))
def test_stored_attention_logits_equal_the_models_own(model_id, amp, recorder, agent_settings):
    z = ZOO[model_id]
    model, truths, replays = train(z, agent_settings, amp=amp, transport=recorder)
    expected = declared_attention(z, model)
    # where the masks decide a module's value, an agent that ignored them would fail here
    masked_away = sum(len(g.masked_away()) for g in replays)
    if z.masks_matter:
        assert masked_away, f"{model_id}: no masked logit would have won; the check would not see masks ignored"
    worst = 0.0
    for step, truth in enumerate(truths):
        got, run_level = measured(recorder, step)
        missing, extra = sorted(expected - set(got)), sorted(set(got) - expected)
        assert not missing and not extra, (f"{model_id} step {step}: {len(expected & set(got))}/{len(expected)} "
                                           f"attention modules measured; missing {missing}, not attention {extra}")
        for module in sorted(expected):
            assert got[module] == pytest.approx(truth[module], rel=REL), (model_id, step, module)
            worst = max(worst, rel_err(got[module], truth[module]))
        assert run_level == pytest.approx(max(truth.values()), rel=REL), (model_id, step)
        worst = max(worst, rel_err(run_level, max(truth.values())))
    # the run says which modules it measures: one coverage event (the set never grew), naming them all
    coverage = [e["data"] for e in recorder.events if e["kind"] == "attention_coverage"]
    assert len(coverage) == 1 and sorted(coverage[0]["measured"]) == sorted(expected), coverage
    print(f"\nzoo: {model_id} {'bf16-autocast' if amp else 'fp32'}: {len(expected)}/{len(expected)} modules, max rel error {worst:.1e}, "
          f"logits {min(min(t.values()) for t in truths):.3g}..{max(max(t.values()) for t in truths):.3g}, "
          f"decided by a mask in {masked_away}/{len(expected) * STEPS}")


@pytest.mark.parametrize("loop", ["eval-first", "accumulate", "checkpointing"])
@pytest.mark.parametrize("model_id", ["hf-llama-sdpa", "hf-t5-eager"])
def test_only_the_steps_first_training_forward_is_measured(model_id, loop, recorder, agent_settings):
    z = ZOO[model_id]
    model, truths, _ = train(z, agent_settings, loop=loop, transport=recorder)
    expected = declared_attention(z, model)
    for step, truth in enumerate(truths):
        got, run_level = measured(recorder, step)
        assert set(got) == expected, (loop, step, sorted(got))
        assert [got[m] for m in sorted(expected)] == pytest.approx([truth[m] for m in sorted(expected)], rel=REL)
        assert run_level == pytest.approx(max(truth.values()), rel=REL)


# --------------------------------------------------------------------------- a wrapped attention function

# The function a profiler, a logging shim or a drop-in library wraps with one that calls the original, and
# a zoo model that calls it. Whether the wrapper comes before or after the agent is imported is up to the
# user's imports, so both orders run, each in a fresh interpreter (the agent is imported once a process).
WRAPPED = {"F.softmax": ("softmax", "hf-gpt2-eager"),
           "F.scaled_dot_product_attention": ("scaled_dot_product_attention", "hf-llama-sdpa"),
           "F.multi_head_attention_forward": ("multi_head_attention_forward", "torch-transformer-encoder")}
_WRAP_RUN = """
import json, sys, tempfile
sys.path[:0] = {paths!r}
import torch.nn.functional as F

def wrap(name):
    original = getattr(F, name)

    def passthrough(*args, **kwargs):
        return original(*args, **kwargs)

    setattr(F, name, passthrough)

if {before!r}:
    for name in {names!r}:
        wrap(name)
import gradwatch.agent.capture.attention   # noqa: F401 - the agent as attach() imports it
if not {before!r}:
    for name in {names!r}:
        wrap(name)
from agent_helpers import RecordingTransport
from test_attention_zoo import ZOO, declared_attention, measured, train
out = {{}}
for case, model_id in {cases!r}.items():
    rec = RecordingTransport()
    model, truths, _ = train(ZOO[model_id], {{"spool_dir": tempfile.mkdtemp(dir="."), "run": case,
                                              "flush_interval": 0.1}},
                             transport=rec)
    out[case] = {{"expected": sorted(declared_attention(ZOO[model_id], model)), "truths": truths,
                 "measured": [measured(rec, step) for step in range(len(truths))]}}
print("RESULT " + json.dumps(out))
"""


@pytest.fixture(scope="module")
def wrapped_runs(tmp_path_factory) -> dict[str, dict]:
    import json
    import subprocess
    import sys
    from pathlib import Path

    here = Path(__file__).resolve().parent
    runs = {}
    for order in ("wrapped-before-import", "wrapped-after-import"):
        code = _WRAP_RUN.format(paths=[str(here), str(here.parents[1])], before=order == "wrapped-before-import",
                                names=[n for n, _ in WRAPPED.values()],
                                cases={case: model_id for case, (_, model_id) in WRAPPED.items()})
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240,
                              cwd=tmp_path_factory.mktemp("wrapped"))
        line = next((ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")), None)
        assert done.returncode == 0 and line, done.stderr[-3000:]
        runs[order] = json.loads(line[len("RESULT "):])
        runs[order]["stderr"] = done.stderr
    return runs


@pytest.mark.parametrize("order, wrapped", [
    ("wrapped-after-import", "F.softmax"),
    ("wrapped-after-import", "F.scaled_dot_product_attention"),
    ("wrapped-after-import", "F.multi_head_attention_forward"),
    ("wrapped-before-import", "F.softmax"),
    ("wrapped-before-import", "F.scaled_dot_product_attention"),
    ("wrapped-before-import", "F.multi_head_attention_forward"),
])
def test_a_pass_through_wrapper_around_the_attention_function_hides_nothing(order, wrapped, wrapped_runs):
    """Another library has wrapped the attention function with one that calls the original; the model's
    logits are still measured, exactly."""
    r = wrapped_runs[order][wrapped]
    expected = set(r["expected"])
    for step, (truth, (got, run_level)) in enumerate(zip(r["truths"], r["measured"])):
        assert set(got) == expected, f"{wrapped} {order}: measured {sorted(got)} of {sorted(expected)}"
        assert [got[m] for m in sorted(expected)] == pytest.approx([truth[m] for m in sorted(expected)], rel=REL)
        assert run_level == pytest.approx(max(truth.values()), rel=REL)


# --------------------------------------------------------------------------- the ground truth's own checks

TWINS = sorted({tuple(sorted((z.id, z.twin))) for z in ZOO.values() if z.twin})


@pytest.mark.parametrize("pair", TWINS, ids=["~".join(p) for p in TWINS])
def test_the_same_weights_give_the_same_ground_truth_under_both_implementations(pair):
    """Eager softmax and SDPA (or timm's / nanoGPT's two paths) of the same weights and inputs: the same
    output, and the SDPA recomputation's per-module maxima equal what the eager softmax really saw."""
    za, zb = ZOO[pair[0]], ZOO[pair[1]]
    ma, mb = za.build(), zb.build()
    mb.load_state_dict(ma.state_dict())
    results = []
    for step in range(2):
        batch, inputs = model_inputs(za, step)
        with GroundTruth(ma) as ga:
            oa = ma(**inputs)
        with GroundTruth(mb) as gb:
            ob = mb(**inputs)
        a, b = main_tensor(oa), main_tensor(ob)
        if "attention_mask" in inputs and a.dim() == 3 and a.shape[1] == inputs["attention_mask"].shape[1]:
            # padded queries may see no key at all (Mistral: padding + sliding window): eager spreads them
            # uniformly over finfo.min logits, SDPA gives zeros; only real tokens' outputs are compared
            real = inputs["attention_mask"].bool()
            a, b = a[real], b[real]
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5)
        ta, tb = check_ground_truth(za, ma, ga), check_ground_truth(zb, mb, gb)
        assert set(ta) == set(tb)
        for module in ta:
            assert tb[module] == pytest.approx(ta[module], rel=TWIN_REL), (pair, module)
        results.append(max(rel_err(tb[m], ta[m]) for m in ta))
        # the two sides saw the logits through different roads (else the check would prove nothing)
        assert {s for _, s, _ in ga.calls} != {s for _, s, _ in gb.calls}, (ga.calls, gb.calls)
    print(f"\nzoo twins: {pair[0]} vs {pair[1]}: max rel {max(results):.1e}")


@pytest.mark.parametrize("case", ["plain", "scale", "causal", "bool-mask", "float-mask", "gqa", "gqa-causal-scale"])
def test_the_reference_logits_reproduce_sdpas_own_attention_weights(case):
    """softmax of :func:`reference_sdpa_logits` (its left-out entries at -inf) equals the attention weights
    SDPA itself applies, read out with v = the identity (the output rows are then the weights)."""
    g = torch.Generator().manual_seed(7)
    hq, hk = (4, 2) if case.startswith("gqa") else (3, 3)
    L = S = 6
    q = torch.randn(2, hq, L, 5, generator=g, dtype=torch.float64) * 2
    k = torch.randn(2, hk, S, 5, generator=g, dtype=torch.float64) * 2
    v = torch.eye(S, dtype=torch.float64).expand(2, hk, S, S)
    kw: dict[str, Any] = {}
    if "scale" in case:
        kw["scale"] = 0.17
    if "causal" in case:
        kw["is_causal"] = True
    if case == "bool-mask":
        kw["attn_mask"] = torch.rand(2, 1, L, S, generator=g) > 0.3
        kw["attn_mask"][..., 0] = True
    if case == "float-mask":
        kw["attn_mask"] = torch.randn(1, hq, L, S, generator=g, dtype=torch.float64)
    if case.startswith("gqa"):
        kw["enable_gqa"] = True
    weights = F.scaled_dot_product_attention(q, k, v, **kw)
    logits, valid = reference_sdpa_logits(q, k, **kw)
    mine = logits.masked_fill(~valid, -math.inf).softmax(-1)
    torch.testing.assert_close(mine, weights, rtol=1e-9, atol=1e-12)


def test_the_ground_truth_notes_every_softmax_spelling_once():
    x = torch.randn(2, 3, 4, 5)
    probe = nn.Sequential(nn.Softmax(dim=-1))
    before = (F.softmax, torch.softmax, vars(torch.Tensor).get("softmax"), F.scaled_dot_product_attention)
    with GroundTruth(probe) as gt:
        F.softmax(x, dim=-1)
        torch.softmax(x, -1)
        x.softmax(dim=3)
        probe(x)
        F.softmax(x, dim=2)           # not over the key axis: not attention
        F.softmax(x[0], dim=1)        # 3-D, not over the key axis
        F.softmax(x[0], dim=-1)       # 3-D [batch·heads, query, key]: the fifth
    assert [s for _, s, _ in gt.calls] == ["softmax"] * 5
    assert [v for _, _, v in gt.calls] == pytest.approx([float(x.amax())] * 4 + [float(x[0].amax())])
    assert (F.softmax, torch.softmax, vars(torch.Tensor).get("softmax"), F.scaled_dot_product_attention) == before


# --------------------------------------------------------------------------- end to end through a real server

def test_a_zoo_model_through_a_real_server_stores_the_true_logits(shared_server, tmp_path):
    """T5 with SDPA (six attention modules: encoder, causal decoder and cross attention, position bias,
    padding) streamed to a real server: the per-module matrix and the run-level series it answers
    equal the ground truth."""
    srv = shared_server
    z = ZOO["hf-t5-sdpa"]
    model, truths, _ = train(z, {"server": srv.url, "project": "zoo", "run": "t5-sdpa",
                                  "spool_dir": str(tmp_path / "spool"), "flush_interval": 0.1})
    run = wait_until(lambda: (r := find_run(srv, "zoo", "t5-sdpa")) and r.get("last_step") == STEPS - 1 and r,
                     timeout=30, what="the zoo run's steps")
    status, m = srv.get(f"/api/v1/runs/{run['id']}/layers?stat=attn_logit_max&max_steps=100&max_layers=10000")
    assert status == 200, m
    assert m["steps"] == list(range(STEPS)) and m["layer_group_size"] == 1
    expected = declared_attention(z, model)
    rows = {name: row for name, row in zip(m["layers"], m["values"])}
    with_values = {name for name, row in rows.items() if any(v is not None for v in row)}
    assert with_values == expected
    for step, truth in enumerate(truths):
        for module in expected:
            assert rows[module][step] == pytest.approx(truth[module], rel=REL), (step, module)
    (event,) = stored_events(srv, "zoo", "t5-sdpa", kind="attention_coverage")
    assert sorted(event["data"]["measured"]) == sorted(expected), event
    status, series = srv.get(f"/api/v1/runs/{run['id']}/series?signal=attn_logit_max&max_points=100")
    assert status == 200, series
    assert [(p["step"], p["count"]) for p in series["steps"]] == [(s, 1) for s in range(STEPS)]
    for p, truth in zip(series["steps"], truths):
        assert p["last"] == pytest.approx(max(truth.values()), rel=REL)
