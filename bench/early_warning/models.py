"""The architectures of the declared space, tiny, with synthetic but learnable data.

Language models (every arch but hf_bert, hf_vit, timm_vit): 16-token sequences over 32 tokens from a fixed
random chain in which the token at t + 1 is one of 4 successors of the token at t - 2 (LAG), drawn uniformly
(the first 3 tokens uniform): a model must attend 2 positions back, so its attention is rewarded for
turning sharp; next-token cross-entropy falls from ln 32 = 3.47 towards (3 ln 32 + 13 ln 4) / 16 = 1.78.
hf_bert: the class of a sequence is its last token mod 4 or the next class (read from position 0:
attention again), hf_vit / timm_vit: the class of a 16x16 image is the quadrant of a bright 4x4 patch or the next one,
each with probability 1/2: the loss falls from ln 4 towards ln 2. The best model's loss is then the same on
every position and sample, so a batch's loss varies only by the model's own errors: batch noise
cannot put 5 losses in a row 1.5x above the running minimum on a healthy run.

The other kinds (space.py, ids 100-159) use the language-model data: ``mlp_lm`` has no attention (each
position sees the embeddings of its token and the 2 before it, LAG + 1 in all, through residual MLP blocks), and
``moe_lm`` is the hand-written Transformer (4-D softmax attention) whose MLP is a mixture of 4 experts with a
top-1 softmax router (Switch-style, no load-balancing loss). The no-attention space (ids 200-279) adds
``mlp_cls`` (the flattened image through residual MLP blocks), ``conv_cls`` (a small CNN: strided 3x3
convolutions with GELU, global average pooling) on the image task, and ``gru_lm`` (a GRU language model; the
token 2 back reaches it through its state). The mixture-of-experts space (ids 300-359) adds ``moe_mlp_lm`` and
``moe2_mlp_lm``: ``mlp_lm`` whose MLPs are mixtures of 4 experts, behind a top-1 router (Switch) or a top-2 one
whose two probabilities are renormalised (Mixtral), with no attention, so nothing but the router and the
experts can warn. The Hugging Face MoE space (ids 400-439) builds Mixtral, Qwen2-MoE and OLMoE from their configs
on the language-model data, and a Switch Transformers encoder with a head on position 0 (``SwitchClassifier``) on
``hf_bert``'s sequence task; their routers are Hugging Face's own code (Switch's over ``[batch, seq, experts]``,
with its default router jitter), and no load-balancing loss is added.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from .space import IMAGE_ARCHS, SEQUENCE_ARCHS, Case

V, T, C, IMG, LAG = 32, 16, 4, 16, 2


def causal(t: int) -> torch.Tensor:
    return torch.ones(t, t, dtype=torch.bool).tril()


def alibi(heads: int, t: int) -> torch.Tensor:
    slopes = torch.tensor([2.0 ** (-8.0 * (h + 1) / heads) for h in range(heads)])
    i = torch.arange(t)
    dist = (i[None, :] - i[:, None]).clamp(max=0).float()                 # -(i - j) for j <= i
    bias = slopes[:, None, None] * dist[None]
    return bias.masked_fill(~causal(t)[None], float("-inf"))               # (heads, t, t) float mask


class Attention(nn.Module):
    """Hand-written causal self-attention computed five ways (``kind``)."""

    def __init__(self, kind: str, dim: int, heads: int):
        super().__init__()
        self.kind, self.heads, self.dh = kind, heads, dim // heads
        self.q_proj, self.k_proj, self.v_proj = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.out_proj = nn.Linear(dim, dim)
        self.register_buffer("bias", alibi(heads, T), persistent=False)

    def forward(self, x):
        b, t, d = x.shape
        h, dh = self.heads, self.dh
        q, k, v = (p(x).view(b, t, h, dh).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        scale = dh ** -0.5
        if self.kind == "sdpa_bool":
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=causal(t))
        elif self.kind == "sdpa_alibi":
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=self.bias[:, :t, :t])
        elif self.kind == "baddbmm3d":      # fairseq / older Megatron: scores over [batch*heads, q, k]
            q3, k3, v3 = (z.reshape(b * h, t, dh) for z in (q, k, v))
            mask = torch.zeros(t, t).masked_fill(~causal(t), float("-inf")).expand(b * h, t, t)
            w = torch.baddbmm(mask, q3, k3.transpose(1, 2), alpha=scale)
            y = torch.bmm(F.softmax(w, dim=-1), v3).view(b, h, t, dh)
        else:
            if self.kind == "einsum":
                w = torch.einsum("bhqd,bhkd->bhqk", q, k) * scale
            else:                           # softmax4d
                w = (q @ k.transpose(-2, -1)) * scale
            w = w.masked_fill(~causal(t), float("-inf"))
            y = torch.softmax(w, dim=-1) @ v
        return self.out_proj(y.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    def __init__(self, kind: str, dim: int, heads: int):
        super().__init__()
        attention = "softmax4d" if kind == "moe_lm" else kind
        self.ln1, self.attn, self.ln2 = nn.LayerNorm(dim), Attention(attention, dim, heads), nn.LayerNorm(dim)
        self.mlp = MoE(dim) if kind == "moe_lm" else nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(),
                                                                    nn.Linear(4 * dim, dim))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class MoE(nn.Module):
    """A mixture of ``experts`` MLPs, each token sent to its top-1 expert and scaled by the router's probability
    of it (Switch Transformer): the router's gradient comes through that probability."""

    def __init__(self, dim: int, experts: int = 4, top: int = 1):
        super().__init__()
        self.top = top
        self.router = nn.Linear(dim, experts)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
                                     for _ in range(experts))

    def forward(self, x):
        flat = x.reshape(-1, x.shape[-1])
        probs = torch.softmax(self.router(flat).float(), dim=-1)
        if self.top == 1:
            top_p, top = probs.max(dim=-1)
            top_p, top = top_p[:, None], top[:, None]
        else:       # Mixtral: the top-k probabilities, renormalised to sum to 1
            top_p, top = probs.topk(self.top, dim=-1)
            top_p = top_p / top_p.sum(dim=-1, keepdim=True)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            idx, slot = (top == e).nonzero(as_tuple=True)
            if idx.numel():
                out = out.index_add(0, idx, (expert(flat[idx]) * top_p[idx, slot, None]).to(out.dtype))
        return out.reshape(x.shape)


class MlpBlock(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.ln = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        return x + self.mlp(self.ln(x))


class MoeBlock(nn.Module):
    """A residual block whose MLP is a mixture of experts (``top`` experts a token)."""

    def __init__(self, dim: int, top: int):
        super().__init__()
        self.ln, self.mlp = nn.LayerNorm(dim), MoE(dim, top=top)

    def forward(self, x):
        return x + self.mlp(self.ln(x))


class MlpLM(nn.Module):
    """No attention: position t reads the embeddings of tokens t, t - 1 .. t - LAG (zeros before the start).
    ``top`` > 0: each block's MLP is a mixture of experts routing each token to its ``top`` experts."""

    def __init__(self, dim: int, depth: int, top: int = 0):
        super().__init__()
        self.tok = nn.Embedding(V, dim)
        self.inp = nn.Linear((LAG + 1) * dim, dim)
        self.blocks = nn.Sequential(*[MoeBlock(dim, top) if top else MlpBlock(dim) for _ in range(depth)])
        self.ln, self.head = nn.LayerNorm(dim), nn.Linear(dim, V)

    def forward(self, input_ids):
        e = self.tok(input_ids)
        window = [F.pad(e, (0, 0, k, 0))[:, :e.shape[1]] for k in range(LAG + 1)]     # shifted k positions right
        return self.head(self.ln(self.blocks(self.inp(torch.cat(window, dim=-1)))))


class MlpCls(nn.Module):
    def __init__(self, dim: int, depth: int):
        super().__init__()
        self.inp = nn.Linear(3 * IMG * IMG, dim)
        self.blocks = nn.Sequential(*[MlpBlock(dim) for _ in range(depth)])
        self.ln, self.head = nn.LayerNorm(dim), nn.Linear(dim, C)

    def forward(self, x):
        return self.head(self.ln(self.blocks(self.inp(x.flatten(1)))))


class ConvCls(nn.Module):
    def __init__(self, dim: int, depth: int):
        super().__init__()
        layers, ch = [], 3
        for i in range(depth + 1):                       # 16x16 -> 8x8 -> 4x4 ...: a stride of 2 on all but the last
            layers += [nn.Conv2d(ch, dim, 3, stride=2 if i < 2 else 1, padding=1), nn.GELU()]
            ch = dim
        self.body, self.head = nn.Sequential(*layers), nn.Linear(dim, C)

    def forward(self, x):
        return self.head(self.body(x).mean(dim=(2, 3)))


class GruLM(nn.Module):
    def __init__(self, dim: int, depth: int):
        super().__init__()
        self.tok = nn.Embedding(V, dim)
        self.rnn = nn.GRU(dim, dim, num_layers=depth, batch_first=True)
        self.ln, self.head = nn.LayerNorm(dim), nn.Linear(dim, V)

    def forward(self, input_ids):
        y, _ = self.rnn(self.tok(input_ids))
        return self.head(self.ln(y))


NO_ATTENTION = {"mlp_lm": MlpLM, "mlp_cls": MlpCls, "conv_cls": ConvCls, "gru_lm": GruLM,    # (width, depth)
                "moe_mlp_lm": lambda dim, depth: MlpLM(dim, depth, top=1),
                "moe2_mlp_lm": lambda dim, depth: MlpLM(dim, depth, top=2)}


class TinyLM(nn.Module):
    def __init__(self, kind: str, dim: int, heads: int, depth: int):
        super().__init__()
        self.tok, self.pos = nn.Embedding(V, dim), nn.Parameter(torch.randn(T, dim) * 0.02)
        if kind == "torch_encoder":
            layer = nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.0, batch_first=True, norm_first=True)
            self.blocks = nn.TransformerEncoder(layer, depth, enable_nested_tensor=False)
        else:
            self.blocks = nn.Sequential(*[Block(kind, dim, heads) for _ in range(depth)])
        self.kind = kind
        self.ln, self.head = nn.LayerNorm(dim), nn.Linear(dim, V)

    def forward(self, input_ids):
        x = self.tok(input_ids) + self.pos[: input_ids.shape[1]]
        if self.kind == "torch_encoder":
            t = input_ids.shape[1]
            x = self.blocks(x, mask=nn.Transformer.generate_square_subsequent_mask(t), is_causal=True)
        else:
            x = self.blocks(x)
        return self.head(self.ln(x))


class SwitchClassifier(nn.Module):
    """Hugging Face's Switch Transformers encoder with a classification head on position 0 (the sequence task of
    ``hf_bert``: the class comes from the last token, so position 0 must attend to it)."""

    def __init__(self, encoder: nn.Module, dim: int):
        super().__init__()
        self.encoder, self.head = encoder, nn.Linear(dim, C)

    def forward(self, input_ids):
        return self.head(self.encoder(input_ids=input_ids).last_hidden_state[:, 0])


def _hf(case: Case) -> nn.Module:
    import transformers as tf
    d, h, n = case.width, case.heads, case.depth
    shape = dict(hidden_size=d, num_hidden_layers=n, num_attention_heads=h)
    common = dict(shape, intermediate_size=4 * d)
    # the decoders (Llama and the mixtures of experts): grouped-query attention, 2 query heads per key head
    decoder = dict(shape, vocab_size=V, max_position_embeddings=T, num_key_value_heads=max(1, h // 2))
    if case.arch == "hf_gpt2":
        cfg = tf.GPT2Config(vocab_size=V, n_positions=T, n_embd=d, n_layer=n, n_head=h, resid_pdrop=0.0,
                            embd_pdrop=0.0, attn_pdrop=0.0)
        cfg._attn_implementation = "eager"
        return tf.GPT2LMHeadModel(cfg)
    if case.arch == "hf_llama":
        cfg = tf.LlamaConfig(intermediate_size=4 * d, **decoder)
        cfg._attn_implementation = "sdpa"
        return tf.LlamaForCausalLM(cfg)
    if case.arch == "hf_bert":
        cfg = tf.BertConfig(vocab_size=V, max_position_embeddings=T, num_labels=C, hidden_dropout_prob=0.0,
                            attention_probs_dropout_prob=0.0, **common)
        cfg._attn_implementation = "eager"
        return tf.BertForSequenceClassification(cfg)
    if case.arch == "hf_mixtral":       # top-2 of 4 experts, softmax then topk over the flattened tokens
        cfg = tf.MixtralConfig(intermediate_size=2 * d, num_local_experts=4, num_experts_per_tok=2, **decoder)
        cfg._attn_implementation = "sdpa"
        return tf.MixtralForCausalLM(cfg)
    if case.arch == "hf_qwen2_moe":     # top-2 of 4 routed experts, not renormalised, beside a gated shared expert
        cfg = tf.Qwen2MoeConfig(intermediate_size=2 * d, moe_intermediate_size=2 * d,
                                shared_expert_intermediate_size=2 * d,
                                num_experts=4, num_experts_per_tok=2, **decoder)
        cfg._attn_implementation = "eager"
        return tf.Qwen2MoeForCausalLM(cfg)
    if case.arch == "hf_olmoe":         # top-2 of 8 experts, qk-layernorm in its attention
        cfg = tf.OlmoeConfig(intermediate_size=d, num_experts=8, num_experts_per_tok=2, eos_token_id=None,
                             pad_token_id=None, bos_token_id=None, **decoder)
        cfg._attn_implementation = "sdpa"
        return tf.OlmoeForCausalLM(cfg)
    if case.arch == "hf_switch":        # a Switch Transformers encoder, every block sparse: a 3-D top-1 router
        cfg = tf.SwitchTransformersConfig(vocab_size=V, d_model=d, d_kv=d // h, d_ff=4 * d, num_layers=n, num_heads=h,
                                          num_experts=4, expert_capacity=case.batch * T, num_sparse_encoder_layers=n,
                                          dropout_rate=0.0)
        cfg._attn_implementation = "eager"
        return SwitchClassifier(tf.SwitchTransformersEncoderModel(cfg), d)
    cfg = tf.ViTConfig(image_size=IMG, patch_size=4, num_channels=3, num_labels=C, hidden_dropout_prob=0.0,
                       attention_probs_dropout_prob=0.0, **common)
    cfg._attn_implementation = "eager"
    return tf.ViTForImageClassification(cfg)


def build(case: Case) -> tuple[nn.Module, Callable[[int], dict], Callable[[Any, dict], torch.Tensor]]:
    """(model, step -> batch of keyword arguments, (output, batch) -> loss); the same case, the same
    weights and batches."""
    torch.manual_seed(case.seed)
    if case.arch.startswith("hf_"):
        model = _hf(case)
    elif case.arch == "timm_vit":
        import sys
        from pathlib import Path
        sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
        from tests.agent.zoo_models import TimmVisionTransformer
        model = TimmVisionTransformer(fused_attn=bool(case.seed % 2), dim=case.width, depth=case.depth,
                                      num_classes=C)
    elif case.arch in NO_ATTENTION:
        model = NO_ATTENTION[case.arch](case.width, case.depth)
    else:
        model = TinyLM(case.arch, case.width, case.heads, case.depth)
    g = torch.Generator().manual_seed(case.seed + 1)
    succ = torch.stack([torch.randperm(V, generator=g)[:4] for _ in range(V)])     # 4 successors per token

    if case.arch in IMAGE_ARCHS:
        def batch(step: int) -> dict:
            gg = torch.Generator().manual_seed(case.seed * 7919 + step)
            y = torch.randint(0, C, (case.batch,), generator=gg)
            x = torch.randn(case.batch, 3, IMG, IMG, generator=gg) * 0.5
            for c in range(C):
                r, s = (c // 2) * 8 + 2, (c % 2) * 8 + 2
                x[y == c, :, r:r + 4, s:s + 4] += 1.5
            y = (y + torch.randint(0, 2, (case.batch,), generator=gg)) % C
            return {"pixel_values" if case.arch == "hf_vit" else "x": x, "labels": y}
    elif case.arch in SEQUENCE_ARCHS:
        def batch(step: int) -> dict:
            gg = torch.Generator().manual_seed(case.seed * 7919 + step)
            x = torch.randint(0, V, (case.batch, T), generator=gg)
            y = (x[:, -1] + torch.randint(0, 2, (case.batch,), generator=gg)) % C
            return {"input_ids": x, "labels": y}
    else:
        def batch(step: int) -> dict:
            gg = torch.Generator().manual_seed(case.seed * 7919 + step)
            x = torch.empty(case.batch, T + 1, dtype=torch.long)
            x[:, 0] = torch.randint(0, V, (case.batch,), generator=gg)
            x[:, :LAG + 1] = torch.randint(0, V, (case.batch, LAG + 1), generator=gg)
            pick = torch.randint(0, 4, (case.batch, T), generator=gg)
            for t in range(LAG, T):
                x[:, t + 1] = succ[x[:, t - LAG], pick[:, t]]
            return {"input_ids": x[:, :-1], "labels": x[:, 1:]}

    def loss(out, b: dict) -> torch.Tensor:
        logits = out.logits if hasattr(out, "logits") else out
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), b["labels"].reshape(-1))
    return model, batch, loss


def forward(model: nn.Module, case: Case, b: dict):
    """The model's forward on a batch (labels kept out: the loss is computed by the loop), under bf16 autocast
    for a bf16 case."""
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=case.precision == "bf16"):
        return _forward(model, case, b)


def _forward(model: nn.Module, case: Case, b: dict):
    if case.arch in IMAGE_ARCHS and case.arch != "hf_vit":
        return model(b["x"])
    key = "pixel_values" if case.arch == "hf_vit" else "input_ids"
    return model(**{key: b[key]})


def optimizer(case: Case, model: nn.Module, lr: float) -> torch.optim.Optimizer:
    ps = list(model.parameters())          # one param group: every parameter at one LR
    if case.optimizer == "adamw":
        return torch.optim.AdamW(ps, lr=lr, weight_decay=0.01)
    if case.optimizer == "sgd_momentum":
        return torch.optim.SGD(ps, lr=lr, momentum=0.9)
    return torch.optim.RMSprop(ps, lr=lr, alpha=0.99)


def lr_at(step: int, lr: float, warmup: int) -> float:
    return lr * min(1.0, (step + 1) / warmup) if warmup else lr
