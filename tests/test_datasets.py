"""Datasets (local jsonl and parquet through Hugging Face `datasets`, no network) and the token cache: documents
split by key and sharded the same way on every load, the cache hit, and a damaged cache file rebuilt."""

from __future__ import annotations

import importlib.util
import json
import logging
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before `datasets` is imported anywhere: nothing may go online
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

import p2pdiloco.training.corpus as corpus_mod  # noqa: E402
from p2pdiloco.config import ConfigError, DataConfig  # noqa: E402
from p2pdiloco.training.batches import BatchSampler
from p2pdiloco.training.corpus import load_corpus, token_dtype  # noqa: E402
from p2pdiloco.training.data import is_val_file  # noqa: E402
from p2pdiloco.training.datasets import iter_documents  # noqa: E402
from p2pdiloco.training.tokenizer import ByteTokenizer, HFTokenizer, train_bpe  # noqa: E402


def docs(n: int, offset: int = 0) -> list[str]:
    return [f"document {i}: " + f"the value of item {i} is {i * 7}. " * (3 + i % 5) + "ünïcode ✓\n"
            for i in range(offset, offset + n)]


def write_jsonl(path: Path, texts: list[str], field: str = "text") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({field: t, "id": i}) + "\n" for i, t in enumerate(texts)))
    return path


def write_parquet(path: Path, texts: list[str]) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"text": texts, "id": list(range(len(texts)))}), path, row_group_size=7)
    return path


@pytest.fixture(scope="module")
def bpe(tmp_path_factory) -> HFTokenizer:
    root = tmp_path_factory.mktemp("tok")
    return train_bpe(docs(200), 320, root / "tokenizer.json", progress=lambda _: None)


def _expected_split(keyed: list[tuple[str, str]], val_fraction: float) -> tuple[str, str]:
    train = "".join(t for k, t in keyed if not is_val_file(k, val_fraction))
    val = "".join(t for k, t in keyed if is_val_file(k, val_fraction))
    return train, val


@pytest.mark.hf
def test_jsonl_folder_loads_splits_by_document_and_shards_deterministically(tmp_path, bpe):
    a, b = docs(60), docs(60, offset=60)
    write_jsonl(tmp_path / "ds" / "part-b.jsonl", b)
    write_jsonl(tmp_path / "ds" / "part-a.jsonl", a)
    (tmp_path / "ds" / "README.md").write_text("not a data file: skipped in a folder")
    cfg = DataConfig(dataset=str(tmp_path / "ds"), val_fraction=0.2, cache_dir="")
    keyed = list(iter_documents(cfg.dataset, "text"))
    assert [k for k, _ in keyed[:2]] == ["part-a.jsonl#0", "part-a.jsonl#1"] and keyed[60][0] == "part-b.jsonl#0"
    assert [t for _, t in keyed] == a + b  # sorted files, rows in file order

    first, second = load_corpus(cfg, bpe, 2), load_corpus(cfg, bpe, 2)
    assert torch.equal(first.train, second.train) and torch.equal(first.val, second.val)
    assert first.train.dtype == token_dtype(320) == torch.uint16
    train_text, val_text = _expected_split(keyed, 0.2)
    assert 5 <= sum(is_val_file(k, 0.2) for k, _ in keyed) <= 45
    assert bpe.decode(first.train.tolist()) == train_text and bpe.decode(first.val.tolist()) == val_text
    assert first.val_bytes == len(val_text.encode()) and first.n_files == 120
    assert first.n_bytes == len((train_text + val_text).encode())

    shards = [BatchSampler(first.train, 16, 4, seed=0, shard=f"{i}/3") for i in range(3)]
    ranges = [s.chunk_range for s in shards]
    assert [r.start for r in ranges[1:]] == [r.stop for r in ranges[:-1]]  # disjoint, contiguous, covering
    x, y = shards[1].next_batch()
    assert x.dtype == torch.int64 and x.shape == (4, 16) and torch.equal(x[:, 1:], y[:, :-1])
    again = BatchSampler(second.train, 16, 4, seed=0, shard="1/3").next_batch()
    assert torch.equal(again[0], x)


@pytest.mark.hf
def test_a_tokenizer_saved_in_the_data_folder_is_not_read_as_documents(tmp_path, bpe):
    texts = docs(12)
    write_jsonl(tmp_path / "data" / "docs.jsonl", texts)
    (tmp_path / "data" / "tokenizer.json").write_bytes(bpe.path.read_bytes())  # as README's flow leaves it
    (tmp_path / "data" / "one.json").write_text(json.dumps({"text": "a json-lines file named .json"}) + "\n")
    keyed = list(iter_documents(str(tmp_path / "data"), "text"))
    assert [k for k, _ in keyed] == [f"docs.jsonl#{i}" for i in range(12)] + ["one.json#0"]
    assert [t for _, t in keyed][:12] == texts


@pytest.mark.hf
def test_parquet_file_reads_rows_in_order(tmp_path):
    texts = docs(30)
    path = write_parquet(tmp_path / "d.parquet", texts)
    cfg = DataConfig(dataset=str(path), val_fraction=0.3, cache_dir="")
    keyed = list(iter_documents(cfg.dataset, "text"))
    assert keyed == [(f"d.parquet#{i}", t) for i, t in enumerate(texts)]
    data = load_corpus(cfg, ByteTokenizer(), 2)  # a dataset read as bytes: the texts' own bytes
    train_text, val_text = _expected_split(keyed, 0.3)
    assert data.train.dtype == torch.uint8
    assert bytes(data.train.numpy()) == train_text.encode() and bytes(data.val.numpy()) == val_text.encode()
    assert data.tokens_per_byte == 1.0


@pytest.mark.hf
def test_max_bytes_and_the_tail_fallback(tmp_path, bpe):
    path = write_jsonl(tmp_path / "one.jsonl", ["x" * 5000 + " end"])
    data = load_corpus(DataConfig(dataset=str(path), max_bytes=3000, cache_dir=""), ByteTokenizer(), 2 * 129)
    assert data.n_bytes == 3000 and data.val.numel() == 129 and data.train.numel() == 3000 - 129
    tokens = load_corpus(DataConfig(dataset=str(path), cache_dir=""), bpe, 2 * 17)
    assert tokens.val.numel() >= 17 and tokens.train.numel() >= 17 and 0 < tokens.val_bytes < tokens.n_bytes


@pytest.mark.hf
def test_dataset_errors_are_one_line(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", docs(3), field="content")
    with pytest.raises(ConfigError, match=r"data.text_field 'text' is not a field of .*d.jsonl \(fields: content, id\)"):
        load_corpus(DataConfig(dataset=str(path), cache_dir=""), ByteTokenizer())
    assert load_corpus(DataConfig(dataset=str(path), text_field="content", cache_dir=""), ByteTokenizer()).n_files == 3
    with pytest.raises(ConfigError, match="data path does not exist"):
        load_corpus(DataConfig(dataset=str(tmp_path / "nope.jsonl"), cache_dir=""), ByteTokenizer())
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(ConfigError, match="unknown format"):
        load_corpus(DataConfig(dataset=str(tmp_path / "notes.txt"), cache_dir=""), ByteTokenizer())


def test_without_the_hf_extra_a_dataset_says_which_extra_to_install(tmp_path, monkeypatch):
    path = write_jsonl(tmp_path / "d.jsonl", docs(3), field="content")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "datasets" else real(name, *a))
    with pytest.raises(ConfigError, match=r"^data.dataset needs Hugging Face datasets: pip install p2pdiloco\[hf\]$"):
        load_corpus(DataConfig(dataset=str(path), text_field="content", cache_dir=""), ByteTokenizer())


def _no_tokenizing(*_args, **_kwargs):
    raise AssertionError("tokenized again although the cache holds these tokens")


@pytest.mark.hf
def test_cache_hit_and_a_damaged_cache_rebuilt(tmp_path, bpe, monkeypatch, caplog):
    ds = write_jsonl(tmp_path / "ds" / "a.jsonl", docs(80))
    cfg = DataConfig(dataset=str(ds), cache_dir=str(tmp_path / "cache"), val_fraction=0.1)
    cold = load_corpus(cfg, bpe)
    (cached,) = (tmp_path / "cache").iterdir()
    with monkeypatch.context() as m:
        m.setattr(corpus_mod, "tokenize", _no_tokenizing)
        warm = load_corpus(cfg, bpe)
        assert torch.equal(warm.train, cold.train) and torch.equal(warm.val, cold.val)
        assert (warm.n_files, warm.n_bytes, warm.val_bytes, warm.source) == (
            cold.n_files, cold.n_bytes, cold.val_bytes, cold.source)

    good = cached.read_bytes()
    damages = {
        "a flipped payload byte": good[:-10] + bytes([good[-10] ^ 1]) + good[-9:],
        "a cut-off file": good[: len(good) // 2],
        "a broken header": good[:25] + b"\xff" * 20 + good[45:],
        "not a cache file": b"hello",
    }
    for what, bad in damages.items():
        cached.write_bytes(bad)
        with caplog.at_level(logging.WARNING, logger="p2pdiloco.training.token_cache"):
            caplog.clear()
            rebuilt = load_corpus(cfg, bpe)
        assert "is damaged" in caplog.text, what
        assert torch.equal(rebuilt.train, cold.train) and torch.equal(rebuilt.val, cold.val), what
        assert cached.read_bytes() == good, what  # written again, whole

    # what the tokens depend on is in the key: another tokenizer, field, budget or source file misses
    write_jsonl(ds, docs(81))
    load_corpus(cfg, bpe)
    load_corpus(cfg.model_copy(update={"max_bytes": 5000}), bpe)
    load_corpus(cfg, ByteTokenizer())
    assert len(list((tmp_path / "cache").iterdir())) == 4


def test_text_files_with_a_tokenizer_split_by_file_and_cache(tmp_path, bpe):
    for i, text in enumerate(docs(40)):
        (tmp_path / "txt" / f"d{i:02d}.txt").parent.mkdir(exist_ok=True)
        (tmp_path / "txt" / f"d{i:02d}.txt").write_text(text)
    cfg = DataConfig(paths=[str(tmp_path / "txt")], val_fraction=0.2, cache_dir=str(tmp_path / "cache"))
    data = load_corpus(cfg, bpe)
    names = sorted(p.name for p in (tmp_path / "txt").iterdir())
    val_text = "".join((tmp_path / "txt" / n).read_text() for n in names if is_val_file(n, 0.2))
    assert bpe.decode(data.val.tolist()) == val_text and data.n_files == 40
    assert len(list((tmp_path / "cache").iterdir())) == 1
    assert load_corpus(cfg.model_copy(update={"cache_dir": ""}), bpe).train.tolist() == data.train.tolist()
