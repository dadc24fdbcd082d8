"""Tests of the byte-level GPT: shapes, initial loss, deterministic init, causality, learning."""

from __future__ import annotations

import math

import pytest
import torch

from p2pdiloco.config import ModelConfig
from p2pdiloco.training.model import GPT, build_model, count_params

CFG = ModelConfig(n_layer=2, n_head=4, d_model=64, seq_len=32, dropout=0.0, init_seed=7)


def _batch(cfg: ModelConfig, batch: int = 4, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def test_forward_shapes_and_initial_loss_near_uniform() -> None:
    model = build_model(CFG)
    x, y = _batch(CFG)
    logits, loss = model(x, y)
    assert logits.shape == (4, CFG.seq_len, 256)
    assert loss is not None and loss.dim() == 0
    # Small init weights give near-uniform predictions over 256 bytes: loss ~ ln(256) = 5.545.
    assert loss.item() == pytest.approx(math.log(256), abs=0.05)

    logits_only, no_loss = model(x[:, :10])
    assert no_loss is None
    assert logits_only.shape == (4, 10, 256)


def test_longer_than_context_is_rejected() -> None:
    model = build_model(CFG)
    with pytest.raises(ValueError, match="longer than model.seq_len"):
        model(torch.zeros(1, CFG.seq_len + 1, dtype=torch.long))


def test_build_model_is_bit_identical_per_seed_and_leaves_global_rng_alone() -> None:
    rng_before = torch.get_rng_state()
    a, b = build_model(CFG), build_model(CFG)
    assert torch.equal(torch.get_rng_state(), rng_before)

    names_a = [n for n, _ in a.named_parameters()]
    assert names_a == [n for n, _ in b.named_parameters()]
    for (name, pa), pb in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(pa, pb), name

    c = build_model(ModelConfig(**{**CFG.__dict__, "init_seed": CFG.init_seed + 1}))
    assert not torch.equal(a.wte.weight, c.wte.weight)
    assert not torch.equal(a.blocks[0].attn.c_attn.weight, c.blocks[0].attn.c_attn.weight)


def test_init_follows_gpt2_scheme() -> None:
    cfg = ModelConfig(n_layer=4, n_head=4, d_model=128, seq_len=64, init_seed=1)
    model = build_model(cfg)
    assert model.lm_head.weight is model.wte.weight
    assert model.wte.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert model.blocks[0].mlp.c_fc.weight.std().item() == pytest.approx(0.02, rel=0.05)
    resid = torch.cat([b.attn.c_proj.weight.flatten() for b in model.blocks])
    assert resid.std().item() == pytest.approx(0.02 / math.sqrt(2 * cfg.n_layer), rel=0.05)
    assert torch.count_nonzero(model.blocks[1].attn.c_attn.bias) == 0
    assert torch.equal(model.ln_f.weight, torch.ones(cfg.d_model))
    assert torch.count_nonzero(model.blocks[2].ln_1.bias) == 0


def test_count_params_counts_tied_matrix_once() -> None:
    d, n_layer = CFG.d_model, CFG.n_layer
    per_block = 12 * d * d + 13 * d  # qkv, attn proj, 4x MLP, two LayerNorms, with biases
    expected = 256 * d + CFG.seq_len * d + n_layer * per_block + 2 * d
    assert count_params(build_model(CFG)) == expected
    assert count_params(GPT(CFG)) == expected


def test_causal_attention_ignores_future_tokens() -> None:
    model = build_model(CFG).eval()
    x, _ = _batch(CFG, batch=2)
    changed = x.clone()
    changed[:, 20:] = (changed[:, 20:] + 1) % 256
    with torch.no_grad():
        before, _ = model(x)
        after, _ = model(changed)
    torch.testing.assert_close(before[:, :20], after[:, :20])
    assert not torch.allclose(before[:, 20:], after[:, 20:])


def test_a_few_adamw_steps_reduce_loss_on_a_fixed_batch() -> None:
    model = build_model(CFG)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    x, y = _batch(CFG, batch=8)
    losses = []
    for _ in range(20):
        _, loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 1.0, losses
