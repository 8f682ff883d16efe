"""The attention-logit zoo: tiny models whose attention is written in many different ways.

Each :class:`ZooModel` builds a small model with fixed random weights (no download), makes the
batches of a few training steps and the loss; ``attention_types`` names the classes of the modules
that compute attention in it, so that the set of modules a measurement must cover is declared here
and not derived from any measuring code. tests/agent/test_attention_zoo.py trains each one with
the agent attached and compares the stored attention logits with an independent ground truth.

What is in it (docs/early-warning-logits.md, "The attention-logit zoo", says what "the logit" is in each):

* Hugging Face transformers, built from their configs, each with ``attn_implementation`` "eager" and
  "sdpa": GPT-2 (per-layer scaling 1/(√d·(layer+1))), Llama (grouped-query, rotary), Mistral
  (grouped-query, rotary, sliding window, padding), BERT and DistilBERT (padding), ALBERT (one
  attention module shared by all layers: several calls a forward), ViT, OPT,
  GPT-NeoX (fused ``query_key_value``, partial rotary), T5 (relative position bias, no scaling;
  encoder, causal decoder and cross attention, padding).
* A ViT written as timm's ``VisionTransformer`` is (``timm.layers.Attention``: fused ``qkv``,
  ``fused_attn`` switching between ``F.scaled_dot_product_attention`` and ``q * scale @ kᵀ`` then
  ``.softmax``), because timm itself cannot be imported here: it imports torchvision at import time
  (``timm/layers/create_norm.py``) and the only torchvision wheel the registry has for torch 2.13.0 is
  built against the CUDA torch: beside the CPU build it fails with "operator torchvision::nms does not
  exist". The transcription keeps timm's module names and state-dict keys (checked once against
  timm 1.0.31: the same weights give the same outputs, fused and not).
* nanoGPT's ``CausalSelfAttention`` (Karpathy, MIT licence), verbatim: flash (SDPA, ``is_causal``) and
  the manual ``masked_fill(-inf)`` + ``F.softmax`` path.
* ``torch.nn.TransformerEncoder`` (``nn.MultiheadAttention`` under ``F.multi_head_attention_forward``)
  with a causal mask and a key padding mask.
* Six hand-written styles (``own-*``): head counts kept as ``h``/``dh``, ``n_attn_heads``, ``groups``,
  ``n_q_heads``/``n_kv_heads``; separate and fused projections; ``torch.softmax``, ``Tensor.softmax``,
  ``nn.Softmax``, ``F.softmax`` and SDPA with ``scale=``, a bool mask and ``enable_gqa``; einsum with a
  learned temperature; ALiBi; a helper function given the module; cross attention through a
  ``nn.MultiheadAttention`` with its default ``need_weights=True``, nested in a module that runs its own
  attention too.
* Two with a 3-D softmax over ``[batch·heads, query, key]`` scores from a batched product: fairseq's
  ``MultiheadAttention`` (``torch.baddbmm``, the scaling folded into q, an additive causal mask and a
  key padding mask) and a plain ``torch.bmm`` one that also runs batched products that are not
  attention (with a parameter; ``probs @ v``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, D, HEADS, T, B = 64, 32, 4, 12, 3


@dataclass
class ZooModel:
    id: str
    build: Callable[[], nn.Module]               # fixed weights: seeds inside
    batch: Callable[[int], dict]                 # step -> keyword arguments of the model's forward
    loss: Callable[[Any, dict], torch.Tensor]    # (output, batch) -> scalar loss
    attention_types: tuple[str, ...]             # class names of the modules that compute attention
    twin: Optional[str] = None                   # the same weights under the other implementation (eager <-> sdpa)
    lr: float = 1e-2
    notes: str = ""
    expected_count: int = 0                      # how many attention modules (a second, literal check)
    # the test asserts that in some module and step a masked SDPA / MultiheadAttention logit would have
    # been the max: set where that holds for these weights and inputs (docs/early-warning-logits.md)
    masks_matter: bool = False
    calls_per_module: int = 1                    # attention calls credited to each module in one forward


# --------------------------------------------------------------------------- inputs

def tokens(step: int, length: int = T) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randint(1, VOCAB, (B, length), generator=g)


def padding(length: int = T) -> torch.Tensor:
    """1 = a real token, 0 = padding (right padding): the samples' last 2, 6 and 9 positions are padding,
    about half of all (query, key) pairs: enough that a padded key would often hold the largest logit."""
    m = torch.ones(B, length, dtype=torch.long)
    for b, n in enumerate((2, 6, 9)):
        m[b, length - n:] = 0
    return m


def images(step: int, size: int = 16) -> torch.Tensor:
    g = torch.Generator().manual_seed(200 + step)
    return torch.randn(B, 3, size, size, generator=g)


def classes(step: int, n: int = 5) -> torch.Tensor:
    g = torch.Generator().manual_seed(300 + step)
    return torch.randint(0, n, (B,), generator=g)


def lm_batch(step: int, pad: bool) -> dict:
    idx = tokens(step)
    out = {"input_ids": idx, "labels": idx.clone()}
    if pad:
        mask = padding()
        idx[mask == 0] = 0                      # the pad token
        out["attention_mask"] = mask
        out["labels"][mask == 0] = -100
    return out


def hf_loss(out, batch) -> torch.Tensor:
    return out.loss


def next_token_loss(logits, batch) -> torch.Tensor:
    idx = batch["idx"]
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), idx[:, 1:].reshape(-1))


def class_loss(logits, batch) -> torch.Tensor:
    return F.cross_entropy(logits, batch["target"])


# --------------------------------------------------------------------------- Hugging Face transformers

def _hf(cls_name: str, config_name: str, impl: str, **config) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        import transformers
        cfg = getattr(transformers, config_name)(**config)
        torch.manual_seed(0)
        model = getattr(transformers, cls_name)._from_config(cfg, attn_implementation=impl)
        return model.train()
    return build


def hf_models() -> list[ZooModel]:
    tok = dict(bos_token_id=1, eos_token_id=2, pad_token_id=0)
    specs = [
        # id, model class, config class, config, batch, attention class, how many, notes
        ("gpt2", "GPT2LMHeadModel", "GPT2Config",
         dict(vocab_size=VOCAB, n_positions=16, n_embd=D, n_layer=2, n_head=HEADS, resid_pdrop=0.0, embd_pdrop=0.0,
              attn_pdrop=0.0, scale_attn_by_inverse_layer_idx=True, **tok),
         lambda s: lm_batch(s, pad=True), ("GPT2Attention",), 2,
         "fused Conv1D c_attn; scale 1/(sqrt(d)*(layer+1)); causal + padding"),
        ("llama", "LlamaForCausalLM", "LlamaConfig",
         dict(vocab_size=VOCAB, hidden_size=D, intermediate_size=64, num_hidden_layers=2, num_attention_heads=HEADS,
              num_key_value_heads=2, max_position_embeddings=16, attention_dropout=0.0, **tok),
         lambda s: lm_batch(s, pad=False), ("LlamaAttention",), 2,
         "GQA 4 query / 2 key heads, rotary; sdpa: enable_gqa=True, is_causal"),
        ("mistral", "MistralForCausalLM", "MistralConfig",
         dict(vocab_size=VOCAB, hidden_size=D, intermediate_size=64, num_hidden_layers=2, num_attention_heads=HEADS,
              num_key_value_heads=2, max_position_embeddings=16, sliding_window=5, attention_dropout=0.0, **tok),
         lambda s: lm_batch(s, pad=True), ("MistralAttention",), 2,
         "GQA, rotary, sliding window 5, padding; sdpa: repeated key heads and an explicit mask"),
        ("bert", "BertForMaskedLM", "BertConfig",
         dict(vocab_size=VOCAB, hidden_size=D, num_hidden_layers=2, num_attention_heads=HEADS, intermediate_size=64,
              max_position_embeddings=16, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, pad_token_id=0),
         lambda s: lm_batch(s, pad=True), ("BertSelfAttention",), 2, "bidirectional, padding"),
        ("distilbert", "DistilBertForMaskedLM", "DistilBertConfig",
         dict(vocab_size=VOCAB, dim=D, n_layers=2, n_heads=HEADS, hidden_dim=64, max_position_embeddings=16,
              dropout=0.0, attention_dropout=0.0, pad_token_id=0),
         lambda s: lm_batch(s, pad=True), ("DistilBertSelfAttention",), 2, "q_lin/k_lin, padding"),
        ("albert", "AlbertForMaskedLM", "AlbertConfig",
         dict(vocab_size=VOCAB, embedding_size=16, hidden_size=D, num_hidden_layers=3, num_attention_heads=HEADS,
              intermediate_size=64, max_position_embeddings=16, hidden_dropout_prob=0.0,
              attention_probs_dropout_prob=0.0, pad_token_id=0),
         lambda s: lm_batch(s, pad=True), ("AlbertAttention",), 1,
         "one attention module shared by the 3 layers: called 3 times a forward, its value the max of the 3; padding"),
        ("vit", "ViTForImageClassification", "ViTConfig",
         dict(image_size=16, patch_size=4, num_channels=3, hidden_size=D, num_hidden_layers=2, num_attention_heads=HEADS,
              intermediate_size=64, num_labels=5, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0),
         lambda s: {"pixel_values": images(s), "labels": classes(s)}, ("ViTAttention",), 2, "17 tokens (16 patches + CLS)"),
        ("opt", "OPTForCausalLM", "OPTConfig",
         dict(vocab_size=VOCAB, hidden_size=D, num_hidden_layers=2, ffn_dim=64, num_attention_heads=HEADS,
              max_position_embeddings=16, word_embed_proj_dim=D, dropout=0.0, attention_dropout=0.0, **tok),
         lambda s: lm_batch(s, pad=True), ("OPTAttention",), 2, "causal + padding"),
        ("gpt_neox", "GPTNeoXForCausalLM", "GPTNeoXConfig",
         dict(vocab_size=VOCAB, hidden_size=D, num_hidden_layers=2, num_attention_heads=HEADS, intermediate_size=64,
              max_position_embeddings=16, rotary_pct=0.5, attention_dropout=0.0, hidden_dropout=0.0, **tok),
         lambda s: lm_batch(s, pad=False), ("GPTNeoXAttention",), 2, "fused query_key_value, rotary on half the dims"),
        ("t5", "T5ForConditionalGeneration", "T5Config",
         dict(vocab_size=VOCAB, d_model=D, d_kv=8, d_ff=64, num_layers=2, num_heads=HEADS, relative_attention_num_buckets=8,
              relative_attention_max_distance=16, dropout_rate=0.0, decoder_start_token_id=0, **tok),
         lambda s: lm_batch(s, pad=True), ("T5Attention",), 6,
         "relative position bias added to the logits, no 1/sqrt(d); encoder self, causal decoder self, cross"),
    ]
    out = []
    for ident, cls, cfg_cls, cfg, batch, types, count, notes in specs:
        for impl, other in (("eager", "sdpa"), ("sdpa", "eager")):
            out.append(ZooModel(f"hf-{ident}-{impl}", _hf(cls, cfg_cls, impl, **cfg), batch, hf_loss, types,
                                twin=f"hf-{ident}-{other}", notes=notes, expected_count=count,
                                masks_matter=impl == "sdpa" and ident != "vit",
                                calls_per_module=cfg.get("num_hidden_layers", 1) if ident == "albert" else 1))
    return out


# --------------------------------------------------------------------------- timm's VisionTransformer, transcribed

class TimmAttention(nn.Module):
    """timm.layers.Attention (timm 1.0.31, Apache-2.0) without the options a plain ViT leaves off."""

    def __init__(self, dim: int, num_heads: int = 8, qkv_bias: bool = True, fused_attn: bool = True):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.scale = self.head_dim ** -0.5
        self.fused_attn = fused_attn
        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias)
        self.q_norm = nn.Identity()
        self.k_norm = nn.Identity()
        self.attn_drop = nn.Dropout(0.0)
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(0.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B_, N, C = x.shape
        qkv = self.qkv(x).reshape(B_, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        q, k = self.q_norm(q), self.k_norm(k)
        if self.fused_attn:
            x = F.scaled_dot_product_attention(q, k, v, dropout_p=self.attn_drop.p if self.training else 0.)
        else:
            q = q * self.scale
            attn = q @ k.transpose(-2, -1)
            attn = attn.softmax(dim=-1)
            attn = self.attn_drop(attn)
            x = attn @ v
        x = x.transpose(1, 2).reshape(B_, N, C)
        return self.proj_drop(self.proj(x))


class TimmMlp(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class TimmBlock(nn.Module):
    def __init__(self, dim: int, num_heads: int, fused_attn: bool):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = TimmAttention(dim, num_heads, fused_attn=fused_attn)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.mlp = TimmMlp(dim, 4 * dim)

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class TimmPatchEmbed(nn.Module):
    def __init__(self, patch: int, dim: int):
        super().__init__()
        self.proj = nn.Conv2d(3, dim, kernel_size=patch, stride=patch)

    def forward(self, x):
        return self.proj(x).flatten(2).transpose(1, 2)


class TimmVisionTransformer(nn.Module):
    """timm's ``vit_tiny_patch16_224`` layout at img_size 16, patch 4, depth 2, width 32, 4 heads."""

    def __init__(self, fused_attn: bool, img: int = 16, patch: int = 4, dim: int = D, depth: int = 2,
                 num_classes: int = 5):
        super().__init__()
        self.patch_embed = TimmPatchEmbed(patch, dim)
        self.cls_token = nn.Parameter(torch.randn(1, 1, dim) * 0.02)
        self.pos_embed = nn.Parameter(torch.randn(1, (img // patch) ** 2 + 1, dim) * 0.02)
        self.blocks = nn.Sequential(*[TimmBlock(dim, HEADS, fused_attn) for _ in range(depth)])
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.head = nn.Linear(dim, num_classes)

    def forward(self, x):
        x = self.patch_embed(x)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embed
        x = self.norm(self.blocks(x))
        return self.head(x[:, 0])


def _timm_vit(fused: bool) -> Callable[[], nn.Module]:
    def build():
        torch.manual_seed(0)
        return TimmVisionTransformer(fused_attn=fused)
    return build


# --------------------------------------------------------------------------- nanoGPT (model.py, MIT licence)

class NanoGPTConfig:
    block_size, vocab_size, n_layer, n_head, n_embd, dropout, bias = 16, VOCAB, 2, HEADS, D, 0.0, True


class CausalSelfAttention(nn.Module):
    """nanoGPT's attention as written in model.py."""

    def __init__(self, config):
        super().__init__()
        assert config.n_embd % config.n_head == 0
        # key, query, value projections for all heads, but in a batch
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        # output projection
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        # regularization
        self.attn_dropout = nn.Dropout(config.dropout)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.n_head = config.n_head
        self.n_embd = config.n_embd
        self.dropout = config.dropout
        # flash attention make GPU go brrrrr but support is only in PyTorch >= 2.0
        self.flash = hasattr(torch.nn.functional, 'scaled_dot_product_attention')
        if not self.flash:
            print("WARNING: using slow attention. Flash Attention requires PyTorch >= 2.0")
        # causal mask to ensure that attention is only applied to the left in the input sequence
        self.register_buffer("bias", torch.tril(torch.ones(config.block_size, config.block_size))
                             .view(1, 1, config.block_size, config.block_size))

    def forward(self, x):
        B, T, C = x.size()  # batch size, sequence length, embedding dimensionality (n_embd)

        # calculate query, key, values for all heads in batch and move head forward to be the batch dim
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)

        # causal self-attention; Self-attend: (B, nh, T, hs) x (B, nh, hs, T) -> (B, nh, T, T)
        if self.flash:
            # efficient attention using Flash Attention CUDA kernels
            y = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=None,
                                                                 dropout_p=self.dropout if self.training else 0,
                                                                 is_causal=True)
        else:
            # manual implementation of attention
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
            att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float('-inf'))
            att = F.softmax(att, dim=-1)
            att = self.attn_dropout(att)
            y = att @ v  # (B, nh, T, T) x (B, nh, T, hs) -> (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # re-assemble all head outputs side by side

        # output projection
        y = self.resid_dropout(self.c_proj(y))
        return y


class NanoMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)

    def forward(self, x):
        return self.c_proj(self.gelu(self.c_fc(x)))


class NanoBlock(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = NanoMLP(config)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class NanoGPT(nn.Module):
    """nanoGPT's GPT (wte, wpe, h, ln_f, tied lm_head), returning the logits."""

    def __init__(self, flash: bool):
        super().__init__()
        c = NanoGPTConfig()
        self.transformer = nn.ModuleDict(dict(wte=nn.Embedding(c.vocab_size, c.n_embd),
                                              wpe=nn.Embedding(c.block_size, c.n_embd),
                                              h=nn.ModuleList([NanoBlock(c) for _ in range(c.n_layer)]),
                                              ln_f=nn.LayerNorm(c.n_embd, bias=c.bias)))
        self.lm_head = nn.Linear(c.n_embd, c.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight
        for blk in self.transformer.h:
            blk.attn.flash = flash
        # nanoGPT's init: N(0, 0.02), the residual projections scaled by 1/sqrt(2 * n_layer)
        self.apply(self._init_weights)
        for pn, p in self.named_parameters():
            if pn.endswith('c_proj.weight'):
                torch.nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * c.n_layer))

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx):
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for blk in self.transformer.h:
            x = blk(x)
        return self.lm_head(self.transformer.ln_f(x))


def _nanogpt(flash: bool) -> Callable[[], nn.Module]:
    def build():
        torch.manual_seed(0)
        return NanoGPT(flash)
    return build


# --------------------------------------------------------------------------- torch.nn.TransformerEncoder

class TorchEncoderLM(nn.Module):
    """A causal LM on ``nn.TransformerEncoder`` (batch_first), with a key padding mask."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D)
        layer = nn.TransformerEncoderLayer(D, HEADS, dim_feedforward=64, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.out = nn.Linear(D, VOCAB)

    def forward(self, idx, keep):
        causal = nn.Transformer.generate_square_subsequent_mask(idx.shape[1])          # float, -inf above
        padded = torch.zeros(keep.shape).masked_fill(keep == 0, float("-inf"))         # float too (same type)
        h = self.encoder(self.emb(idx), mask=causal, src_key_padding_mask=padded, is_causal=True)
        return self.out(h)


def _seeded(cls, *args) -> Callable[[], nn.Module]:
    def build():
        torch.manual_seed(0)
        return cls(*args)
    return build


# --------------------------------------------------------------------------- hand-written styles

class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(D, 2 * D), nn.Linear(2 * D, D)

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))


class Residual(nn.Module):
    """Pre-norm block around any attention module taking (x, **extra)."""

    def __init__(self, attn: nn.Module):
        super().__init__()
        self.n1, self.mixer, self.n2, self.ff = nn.LayerNorm(D), attn, nn.LayerNorm(D), MLP()

    def forward(self, x, **extra):
        x = x + self.mixer(self.n1(x), **extra)
        return x + self.ff(self.n2(x))


class TokenModel(nn.Module):
    """Embedding, blocks (a ModuleList of Residual), a head; ``pool``: classify the mean token."""

    def __init__(self, make_attn: Callable[[], nn.Module], n_out: int = VOCAB, pool: bool = False, layers: int = 2):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        self.pos = nn.Parameter(torch.randn(T, D) * 0.1)
        self.blocks = nn.ModuleList(Residual(make_attn()) for _ in range(layers))
        self.head = nn.Linear(D, n_out)
        self.pool = pool

    def forward(self, idx, **extra):
        x = self.embed(idx) + self.pos[: idx.shape[1]]
        for blk in self.blocks:
            x = blk(x, **extra)
        return self.head(x.mean(1) if self.pool else x)


class HdhAttention(nn.Module):
    """Style 1 (the issue's first report): ``h``/``dh``, q_proj/k_proj/v_proj, ``torch.softmax`` of
    q·kᵀ/√dh plus an additive causal mask (-inf above the diagonal)."""

    def __init__(self):
        super().__init__()
        self.h, self.dh = HEADS, D // HEADS
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(D, D) for _ in range(4))
        self.register_buffer("causal_mask", torch.full((T, T), float("-inf")).triu(1), persistent=False)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (p(x).view(b, t, self.h, self.dh).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        att = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(self.dh) + self.causal_mask[:t, :t], -1)
        return self.o_proj((att @ v).transpose(1, 2).reshape(b, t, D))


class QueryKeyAttention(nn.Module):
    """Style 2: separate ``query_proj``/``key_proj``/``value_proj``, ``n_attn_heads``, SDPA with an explicit
    ``scale=`` (not 1/√d) and a bool key-padding mask (True = attend)."""

    def __init__(self):
        super().__init__()
        self.n_attn_heads = HEADS
        self.query_proj, self.key_proj, self.value_proj = nn.Linear(D, D), nn.Linear(D, D), nn.Linear(D, D)
        self.out_proj = nn.Linear(D, D)
        self.softmax_scale = 0.25

    def forward(self, x, keep):
        b, t, _ = x.shape
        split = lambda z: z.reshape(b, t, self.n_attn_heads, -1).permute(0, 2, 1, 3)  # noqa: E731
        q, k, v = split(self.query_proj(x)), split(self.key_proj(x)), split(self.value_proj(x))
        mask = keep.bool()[:, None, None, :]
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.softmax_scale)
        return self.out_proj(y.permute(0, 2, 1, 3).reshape(b, t, D))


class TemperatureAttention(nn.Module):
    """Style 3: one fused ``to_qkv``, heads as ``groups``, ``torch.einsum`` and a learned temperature
    (``exp`` of a Parameter) instead of 1/√d, ``Tensor.softmax``."""

    def __init__(self):
        super().__init__()
        self.groups = HEADS
        self.to_qkv = nn.Linear(D, 3 * D, bias=False)
        self.temperature = nn.Parameter(torch.tensor(math.log(0.5)))
        self.to_out = nn.Linear(D, D)

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = self.to_qkv(x).chunk(3, dim=-1)
        q, k, v = (z.reshape(b, n, self.groups, -1).transpose(1, 2) for z in (q, k, v))
        dots = torch.einsum("bhid,bhjd->bhij", q, k) * self.temperature.exp()
        attn = dots.softmax(dim=-1)
        out = torch.einsum("bhij,bhjd->bhid", attn, v)
        return self.to_out(out.transpose(1, 2).reshape(b, n, D))


def rotate(x: torch.Tensor, base: float = 100.0) -> torch.Tensor:
    """Rotary embedding on (b, heads, t, d), pairs (i, i + d/2)."""
    t, d = x.shape[-2], x.shape[-1]
    freq = base ** (-torch.arange(0, d // 2, dtype=torch.float32) / (d // 2))
    ang = torch.arange(t, dtype=torch.float32)[:, None] * freq[None]
    cos, sin = ang.cos(), ang.sin()
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class RotaryGQAAttention(nn.Module):
    """Style 4: ``wq`` and a fused ``wkv``, 4 query heads sharing 2 key heads (``n_q_heads``/``n_kv_heads``),
    rotary on q and k, then SDPA with ``is_causal=True, enable_gqa=True``."""

    def __init__(self):
        super().__init__()
        self.n_q_heads, self.n_kv_heads, self.hd = HEADS, 2, D // HEADS
        self.wq = nn.Linear(D, D, bias=False)
        self.wkv = nn.Linear(D, 2 * self.n_kv_heads * self.hd, bias=False)
        self.wo = nn.Linear(D, D, bias=False)

    def forward(self, x):
        b, t, _ = x.shape
        q = self.wq(x).view(b, t, self.n_q_heads, self.hd).transpose(1, 2)
        k, v = self.wkv(x).view(b, t, 2, self.n_kv_heads, self.hd).permute(2, 0, 3, 1, 4)
        q, k = rotate(q), rotate(k)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.wo(y.transpose(1, 2).reshape(b, t, D))


def attend(module: nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """Style 5's attention, in a function given the module (transformers' eager_attention_forward style)."""
    scores = torch.matmul(q, k.transpose(2, 3)) * module.scaling + bias
    return torch.matmul(module.softmax(scores), v)


class AlibiAttention(nn.Module):
    """Style 5: ``num_attention_heads``, ``qkv_proj`` fused, ALiBi (a per-head linear distance penalty)
    added to the logits, the causal part filled with finfo.min (not -inf), an ``nn.Softmax`` child; the
    attention is computed by :func:`attend`."""

    def __init__(self):
        super().__init__()
        self.num_attention_heads, self.head_size = HEADS, D // HEADS
        self.scaling = self.head_size ** -0.5
        self.qkv_proj = nn.Linear(D, 3 * D)
        self.dense = nn.Linear(D, D)
        self.softmax = nn.Softmax(dim=-1)
        slopes = torch.tensor([2.0 ** (-8 * (i + 1) / HEADS) for i in range(HEADS)])
        self.register_buffer("slopes", slopes, persistent=False)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = self.qkv_proj(x).view(b, t, 3, self.num_attention_heads, self.head_size).permute(2, 0, 3, 1, 4)
        pos = torch.arange(t)
        distance = (pos[None, :] - pos[:, None]).float()                       # j - i (<= 0 where allowed)
        bias = self.slopes[:, None, None] * distance                             # (heads, t, t)
        bias = bias.masked_fill(pos[None, :] > pos[:, None], torch.finfo(x.dtype).min)
        y = attend(self, q, k, v, bias[None])
        return self.dense(y.transpose(1, 2).reshape(b, t, D))


class LatentBlock(nn.Module):
    """Style 6: a Perceiver-like block. 4 learned latents cross-attend the tokens through an
    ``nn.MultiheadAttention`` (default ``need_weights=True``: explicit softmax inside
    ``F.multi_head_attention_forward``, bool key padding mask), then the block runs its own self
    attention over the latents with ``F.softmax`` (so this module and its child both hold a value:
    each computation is credited to the innermost module)."""

    def __init__(self):
        super().__init__()
        self.latents = nn.Parameter(torch.randn(4, D))
        self.cross = nn.MultiheadAttention(D, HEADS, batch_first=True)
        self.nh = HEADS
        self.to_q, self.to_kv = nn.Linear(D, D), nn.Linear(D, 2 * D)

    def forward(self, x, keep):
        b = x.shape[0]
        lat = self.latents.expand(b, -1, -1)
        lat = lat + self.cross(lat, x, x, key_padding_mask=keep == 0)[0]
        q = self.to_q(lat).view(b, 4, self.nh, -1).transpose(1, 2)
        k, v = (z.view(b, 4, self.nh, -1).transpose(1, 2) for z in self.to_kv(lat).chunk(2, dim=-1))
        w = F.softmax(q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5, dim=-1)
        return (w @ v).transpose(1, 2).reshape(b, 4, D)


class LatentClassifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        self.pos = nn.Parameter(torch.randn(T, D) * 0.5)
        self.perceive = nn.ModuleList(LatentBlock() for _ in range(2))
        self.head = nn.Linear(D, 5)

    def forward(self, idx, keep):
        x = self.embed(idx) + self.pos[: idx.shape[1]]
        out = 0
        for blk in self.perceive:
            out = out + blk(x, keep)
        return self.head(out.mean(1))


class FairseqAttention(nn.Module):
    """Style 7, fairseq's ``MultiheadAttention`` eager path (time-first ``[T, B, C]``): the scaling folded
    into q (``q_proj(x) * self.scaling``), heads folded into the batch (``[B·H, T, d]``), the scores by
    ``torch.baddbmm`` with the additive causal mask as its ``input``, the key padding applied on a 4-D
    view (``masked_fill(-inf)``) and viewed back, then fairseq's ``utils.softmax`` (``F.softmax(x,
    dim=-1, dtype=torch.float32)``) over the 3-D ``[B·H, T, S]`` tensor, ``type_as`` and
    ``torch.bmm(probs, v)``."""

    def __init__(self):
        super().__init__()
        self.embed_dim, self.num_heads = D, HEADS
        self.head_dim = D // HEADS
        self.scaling = self.head_dim ** -0.5
        self.k_proj, self.v_proj, self.q_proj, self.out_proj = (nn.Linear(D, D) for _ in range(4))

    def forward(self, x, keep):
        x = x.transpose(0, 1)                                             # [T, B, C], fairseq's layout
        tgt_len, bsz, _ = x.shape
        q = self.q_proj(x) * self.scaling
        k, v = self.k_proj(x), self.v_proj(x)
        q, k, v = (z.contiguous().view(-1, bsz * self.num_heads, self.head_dim).transpose(0, 1) for z in (q, k, v))
        src_len = k.shape[1]
        attn_mask = torch.full((tgt_len, src_len), float("-inf")).triu(1)
        attn_weights = torch.baddbmm(attn_mask, q, k.transpose(1, 2))   # [B·H, T, S]
        attn_weights = attn_weights.view(bsz, self.num_heads, tgt_len, src_len)
        attn_weights = attn_weights.masked_fill((keep == 0).unsqueeze(1).unsqueeze(2), float("-inf"))
        attn_weights = attn_weights.view(bsz * self.num_heads, tgt_len, src_len)
        attn_weights_float = F.softmax(attn_weights, dim=-1, dtype=torch.float32)
        attn_probs = attn_weights_float.type_as(attn_weights)
        attn = torch.bmm(attn_probs, v)                                    # [B·H, T, d]
        attn = attn.transpose(0, 1).contiguous().view(tgt_len, bsz, self.embed_dim)
        return self.out_proj(attn).transpose(0, 1)


class BmmAttention(nn.Module):
    """Style 8, plain ``torch.bmm``: a fused ``qkv``, heads folded into the batch, ``torch.bmm(q, kᵀ)``
    divided by √d, a causal ``masked_fill(-inf)`` on the 3-D scores, ``Tensor.softmax(-1)``, and two
    batched products that are not attention: a per-head gate computed by ``torch.bmm`` with a parameter
    (a batched linear layer, its output through ``sigmoid``) and the values' ``torch.bmm(probs, v)``."""

    def __init__(self):
        super().__init__()
        self.heads, self.d = HEADS, D // HEADS
        self.qkv = nn.Linear(D, 3 * D)
        self.gate = nn.Parameter(torch.randn(HEADS, self.d, self.d) * 0.3)
        self.proj = nn.Linear(D, D)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (z.reshape(b, t, self.heads, self.d).transpose(1, 2).reshape(b * self.heads, t, self.d)
                   for z in self.qkv(x).chunk(3, dim=-1))
        scores = torch.bmm(q, k.transpose(1, 2)) / math.sqrt(self.d)
        scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
        out = torch.bmm(scores.softmax(-1), v)                                 # [b·heads, t, d]
        gate = torch.bmm(v, self.gate.repeat(b, 1, 1)).sigmoid()               # not attention
        y = (out * gate).reshape(b, self.heads, t, self.d).transpose(1, 2).reshape(b, t, D)
        return self.proj(y)


def _own(make_attn, **kw) -> Callable[[], nn.Module]:
    def build():
        torch.manual_seed(0)
        return TokenModel(make_attn, **kw)
    return build


def lm(step: int) -> dict:
    return {"idx": tokens(step)}


def padded_tokens(step: int) -> dict:
    keep = padding()
    return {"idx": tokens(step).masked_fill(keep == 0, 0), "keep": keep}


def padded_classes(step: int) -> dict:
    return {**padded_tokens(step), "target": classes(step)}


def image_classes(step: int) -> dict:
    return {"x": images(step), "target": classes(step)}


def _model_inputs(batch: dict) -> dict:
    """The keyword arguments the model takes (the target is the loss's)."""
    return {k: v for k, v in batch.items() if k != "target"}


def other_models() -> list[ZooModel]:
    return [
        ZooModel("timm-vit-fused", _timm_vit(True), image_classes, class_loss, ("TimmAttention",), twin="timm-vit-manual",
                 notes="timm Attention, fused_attn=True: SDPA, default scale", expected_count=2),
        ZooModel("timm-vit-manual", _timm_vit(False), image_classes, class_loss, ("TimmAttention",), twin="timm-vit-fused",
                 notes="timm Attention, fused_attn=False: (q*scale)@k^T, Tensor.softmax", expected_count=2),
        ZooModel("nanogpt-flash", _nanogpt(True), lm, next_token_loss, ("CausalSelfAttention",), twin="nanogpt-manual",
                 notes="fused c_attn, SDPA is_causal", expected_count=2, masks_matter=True),
        ZooModel("nanogpt-manual", _nanogpt(False), lm, next_token_loss, ("CausalSelfAttention",), twin="nanogpt-flash",
                 notes="fused c_attn, masked_fill(-inf), F.softmax", expected_count=2),
        ZooModel("torch-transformer-encoder", _seeded(TorchEncoderLM), padded_tokens, next_token_loss,
                 ("MultiheadAttention",), notes="nn.TransformerEncoder, causal mask + key padding mask",
                 expected_count=2, masks_matter=True),
        ZooModel("own-h-dh-torch-softmax", _own(HdhAttention), lm, next_token_loss, ("HdhAttention",),
                 notes="self.h/self.dh, q_proj/k_proj, torch.softmax(q@k^T/sqrt(dh) + causal)", expected_count=2),
        ZooModel("own-query-key-sdpa-scale", _own(QueryKeyAttention, n_out=5, pool=True), padded_classes, class_loss,
                 ("QueryKeyAttention",), notes="query_proj/key_proj, SDPA scale=0.25, bool padding mask",
                 expected_count=2, masks_matter=True),
        ZooModel("own-to-qkv-einsum-temperature", _own(TemperatureAttention), lm, next_token_loss,
                 ("TemperatureAttention",), notes="fused to_qkv, einsum, learned temperature, Tensor.softmax",
                 expected_count=2),
        ZooModel("own-rotary-gqa-sdpa", _own(RotaryGQAAttention), lm, next_token_loss, ("RotaryGQAAttention",),
                 notes="wq + fused wkv, rotary, 4/2 heads, SDPA enable_gqa + is_causal", expected_count=2, masks_matter=True),
        ZooModel("own-alibi-helper-nn-softmax", _own(AlibiAttention), lm, next_token_loss, ("AlibiAttention",),
                 notes="qkv_proj, ALiBi + finfo.min causal fill, helper function, nn.Softmax child", expected_count=2),
        ZooModel("own-latent-cross-mha", _seeded(LatentClassifier), padded_classes, class_loss,
                 ("MultiheadAttention", "LatentBlock"),
                 notes="nn.MultiheadAttention cross attention (need_weights=True, key padding) inside a module with "
                       "its own F.softmax attention", expected_count=4, masks_matter=True, lr=1e-3),
        ZooModel("own-fairseq-baddbmm-3d", _own(FairseqAttention), padded_tokens, next_token_loss,
                 ("FairseqAttention",), notes="fairseq MultiheadAttention: q*scaling, baddbmm(causal mask, q, k^T), "
                 "key padding on a 4-D view, F.softmax(dtype=float32) over [B*H, T, S]", expected_count=2),
        ZooModel("own-bmm-3d", _own(BmmAttention), lm, next_token_loss, ("BmmAttention",),
                 notes="fused qkv, bmm(q, k^T)/sqrt(d), masked_fill(-inf) on [B*H, T, T], Tensor.softmax; a bmm "
                       "with a parameter and bmm(probs, v) beside it", expected_count=2),
    ]


ZOO: dict[str, ZooModel] = {z.id: z for z in hf_models() + other_models()}


def model_inputs(z: ZooModel, step: int) -> tuple[dict, dict]:
    """(the batch, the keyword arguments the model's forward takes)."""
    batch = z.batch(step)
    return batch, _model_inputs(batch)
