"""Tokenizers: byte-level BPE training (deterministic, offline), encode/decode round trips, the vocabulary check, the
tokenizer's place in the swarm fingerprint, and the eval loss per byte that compares runs of different tokenizers."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from p2pdiloco.cli import main
from p2pdiloco.config import Config, ConfigError, DataConfig, fingerprint_digest
from p2pdiloco.training.corpus import load_corpus
from p2pdiloco.training.reporting import Counters, MetricsLog, Reporter
from p2pdiloco.training.token_cache import read_tokens, write_tokens
from p2pdiloco.training.tokenizer import (
    END_OF_TEXT,
    ByteTokenizer,
    HFTokenizer,
    check_vocab,
    load_tokenizer,
    train_bpe,
)

OFFLINE = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
TEXT = "def gradient(x):\n    return 2 * x  # ∇ of x², naïve café 🚀\n\tprint('done')\n"


def corpus(root: Path, n_files: int = 30) -> Path:
    """Small Python-like text files with made-up words (a seeded generator): enough pairs for a few hundred merges."""
    rng = random.Random(0)
    words = ["".join(rng.choice("etaoinshrdlucmfw") for _ in range(rng.randint(2, 9))) for _ in range(300)]
    root.mkdir(parents=True, exist_ok=True)
    for i in range(n_files):
        body = "".join(f"def {rng.choice(words)}_{j}(x, {rng.choice(words)}):\n    return {rng.choice(words)} * {j}"
                       f"  # {' '.join(rng.choices(words, k=6))}\n" for j in range(40))
        (root / f"mod_{i:02d}.py").write_text(body + TEXT)
    return root


@pytest.fixture(scope="module")
def bpe(tmp_path_factory) -> HFTokenizer:
    root = tmp_path_factory.mktemp("tok")
    texts = [p.read_text() for p in sorted(corpus(root / "data").iterdir())]
    return train_bpe(texts, 400, root / "tokenizer.json", progress=lambda _: None)


def test_train_bpe_is_deterministic_and_byte_level(tmp_path, bpe):
    texts = [p.read_text() for p in sorted(corpus(tmp_path / "data").iterdir())]
    again = train_bpe(reversed(texts), 400, tmp_path / "again.json", progress=lambda _: None)
    assert again.path.read_bytes() == bpe.path.read_bytes() and again.digest == bpe.digest
    assert bpe.vocab_size == 400
    raw = json.loads(bpe.path.read_text())
    assert [t["content"] for t in raw["added_tokens"]] == [END_OF_TEXT] and raw["added_tokens"][0]["id"] == 0
    assert raw["pre_tokenizer"]["type"] == "ByteLevel" and raw["decoder"]["type"] == "ByteLevel"
    assert len(bpe.encode(texts[0])) < 0.8 * len(texts[0].encode())  # the merges compress the text they came from
    smaller = train_bpe(texts, 300, tmp_path / "small.json", progress=lambda _: None)
    assert smaller.digest != bpe.digest and smaller.vocab_size == 300


def test_cli_train_matches_in_process_training_byte_for_byte(tmp_path, bpe):
    data = corpus(tmp_path / "data")
    out = tmp_path / "cli.json"
    run = subprocess.run([sys.executable, "-m", "p2pdiloco", "tokenizer", "train", "--data", str(data),
                          "--vocab-size", "400", "--out", str(out), "--val-fraction", "0.0001"],
                         capture_output=True, text=True, timeout=120, env=OFFLINE)
    assert run.returncode == 0, run.stderr
    assert "training a byte-level BPE of 400 tokens" in run.stdout and f"wrote {out}" in run.stdout
    # another process (other hash seeds, other thread timing) and another file order: the same bytes
    assert out.read_bytes() == bpe.path.read_bytes()
    assert not list(tmp_path.glob(".*.tmp"))


@pytest.mark.parametrize("text", [TEXT, "", " ", "\n\n\x00\x7f", "日本語のテキスト", END_OF_TEXT + "after"])
def test_round_trip(bpe, text):
    for tok in (bpe, ByteTokenizer()):
        ids = tok.encode(text)
        assert all(0 <= i < tok.vocab_size for i in ids)
        assert tok.decode(ids) == text
        assert tok.encode_batch([text, text]) == [ids, ids]
    assert ByteTokenizer().encode(text) == list(text.encode())


def _cli_error(capsys, *argv) -> str:
    assert main(list(argv)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("p2pdiloco tokenizer: error: "), err
    return err[0]


def test_cli_errors_are_one_line(tmp_path, capsys):
    data = corpus(tmp_path / "data", n_files=2)
    assert ">= 257" in _cli_error(capsys, "tokenizer", "train", "--data", str(data), "--vocab-size", "256",
                                  "--out", str(tmp_path / "t.json"))
    assert "does not exist" in _cli_error(capsys, "tokenizer", "train", "--data", str(tmp_path / "nope"),
                                          "--out", str(tmp_path / "t.json"))
    assert "not a writable folder" in _cli_error(capsys, "tokenizer", "train", "--data", str(data),
                                                 "--out", str(tmp_path / "no" / "t.json"))
    assert "it is a folder" in _cli_error(capsys, "tokenizer", "train", "--data", str(data), "--out", str(tmp_path))
    empty = tmp_path / "empty"
    empty.mkdir()
    assert "no text files" in _cli_error(capsys, "tokenizer", "train", "--data", str(empty),
                                         "--out", str(tmp_path / "t.json"))
    for argv in (["tokenizer", "--help"], ["tokenizer", "train", "--help"]):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 0
    assert "--vocab-size" in capsys.readouterr().out


def test_vocab_mismatch_is_a_one_line_error(tmp_path, bpe):
    with pytest.raises(ConfigError, match=r"has 400 tokens but model.vocab_size is 512; set model.vocab_size = 400"):
        check_vocab(bpe, 512, str(bpe.path))
    check_vocab(bpe, 400, str(bpe.path))
    check_vocab(ByteTokenizer(), 256, "bytes")
    # where a peer loads its config: before any data is read or any DHT is started
    run = subprocess.run([sys.executable, "-m", "p2pdiloco", "peer", "--run-dir", str(tmp_path / "run"),
                          "--set", f"data.tokenizer={bpe.path}", "--set", "model.vocab_size=512"],
                         capture_output=True, text=True, timeout=60, env=OFFLINE, stdin=subprocess.DEVNULL)
    assert run.returncode == 2
    lines = [line for line in run.stderr.splitlines() if line.startswith("p2pdiloco")]
    assert len(lines) == 1 and "has 400 tokens but model.vocab_size is 512" in lines[0], run.stderr


def test_fingerprint_holds_the_tokenizer_digest(tmp_path, bpe):
    cfg = Config()
    # "bytes" adds nothing to the fingerprint; its digest is the default config's (test_llama.py says what it
    # covers)
    assert fingerprint_digest(cfg.fingerprint()) == "9c9b86417d620e15"
    assert cfg.fingerprint(tokenizer=load_tokenizer("bytes").digest) == cfg.fingerprint()
    other = train_bpe(["some other text entirely, " * 50], 300, tmp_path / "other.json", progress=lambda _: None)
    a, b = cfg.fingerprint(tokenizer=bpe.digest), cfg.fingerprint(tokenizer=other.digest)
    assert a["tokenizer"].startswith("sha256:") and fingerprint_digest(a) != fingerprint_digest(b)
    copy = tmp_path / "copy.json"  # the same file at another path is the same tokenizer
    copy.write_bytes(bpe.path.read_bytes())
    assert load_tokenizer(str(copy)).digest == bpe.digest


def _reporter(tmp_path: Path, tokens_per_byte: float) -> tuple[Reporter, Path]:
    path = tmp_path / "metrics.jsonl"
    rep = Reporter(Config(), Counters(), MetricsLog(path), "peer-abcdef", torch.device("cpu"), 1000)
    rep.tokens_per_byte = tokens_per_byte
    return rep, path


def test_eval_loss_per_byte(tmp_path, bpe):
    data_dir = corpus(tmp_path / "data", n_files=8)
    by_bytes = load_corpus(DataConfig(paths=[str(data_dir)], cache_dir=""), ByteTokenizer(), 2)
    assert by_bytes.tokens_per_byte == 1.0
    rep, path = _reporter(tmp_path, by_bytes.tokens_per_byte)
    rep.training_starts(2.5)
    rep.training_ends(1.25)
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(r["eval_loss"], r["eval_loss_per_byte"]) for r in lines] == [(2.5, 2.5), (1.25, 1.25)]
    summary = rep.summary(1.0, "d", False)
    assert summary["eval_loss_per_byte_final"] == summary["eval_loss_final"] == 1.25

    tokens = load_corpus(DataConfig(paths=[str(data_dir)], cache_dir=""), bpe, 2)
    val_text = tokens.val_bytes
    assert tokens.tokens_per_byte == pytest.approx(tokens.val.numel() / val_text) and tokens.tokens_per_byte < 0.8
    rep, path = _reporter(tmp_path / "bpe", tokens.tokens_per_byte)
    rep.training_starts(3.0)
    line = json.loads(path.read_text())
    assert line["eval_loss_per_byte"] == pytest.approx(3.0 * tokens.val.numel() / val_text)
    assert rep.record()["eval_loss_per_byte"] == pytest.approx(line["eval_loss_per_byte"])


def test_the_token_cache_holds_an_empty_split(tmp_path):
    """A corpus with no validation document (few text files): its empty split, made from numpy, is written too."""
    arrays = {"train": torch.from_numpy(np.arange(7, dtype=np.uint16)), "val": torch.from_numpy(np.zeros(0, np.uint16))}
    assert write_tokens(tmp_path / "t.tokens", arrays, {"n_files": 1})
    back, meta = read_tokens(tmp_path / "t.tokens")
    assert back["train"].tolist() == list(range(7)) and back["val"].numel() == 0 and meta == {"n_files": 1}
