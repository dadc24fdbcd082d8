"""A small nanoGPT-style decoder-only transformer, and `build_model`, which builds the model `model.arch` names.

The GPT follows GPT-2 (Radford et al. 2019) as written in Karpathy's nanoGPT: learned position embeddings,
pre-LayerNorm blocks, a 4x GELU MLP and an LM head tied to the token embedding. The Llama-style model is in
llama.py.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from p2pdiloco.config import ModelConfig
from p2pdiloco.training.llama import Llama
from p2pdiloco.training.lm import check_length, with_loss

INIT_STD = 0.02
"""Standard deviation of the normal init of linear and embedding weights (GPT-2)."""


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention where each position sees only itself and earlier positions."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        if cfg.d_model % cfg.n_head != 0:
            raise ValueError(f"d_model={cfg.d_model} is not divisible by n_head={cfg.n_head}")
        self.n_head = cfg.n_head
        self.dropout = cfg.dropout
        self.c_attn = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.c_proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.resid_dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        # (B, T, C) -> (B, n_head, T, head_dim), the layout scaled_dot_product_attention expects.
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    """Position-wise feed-forward layer, 4x wider than the residual stream."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(cfg.d_model, 4 * cfg.d_model)
        self.c_proj = nn.Linear(4 * cfg.d_model, cfg.d_model)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x))))


class Block(nn.Module):
    """One pre-LayerNorm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Decoder-only transformer language model over byte tokens.

    Constructing it directly gives torch's default init and draws from the global RNG; use
    `build_model` for the deterministic GPT-2 init that every peer must share.

    Args:
        cfg: Model shape (layers, heads, width, context length, dropout, vocabulary size).
    """

    RESIDUAL_OUT = ("c_proj.weight",)
    """Projections that write into the residual stream (init scaled by 1/sqrt(2·n_layer), see build_model)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.wpe = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        # Weight tying (Press & Wolf 2017): one matrix embeds bytes and scores the next byte.
        self.lm_head.weight = self.wte.weight

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Next-token logits for every position, and their loss when targets are given (see lm.py)."""
        T = check_length(idx, self.cfg.seq_len)
        pos = torch.arange(T, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return with_loss(logits, targets)


def _normal_(param: torch.Tensor, std: float, generator: torch.Generator) -> None:
    # Draw in float64, then round to the parameter's dtype: torch's float32 CPU sampler takes a
    # vectorised path that differs between CPU kinds (AVX2, AVX-512, ARM), while the float64 path is
    # plain libm math, so peers on different machines get the same bits.
    values = torch.empty(param.shape, dtype=torch.float64).normal_(0.0, std, generator=generator)
    param.copy_(values)


def build_model(cfg: ModelConfig) -> GPT | Llama:
    """The model `cfg.arch` names ("gpt": `GPT`, "llama": llama.`Llama`), with initial weights that depend
    only on ``cfg``.

    Both use GPT-2's init: matrices (linear and embedding weights) normal(0, 0.02), biases zero, norm gains
    one, and the projections that write into the residual stream (`RESIDUAL_OUT` of each class) scaled by
    1/sqrt(2 * n_layer) so that the residual stream's variance does not grow with depth (GPT-2, Radford et al.
    2019). The global torch RNG is left untouched, so building a model does not change the data order or
    dropout masks of the caller.

    Args:
        cfg: Model shape, `arch` and ``init_seed``; equal configs give bit-identical parameters.

    Returns:
        The model on CPU, in training mode.
    """
    # Module constructors run torch's default init from the global RNG; fork it so the caller's
    # RNG stream is the same as if we had never been called. That default init is then overwritten.
    with torch.random.fork_rng(devices=[]):
        model = Llama(cfg) if cfg.arch == "llama" else GPT(cfg)
    generator = torch.Generator().manual_seed(cfg.init_seed)
    resid_std = INIT_STD / math.sqrt(2 * cfg.n_layer)
    with torch.no_grad():
        # named_parameters() yields a tied embedding/lm_head matrix once, in a fixed order.
        for name, param in model.named_parameters():
            if name.endswith(model.RESIDUAL_OUT):
                _normal_(param, resid_std, generator)
            elif param.dim() >= 2:
                _normal_(param, INIT_STD, generator)
            elif name.endswith("weight"):  # the only 1-d weights are norm gains (LayerNorm, RMSNorm)
                param.fill_(1.0)
            else:  # biases, LayerNorm's included
                param.zero_()
    return model


def count_params(model: nn.Module) -> int:
    """Number of parameter scalars in ``model``, counting tied matrices once.

    Args:
        model: Any torch module.

    Returns:
        Total number of elements over the model's unique parameters.
    """
    return sum(p.numel() for p in model.parameters())


def named_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's parameters by name, a tied matrix once under its first name (GPT: `wte.weight`; a tied
    llama: `model.embed_tokens.weight`, as Hugging Face's tied checkpoints have it): what `model.safetensors`
    and an export hold (safetensors refuses two names for one tensor)."""
    return {name: p.detach().contiguous() for name, p in model.named_parameters()}


@torch.no_grad()
def load_named_weights_(model: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Copy `named_weights`' tensors into `model` (tied matrices follow their first name).

    Raises:
        ValueError: the names or shapes differ from the model's.
    """
    params = dict(model.named_parameters())
    if set(params) != set(tensors):
        missing, extra = sorted(set(params) - set(tensors)), sorted(set(tensors) - set(params))
        raise ValueError(f"weights do not fit the model: missing {missing[:3]}, unexpected {extra[:3]}")
    for name, p in params.items():
        if tensors[name].shape != p.shape:
            raise ValueError(f"weights do not fit the model: {name} is {tuple(tensors[name].shape)}, "
                             f"the model's {tuple(p.shape)}")
        p.copy_(tensors[name])
