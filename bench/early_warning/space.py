"""The declared space the cases are drawn from, and the draw.

A case is drawn from the declared space by ``random.Random(CASE_SEED * 1000 + case_id)``: the same id gives
the same case on any machine. Every parameter trains at one learning rate (one param group), on CPU, no
clipping, no scaler; the LR warms up linearly from 0 over ``warmup`` steps (0: none) and then stays.

Five spaces, one id range each:

- ids 0-99 (:data:`ARCHS`, ``split.json``): attention models, dense, fp32;
- ids 100-159, *the other kinds* (:data:`KINDS_ARCHS`, ``split-kinds.json``, added 2026-12-07: early warning is
  judged on every kind of model): a model with no attention (``mlp_lm``), a mixture-of-experts Transformer
  (``moe_lm``) and four dense attention models, each in fp32 and under bf16 autocast (:data:`PRECISIONS`). The
  arch comes in turn and the precision flips every ``len(KINDS_ARCHS)`` ids, so each (arch, precision) pair
  has 5 ids. Every other parameter is drawn as in the first space;
- ids 200-279, *no attention* (:data:`NOATTN_ARCHS`, ``split-noattn.json``, added 2026-12-07: the other kinds
  held too few no-attention cases to split): an MLP language model, an MLP and a small CNN on the image task, a
  GRU language model, each in fp32 and bf16 (the precision flips every ``len(NOATTN_ARCHS)`` ids, 10 ids per
  pair);
- ids 300-359, *mixture of experts* (:data:`MOE_ARCHS`, ``split-moe.json``, added 2026-12-07: no rule read a
  router): the Switch-style Transformer of the other kinds (``moe_lm``) and two MoE models with no attention, a
  top-1 (``moe_mlp_lm``) and a top-2 router (``moe2_mlp_lm``), each in fp32 and bf16 (10 ids per pair);
- ids 400-439, *Hugging Face's mixtures of experts* (:data:`HFMOE_ARCHS`, ``split-hfmoe.json``, added 2026-12-07:
  H14 was chosen on our own routers, so it is shown on routers written by others): Mixtral, Qwen2-MoE and OLMoE
  language models and a Switch Transformers encoder classifying sequences (a 3-D router), built from their
  configs, each in fp32 and bf16 (5 ids per pair). Every id is held out: no rule is tuned on this space.

The LR of the divergent run (:func:`lr_search`, applied blindly, without gradwatch): start from a log-uniform
draw in the optimizer's :data:`LR_RANGE`; run plain PyTorch for up to :data:`BUDGET` steps; if the run
diverges (:mod:`.divergence`) before :data:`EARLIEST` the LR is divided by :data:`DOWN`, if it does not
diverge within the budget it is multiplied by :data:`UP`; once an LR too high and one too low are both
known, the next try is their geometric mean (bisection in log LR); the first LR whose divergence lands in
[EARLIEST, BUDGET) after the loss fell (:func:`.divergence.learned`: the loss first fell to LEARNED x its first
value; a run that diverges without having learned counts as an LR too high) is kept. After :data:`TRIES` tries without one the case is *rejected* (counted in the
report, never replaced by hand). The control is the same case (same init, same data) at the kept LR /
:data:`CONTROL_DIVISOR` for BUDGET steps; a control whose loss trips the divergence rule, or never falls to
LEARNED x its first value, is *invalid* and its case is left out of every figure (counted in the report).
"""
from __future__ import annotations

import math
import random
from dataclasses import asdict, dataclass

CASE_SEED = 41
BUDGET = 300            # steps of a run
EARLIEST = 80           # a divergence before this step is too early to warn of (the LR is lowered)
TRIES = 8
UP, DOWN = 2.0, 1.6
CONTROL_DIVISOR = 5.0

ARCHS = ("softmax4d", "baddbmm3d", "einsum", "sdpa_bool", "sdpa_alibi", "torch_encoder",
         "hf_gpt2", "hf_llama", "hf_bert", "hf_vit", "timm_vit")
OPTIMIZERS = ("adamw", "sgd_momentum", "rmsprop")
LR_RANGE = {"adamw": (2e-2, 2e-1), "sgd_momentum": (0.5, 5.0), "rmsprop": (5e-3, 5e-2)}
LEARNED = 0.95          # the loss must first fall to LEARNED x its first value (divergence.learned)
WARMUPS = (0, 0, 25, 50, 100, 200, 400)    # 400: the run ends inside its warm-up
DEPTHS = (1, 2, 3)
WIDTHS = (32, 48)
HEADS = (2, 4)
LM_BATCHES = (16, 32)          # sequences of 16 tokens: 256-512 tokens a step
CLS_BATCHES = (64, 128)        # classification: large enough that label noise cannot trip the rule
KINDS_FIRST, KINDS_N = 100, 60                 # the other kinds' ids: KINDS_FIRST .. KINDS_FIRST + KINDS_N - 1
KINDS_ARCHS = ("mlp_lm", "moe_lm", "hf_gpt2", "hf_llama", "softmax4d", "baddbmm3d")
PRECISIONS = ("fp32", "bf16")                  # bf16: the forward under torch.autocast("cpu", torch.bfloat16)
NOATTN_FIRST, NOATTN_N = 200, 80
NOATTN_ARCHS = ("mlp_lm", "mlp_cls", "conv_cls", "gru_lm")
MOE_FIRST, MOE_N = 300, 60
MOE_ARCHS = ("moe_mlp_lm", "moe2_mlp_lm", "moe_lm")
HFMOE_FIRST, HFMOE_N = 400, 40
HFMOE_ARCHS = ("hf_mixtral", "hf_qwen2_moe", "hf_olmoe", "hf_switch")
# the later spaces: (first id, how many, their archs in turn); the precision flips every len(archs) ids
LATER_SPACES = ((KINDS_FIRST, KINDS_N, KINDS_ARCHS), (NOATTN_FIRST, NOATTN_N, NOATTN_ARCHS),
                (MOE_FIRST, MOE_N, MOE_ARCHS), (HFMOE_FIRST, HFMOE_N, HFMOE_ARCHS))
IMAGE_ARCHS = ("hf_vit", "timm_vit", "mlp_cls", "conv_cls")     # the image task (models.py)
SEQUENCE_ARCHS = ("hf_bert", "hf_switch")                       # a sequence's class (models.py)


@dataclass(frozen=True)
class Case:
    id: int
    arch: str
    optimizer: str
    lr0: float                  # the first draw of the LR search
    warmup: int
    depth: int
    width: int
    heads: int
    batch: int
    seed: int
    precision: str = "fp32"

    def as_dict(self) -> dict:
        return asdict(self)


def draw(case_id: int) -> Case:
    r = random.Random(CASE_SEED * 1000 + case_id)
    arch, precision = ARCHS[case_id % len(ARCHS)], "fp32"   # architectures in turn: every one in both halves
    if case_id >= KINDS_FIRST:
        later = [(case_id - first, archs) for first, n, archs in LATER_SPACES if first <= case_id < first + n]
        if not later:
            ranges = ", ".join(f"{first}-{first + n - 1}" for first, n, _ in LATER_SPACES)
            raise ValueError(f"case ids run 0-{KINDS_FIRST - 1}, {ranges}, not {case_id}")
        (k, archs), = later
        arch, precision = archs[k % len(archs)], PRECISIONS[k // len(archs) % len(PRECISIONS)]
    opt = r.choice(OPTIMIZERS)
    lo, hi = LR_RANGE[opt]
    lr0 = math.exp(r.uniform(math.log(lo), math.log(hi)))
    heads = 4 if arch == "timm_vit" else r.choice(HEADS)       # the timm transcription has 4 heads
    cls = arch in SEQUENCE_ARCHS or arch in IMAGE_ARCHS
    return Case(case_id, arch, opt, lr0, r.choice(WARMUPS), r.choice(DEPTHS), r.choice(WIDTHS), heads,
                r.choice(CLS_BATCHES if cls else LM_BATCHES), r.randrange(1 << 30), precision)
