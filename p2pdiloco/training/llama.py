"""A Llama-style decoder-only transformer (Touvron et al. 2023, arXiv 2302.13971): RMSNorm, rotary position
embeddings, a SwiGLU MLP, no biases, tied or untied embeddings.

Modules and parameters carry the names of Hugging Face's `LlamaForCausalLM` (`model.embed_tokens`,
`model.layers.N.self_attn.q_proj`, ..., `lm_head`), and the rotary embedding follows its convention
(`rotate_half` on the two halves of each head, not interleaved pairs), so a state dict of this model *is* a
`LlamaForCausalLM` state dict: `p2pdiloco export` writes it as it is, with no renaming or permutation.
Build it with `model.build_model` (arch "llama") for the deterministic init every peer shares.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from p2pdiloco.config import ModelConfig
from p2pdiloco.training.lm import check_length, with_loss

RMS_NORM_EPS = 1e-5
"""RMSNorm's epsilon (Llama 2's value; written to an export's config.json as rms_norm_eps)."""
FFN_MULTIPLE = 64
"""`model.ffn_hidden = 0` rounds 8/3·d_model up to a multiple of this (Meta's Llama uses 256, which would
more than double the MLP of the small widths p2pdiloco trains on a laptop)."""


def ffn_hidden_size(cfg: ModelConfig) -> int:
    """Width of the SwiGLU MLP: `model.ffn_hidden`, or for 0 Llama's rule: 2/3 of a 4·d MLP (so that its three
    matrices cost what a 4·d GELU MLP's two do), rounded up to a multiple of `FFN_MULTIPLE`."""
    if cfg.ffn_hidden > 0:
        return cfg.ffn_hidden
    hidden = int(8 * cfg.d_model / 3)
    return FFN_MULTIPLE * math.ceil(hidden / FFN_MULTIPLE)


class RMSNorm(nn.Module):
    """x / rms(x) · gain, computed in fp32 (Zhang & Sennrich 2019; as Hugging Face's LlamaRMSNorm)."""

    def __init__(self, dim: int, eps: float = RMS_NORM_EPS) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def rope_tables(head_dim: int, seq_len: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotary angles, each (seq_len, head_dim), fp32 (Su et al. 2021, arXiv 2104.09864).

    Frequency i (of head_dim/2) is theta^(-2i/head_dim); both halves of a head use the same frequencies, as
    Hugging Face's Llama does (`torch.cat((freqs, freqs))`), which is what `rotate_half` expects.
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    freqs = torch.outer(torch.arange(seq_len, dtype=torch.float32), inv_freq)
    angles = torch.cat((freqs, freqs), dim=-1)
    return angles.cos(), angles.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """(x1, x2) -> (-x2, x1) on the two halves of the last dimension."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Attention(nn.Module):
    """Causal multi-head self-attention with rotary embeddings on queries and keys, no biases."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_head, self.head_dim = cfg.n_head, cfg.d_model // cfg.n_head
        self.dropout = cfg.dropout
        self.q_proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.k_proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.v_proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.o_proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        # (B, T, C) -> (B, n_head, T, head_dim), the layout scaled_dot_product_attention expects
        q, k, v = (p(x).view(B, T, self.n_head, self.head_dim).transpose(1, 2)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        cos, sin = cos.to(q.dtype), sin.to(q.dtype)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        return self.o_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class SwiGLU(nn.Module):
    """down(silu(gate(x)) · up(x)) (Shazeer 2020, arXiv 2002.05202)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        hidden = ffn_hidden_size(cfg)
        self.gate_proj = nn.Linear(cfg.d_model, hidden, bias=False)
        self.up_proj = nn.Linear(cfg.d_model, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """One pre-norm block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.d_model)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.d_model)
        self.mlp = SwiGLU(cfg)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.self_attn(self.input_layernorm(x), cos, sin))
        return x + self.drop(self.mlp(self.post_attention_layernorm(x)))


class LlamaBody(nn.Module):
    """Embedding, decoder layers and final norm: Hugging Face's `LlamaModel`, the `model.` of its names."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.n_layer))
        self.norm = RMSNorm(cfg.d_model)


class Llama(nn.Module):
    """Llama-style decoder-only language model, with GPT's forward signature (see model.GPT).

    Constructing it directly gives torch's default init; use `model.build_model` for the shared init.

    Args:
        cfg: Model shape; `rope_theta`, `ffn_hidden` and `tie_embeddings` are read here.
    """

    RESIDUAL_OUT = ("o_proj.weight", "down_proj.weight")
    """Projections that write into the residual stream (init scaled by 1/sqrt(2·n_layer), see build_model)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.model = LlamaBody(cfg)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        cos, sin = rope_tables(cfg.d_model // cfg.n_head, cfg.seq_len, cfg.rope_theta)
        # not persistent: derived from the config, so neither in checkpoints nor among the merged parameters
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Next-token logits for every position, and their loss when targets are given (see lm.py)."""
        T = check_length(idx, self.cfg.seq_len)
        cos, sin = self.rope_cos[:T], self.rope_sin[:T]
        x = self.model.embed_tokens(idx)
        for layer in self.model.layers:
            x = layer(x, cos, sin)
        logits = self.lm_head(self.model.norm(x))
        return with_loss(logits, targets)
