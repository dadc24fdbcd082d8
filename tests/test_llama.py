"""Tests of the Llama-style model: shapes, deterministic init, tying, causality, learning, torch.compile, and the
config fields that select it."""

from __future__ import annotations

import logging
import math

import pytest
import torch

from p2pdiloco.config import Config, ConfigError, ModelConfig, fingerprint_digest, load_config, parse_set
from p2pdiloco.testing.inmemory import InMemoryMerger
from p2pdiloco.training import accel
from p2pdiloco.training.accel import EagerFallback, compile_for_training
from p2pdiloco.training.flat import flat_params
from p2pdiloco.training.learner import Learner
from p2pdiloco.training.llama import Llama, ffn_hidden_size
from p2pdiloco.training.model import build_model, count_params, load_named_weights_, named_weights
from p2pdiloco.training.reporting import MetricsLog

CFG = ModelConfig(arch="llama", n_layer=2, n_head=4, d_model=64, seq_len=32, init_seed=7)


def _batch(cfg: ModelConfig, batch: int = 4, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _with(cfg: ModelConfig, **changes) -> ModelConfig:
    return ModelConfig(**{**cfg.model_dump(), **changes})


def test_forward_backward_shapes_and_initial_loss_near_uniform() -> None:
    model = build_model(CFG)
    assert isinstance(model, Llama)
    x, y = _batch(CFG)
    logits, loss = model(x, y)
    assert logits.shape == (4, CFG.seq_len, 256)
    assert loss.item() == pytest.approx(math.log(256), abs=0.05)
    loss.backward()
    assert all(p.grad is not None and p.grad.shape == p.shape for p in model.parameters())
    logits_only, no_loss = model(x[:, :10])
    assert no_loss is None and logits_only.shape == (4, 10, 256)
    with pytest.raises(ValueError, match="longer than model.seq_len"):
        model(torch.zeros(1, CFG.seq_len + 1, dtype=torch.long))


def test_same_init_on_two_builds_and_global_rng_untouched() -> None:
    rng_before = torch.get_rng_state()
    a, b = build_model(CFG), build_model(CFG)
    assert torch.equal(torch.get_rng_state(), rng_before)
    assert torch.equal(flat_params(a), flat_params(b))
    c = build_model(_with(CFG, init_seed=8))
    assert not torch.equal(a.model.embed_tokens.weight, c.model.embed_tokens.weight)


def test_init_scheme_no_biases_and_tying() -> None:
    cfg = _with(CFG, n_layer=4, d_model=128)
    model = build_model(cfg)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert not any(name.endswith("bias") for name, _ in model.named_parameters())
    assert model.model.layers[0].mlp.gate_proj.weight.std().item() == pytest.approx(0.02, rel=0.05)
    resid = torch.cat([layer.self_attn.o_proj.weight.flatten() for layer in model.model.layers])
    assert resid.std().item() == pytest.approx(0.02 / math.sqrt(2 * cfg.n_layer), rel=0.05)
    assert torch.equal(model.model.norm.weight, torch.ones(cfg.d_model))

    untied = build_model(_with(cfg, tie_embeddings=False))
    assert untied.lm_head.weight is not untied.model.embed_tokens.weight
    assert count_params(untied) == count_params(model) + 256 * 128


def test_ffn_hidden_auto_is_llamas_rule_rounded_to_64() -> None:
    assert ffn_hidden_size(_with(CFG, d_model=128)) == 384  # 8/3·128 = 341.3 -> 384
    assert ffn_hidden_size(_with(CFG, d_model=64)) == 192  # 170.7 -> 192
    assert ffn_hidden_size(_with(CFG, ffn_hidden=100)) == 100
    assert build_model(_with(CFG, d_model=128)).model.layers[0].mlp.up_proj.weight.shape == (384, 128)


def test_causal_attention_ignores_future_tokens() -> None:
    model = build_model(CFG).eval()
    x, _ = _batch(CFG, batch=1)
    changed = x.clone()
    changed[0, 20:] = (changed[0, 20:] + 1) % 256
    with torch.no_grad():
        a, _ = model(x)
        b, _ = model(changed)
    torch.testing.assert_close(a[0, :20], b[0, :20])
    assert not torch.allclose(a[0, 20:], b[0, 20:])


def test_loss_falls_on_a_repeated_batch() -> None:
    torch.manual_seed(0)
    model = build_model(CFG)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    x, y = _batch(CFG)
    losses = []
    for _ in range(30):
        _, loss = model(x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.6 * losses[0], losses


@pytest.mark.parametrize("tie", [True, False])
def test_named_weights_round_trip_keeps_untied_head(tie: bool) -> None:
    cfg = _with(CFG, tie_embeddings=tie)
    a = build_model(cfg)
    names = set(named_weights(a))
    assert ("lm_head.weight" in names) == (not tie) and "model.embed_tokens.weight" in names
    b = build_model(_with(cfg, init_seed=99))
    load_named_weights_(b, named_weights(a))
    assert torch.equal(flat_params(a), flat_params(b))
    with pytest.raises(ValueError, match="do not fit"):
        load_named_weights_(build_model(_with(cfg, tie_embeddings=not tie)), named_weights(a))


def test_config_fields_checks_and_fingerprint() -> None:
    # the default (gpt) config's fingerprint is pinned: arch = gpt adds nothing to it, and it names what peers must
    # share to merge: guard.trust_decay (peers cutting slices by another owner rule, allreduce.owned_slice, must not
    # merge with these) and how members agree on (θg, momentum) (p2p_merger._agree, network/catch_up.py: peers that
    # send fp32 states, or average where these fetch the majority's model, must not either), and the wire protocol
    # (config/fingerprint.PROTOCOL_VERSION)
    assert fingerprint_digest(load_config(None, []).fingerprint()) == "9c9b86417d620e15"
    llama = load_config(None, [{"model": {"arch": "llama"}}])
    assert llama.fingerprint()["model"]["arch"] == "llama"
    untied = load_config(None, [{"model": {"arch": "llama", "tie_embeddings": "false"}}])
    assert fingerprint_digest(untied.fingerprint()) != fingerprint_digest(llama.fingerprint())
    assert Config().run.compile is False and Config().model.arch == "gpt"
    with pytest.raises(ConfigError, match="model.arch must be one of gpt, llama"):
        load_config(None, [{"model": {"arch": "mamba"}}])
    with pytest.raises(ConfigError, match="tie_embeddings = false needs model.arch = 'llama'"):
        load_config(None, [{"model": {"tie_embeddings": "false"}}])
    with pytest.raises(ConfigError, match="rope_theta"):
        load_config(None, [{"model": {"arch": "llama", "rope_theta": "0"}}])


def test_compiled_llama_trains_one_step_on_cpu(tmp_path) -> None:
    """run.compile = true: the learner's inner steps run through torch.compile (inductor, a C++ compiler on CPU)."""
    if not hasattr(torch, "compile"):
        pytest.skip("this torch has no torch.compile (torch >= 2.0 has it)")
    sets = ["model.arch=llama", "model.n_layer=1", "model.d_model=32", "model.n_head=2", "model.seq_len=16",
            "data.batch_size=2", "run.total_steps=10", "run.compile=true", "inner.warmup_steps=0"]
    cfg = load_config(None, [parse_set(sets)])
    x, y = _batch(cfg.model, batch=2)
    model = build_model(cfg.model)
    learner = Learner(cfg, model, lambda: (x, y), [], InMemoryMerger("p0", {"group_size": 1}), torch.device("cpu"),
                      MetricsLog(tmp_path / "metrics.jsonl"))
    assert isinstance(learner.train_model, EagerFallback)
    before = flat_params(model)
    first = learner.inner_step()
    if learner.train_model.failed:
        pytest.skip(f"torch.compile is not usable on this machine ({learner.train_model.failed}); on CPU its "
                    "inductor backend needs a C++ compiler (apt-get install g++)")
    assert not torch.equal(flat_params(model), before)
    with torch.no_grad():  # the compiled model computes what the eager one does, at the new weights
        torch.testing.assert_close(learner.train_model(x, y)[0], model(x, y)[0], rtol=1e-4, atol=1e-5)
    assert learner.inner_step() < first
    assert learner.train_model.failed is None


def test_compile_failure_falls_back_to_eager_with_a_warning(monkeypatch, caplog) -> None:
    def broken(*_a, **_k):
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr(accel.torch, "compile", lambda model: broken)
    model = build_model(CFG)
    step = compile_for_training(model, "abc123")
    x, y = _batch(CFG, batch=1)
    with caplog.at_level(logging.WARNING, logger="p2pdiloco.training.accel"):
        logits, _ = step(x, y)
    assert step.failed == "RuntimeError: no C++ compiler"
    assert "[abc123] torch.compile failed, training eager instead" in caplog.text
    torch.testing.assert_close(logits, model(x)[0])
