"""`p2pdiloco export` and `p2pdiloco sample`: the latest global model of a run folder, a `transformers` checkpoint
whose logits match p2pdiloco's, and seeded sampling. CPU, tiny models, no network (HF_HUB_OFFLINE)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from p2pdiloco.app.export import byte_tokenizer_json, export_run
from p2pdiloco.app.peer import save_model
from p2pdiloco.app.sample import sample_text
from p2pdiloco.app.saved_model import latest_model
from p2pdiloco.cli import main
from p2pdiloco.config import Config, ConfigError, load_config
from p2pdiloco.training.checkpoint import save_checkpoint
from p2pdiloco.training.flat import flat_params
from p2pdiloco.training.model import build_model
from p2pdiloco.training.tokenizer import ByteTokenizer, load_tokenizer

os.environ["HF_HUB_OFFLINE"] = "1"  # nothing here may reach the internet
MODEL = {"n_layer": 2, "n_head": 2, "d_model": 32, "seq_len": 16, "init_seed": 3}


def _cfg(**model) -> Config:
    data = {"tokenizer": model.pop("tokenizer")} if "tokenizer" in model else {}
    return load_config(None, [{"model": {**MODEL, **model}, "data": data}])


def _perturbed(cfg: Config) -> torch.Tensor:
    """θg of a 'trained' model: the init plus noise, so that norms and untied heads are not at their init."""
    flat = flat_params(build_model(cfg.model))
    return flat + 0.05 * torch.randn(flat.shape, generator=torch.Generator().manual_seed(1))


def _peer_folder(folder: Path, cfg: Config, model_file: bool = True, checkpoint: bool = False) -> torch.Tensor:
    """A peer's run folder with its final model.safetensors (as `run_peer` writes it) and/or a checkpoint."""
    flat = _perturbed(cfg)
    folder.mkdir(parents=True, exist_ok=True)
    if model_file:
        learner = SimpleNamespace(cfg=cfg, global_params=flat, c=SimpleNamespace(round=3, step=30))
        save_model(folder / "model.safetensors", learner)
    if checkpoint:
        save_checkpoint(folder / "checkpoints", 3, {"global_params": flat, "momentum": torch.zeros_like(flat)},
                        {"round": 3, "step": 30, "tokens": 0, "global_tokens": 0.0, "config": cfg.to_dict()})
    return flat


def _tiny_tokenizer(path: Path) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(["def sample(x):\n    return x + 1\n"] * 50, trainer)
    tok.save(str(path))
    return path


@pytest.mark.hf
@pytest.mark.parametrize("tie", [True, False])
def test_transformers_loads_the_export_and_its_logits_match(tmp_path: Path, tie: bool) -> None:
    import transformers

    cfg = _cfg(arch="llama", tie_embeddings=tie)
    _peer_folder(tmp_path / "run", cfg)
    done = export_run(tmp_path / "run", tmp_path / "hf")
    assert done["files"] == ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    ours = latest_model(tmp_path / "run").model

    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    assert type(hf).__name__ == "LlamaForCausalLM" and hf.config.tie_word_embeddings is tie
    x = torch.randint(0, 256, (2, MODEL["seq_len"]), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected, _ = ours(x)
        got = hf(input_ids=x).logits
    diff = (got - expected).abs().max().item()
    print(f"max abs logit difference vs transformers (tie={tie}): {diff:.2e}")
    assert diff < 1e-4

    # the byte tokenizer's stand-in encodes as training did: token i is byte i
    tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    text = "def f(x):\n\treturn 'é→ok'"
    assert tok(text, add_special_tokens=False)["input_ids"] == ByteTokenizer().encode(text)
    assert tok.decode(ByteTokenizer().encode(text)) == text


@pytest.mark.hf
def test_export_copies_a_tokenizer_json(tmp_path: Path) -> None:
    import transformers

    path = _tiny_tokenizer(tmp_path / "tok.json")
    vocab = load_tokenizer(str(path)).vocab_size
    cfg = _cfg(arch="llama", vocab_size=vocab, tokenizer=str(path))
    _peer_folder(tmp_path / "run", cfg, model_file=False, checkpoint=True)  # a checkpoint-only folder
    export_run(tmp_path / "run", tmp_path / "hf")
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["vocab_size"] == vocab
    tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    text = "def sample(y):\n    return y"
    assert tok(text, add_special_tokens=False)["input_ids"] == load_tokenizer(str(path)).encode(text)


def test_byte_tokenizer_json_ids_are_the_bytes() -> None:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(byte_tokenizer_json())
    text = bytes(range(1, 128)).decode() + "ü€𝄞"
    assert tok.encode(text).ids == ByteTokenizer().encode(text)
    assert tok.get_vocab_size() == 256


def test_export_refuses_gpt_empty_run_and_nonempty_target(tmp_path: Path, capsys) -> None:
    (tmp_path / "empty").mkdir()
    assert main(["export", str(tmp_path / "empty"), "--to", str(tmp_path / "out")]) == 2
    assert f"no model in {tmp_path / 'empty'}" in capsys.readouterr().err

    _peer_folder(tmp_path / "gpt", _cfg())
    assert main(["export", str(tmp_path / "gpt"), "--to", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "is a gpt model; export supports llama only" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()

    _peer_folder(tmp_path / "llama", _cfg(arch="llama"))
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("keep me")
    assert main(["export", str(tmp_path / "llama"), "--to", str(tmp_path / "full")]) == 2
    assert "exists and is not empty" in capsys.readouterr().err
    assert main(["export", str(tmp_path / "llama"), "--to", str(tmp_path / "new")]) == 0
    assert sorted(p.name for p in (tmp_path / "new").iterdir())[0] == "config.json"
    assert not list(tmp_path.glob(".new.tmp-*"))  # the temporary folder was renamed, not left behind


def test_latest_model_is_the_newest_file_of_any_peer(tmp_path: Path) -> None:
    cfg = _cfg(arch="llama")
    run = tmp_path / "run"
    _peer_folder(run / "peers" / "peer0", cfg, checkpoint=True)
    newer = _cfg(arch="llama", init_seed=5)
    flat = _peer_folder(run / "peers" / "peer1", newer, model_file=False, checkpoint=True)
    now = os.path.getmtime(run / "peers" / "peer0" / "model.safetensors")
    ckpt = next((run / "peers" / "peer1" / "checkpoints").glob("ckpt-*.safetensors"))
    os.utime(ckpt, (now + 10, now + 10))
    saved = latest_model(run)
    assert saved.path == ckpt and torch.equal(flat_params(saved.model), flat)
    ckpt.write_bytes(b"damaged")  # a damaged newest file: the next newest is taken
    assert latest_model(run).path.is_relative_to(run / "peers" / "peer0")


@pytest.mark.parametrize("arch", ["gpt", "llama"])
def test_sample_is_deterministic_with_a_seed_from_a_checkpoint_only_run(tmp_path: Path, arch: str) -> None:
    _peer_folder(tmp_path / "run", _cfg(arch=arch), model_file=False, checkpoint=True)
    a = sample_text(tmp_path / "run", "def ", n_tokens=20, seed=7)
    b = sample_text(tmp_path / "run", "def ", n_tokens=20, seed=7)
    c = sample_text(tmp_path / "run", "def ", n_tokens=20, seed=8)
    assert a == b and a.startswith("def ") and a != c
    greedy = sample_text(tmp_path / "run", "def ", n_tokens=5, temperature=0)
    assert greedy == sample_text(tmp_path / "run", "def ", n_tokens=5, temperature=0, seed=1)


def test_sample_cli_prints_text_and_names_a_missing_tokenizer(tmp_path: Path, capsys) -> None:
    _peer_folder(tmp_path / "run", _cfg(arch="llama"))
    assert main(["sample", str(tmp_path / "run"), "--prompt", "ab", "--tokens", "5", "--seed", "1"]) == 0
    assert capsys.readouterr().out.startswith("ab")

    path = _tiny_tokenizer(tmp_path / "tok.json")
    _peer_folder(tmp_path / "bpe", _cfg(arch="llama", vocab_size=load_tokenizer(str(path)).vocab_size,
                                        tokenizer=str(path)))
    assert sample_text(tmp_path / "bpe", "def ", n_tokens=5, seed=0).startswith("def ")
    path.unlink()
    with pytest.raises(ConfigError, match="tokenizer .* is gone"):
        sample_text(tmp_path / "bpe", "def ", n_tokens=5, seed=0)
