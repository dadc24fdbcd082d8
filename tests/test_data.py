"""Tests of byte-level data: loading, the split by file, shards, sampling and eval batches."""

from __future__ import annotations

import errno
import hashlib
import logging
import time
from pathlib import Path

import pytest
import torch

import p2pdiloco.training.data as data_mod
from p2pdiloco.config import ConfigError, DataConfig
from p2pdiloco.training.batches import BatchSampler, eval_batches, shard_range
from p2pdiloco.training.data import is_val_file, load_text


def _write_corpus(root: Path, n_files: int) -> dict[str, bytes]:
    """Text files with unique contents in two folder levels; returns {relative path: content}."""
    files = {}
    for i in range(n_files):
        rel = f"sub{i % 3}/doc_{i:03d}.txt"
        content = (f"<document {i}> " + "the quick brown fox. " * (5 + i % 7) + "\n").encode()
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(content)
        files[rel] = content
    return files


def test_is_val_file_follows_the_sha256_rule() -> None:
    for rel in ("a.txt", "sub/b.py", "x/y/z.md"):
        bucket = int(hashlib.sha256(rel.encode()).hexdigest()[:8], 16) / 2**32
        assert is_val_file(rel, bucket + 1e-9)
        assert not is_val_file(rel, bucket)
    assert not is_val_file("a.txt", 0.0)
    assert is_val_file("a.txt", 1.0)


def test_split_by_file_is_deterministic_and_disjoint(tmp_path: Path) -> None:
    files = _write_corpus(tmp_path, 60)
    cfg = DataConfig(paths=[str(tmp_path)], val_fraction=0.2)
    first, second = load_text(cfg), load_text(cfg)
    assert torch.equal(first.train, second.train) and torch.equal(first.val, second.val)

    val_names = sorted(rel for rel in files if is_val_file(rel, 0.2))
    train_names = sorted(rel for rel in files if not is_val_file(rel, 0.2))
    assert 3 <= len(val_names) <= 25  # about 12 of 60 expected
    assert bytes(first.train.numpy()) == b"".join(files[r] for r in train_names)
    assert bytes(first.val.numpy()) == b"".join(files[r] for r in val_names)
    assert first.train.dtype == torch.uint8 and first.train.dim() == 1
    assert first.n_files == 60
    assert first.n_bytes == sum(map(len, files.values())) == first.train.numel() + first.val.numel()
    train_text = bytes(first.train.numpy())
    for rel in val_names:
        assert files[rel] not in train_text


def test_single_file_holds_out_its_tail(tmp_path: Path) -> None:
    text = bytes(range(32, 127)) * 100  # 9500 bytes
    path = tmp_path / "book.txt"
    path.write_bytes(text)
    data = load_text(DataConfig(paths=[str(path)], val_fraction=0.1))
    assert bytes(data.train.numpy()) == text[:8550]
    assert bytes(data.val.numpy()) == text[8550:]
    assert data.n_files == 1 and data.n_bytes == 9500


def test_fallback_gives_validation_at_least_one_window(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_bytes(b"x" * 1000)
    data = load_text(DataConfig(paths=[str(tmp_path)], val_fraction=0.01), min_bytes=2 * 129)
    assert data.val.numel() == 129 and data.train.numel() == 871


def test_max_bytes_stops_reading_in_sorted_order(tmp_path: Path) -> None:
    for name in ("c.txt", "a.txt", "b.txt"):
        (tmp_path / name).write_bytes(name[0].encode() * 400)
    data = load_text(DataConfig(paths=[str(tmp_path)], max_bytes=1000, val_fraction=0.01))
    everything = bytes(data.train.numpy()) + bytes(data.val.numpy())
    assert data.n_bytes == 1000 and data.n_files == 3
    assert sorted(everything) == sorted(b"a" * 400 + b"b" * 400 + b"c" * 200)


def test_binary_hidden_and_non_utf8_files_are_skipped(tmp_path: Path) -> None:
    (tmp_path / "good.txt").write_text("héllo wörld\n" * 50, encoding="utf-8")
    (tmp_path / "weights.bin").write_bytes(b"\x00\x01\x02" * 100)
    (tmp_path / "latin1.txt").write_bytes("caf\xe9 ".encode("latin-1") * 50)
    (tmp_path / ".git").mkdir()
    (tmp_path / ".git" / "notes.txt").write_text("tool state\n" * 50)
    data = load_text(DataConfig(paths=[str(tmp_path)]))
    assert data.n_files == 1
    assert data.n_bytes == len(("héllo wörld\n" * 50).encode())


def test_explicit_binary_file_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "weights.bin"
    path.write_bytes(b"\x00" * 100)
    with pytest.raises(ConfigError, match="is not UTF-8 text"):
        load_text(DataConfig(paths=[str(path)]))


def test_missing_path_is_a_clear_error(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(ConfigError, match=r"^data path does not exist: .*nope$"):
        load_text(DataConfig(paths=[str(missing)]))


def test_empty_folder_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"^no text files found in "):
        load_text(DataConfig(paths=[str(tmp_path)]))


def test_too_little_text_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "tiny.txt").write_text("hello")
    with pytest.raises(ConfigError, match="only 5 bytes of text .* need at least 258"):
        load_text(DataConfig(paths=[str(tmp_path)]), min_bytes=258)


def test_unreadable_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / "ok.txt").write_text("fine text\n" * 30)
    secret = tmp_path / "secret.txt"
    secret.write_text("private\n" * 30)
    real_open = open

    def guarded_open(path, *args, **kwargs):  # root ignores chmod, so deny access here instead
        if Path(path) == secret:
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(data_mod, "open", guarded_open, raising=False)
    with pytest.raises(ConfigError, match="^cannot read data file .*secret.txt: Permission denied$"):
        load_text(DataConfig(paths=[str(secret)]))
    with caplog.at_level(logging.WARNING, logger="p2pdiloco.training.data"):
        data = load_text(DataConfig(paths=[str(tmp_path)]))
    assert data.n_files == 1 and data.n_bytes == 300
    assert "skipping unreadable file" in caplog.text


def test_stdlib_default_loads_fast_and_real() -> None:
    start = time.perf_counter()
    data = load_text(DataConfig(max_bytes=4_000_000))
    elapsed = time.perf_counter() - start
    assert data.n_bytes == 4_000_000
    assert data.train.numel() > 1_000_000 and data.val.numel() > 10_000
    assert data.n_files > 50
    assert "standard library" in data.source
    assert b"def " in bytes(data.train[:200_000].numpy())
    assert elapsed < 3.0


@pytest.mark.parametrize("n_chunks", [0, 1, 7, 100, 1001])
@pytest.mark.parametrize("n_shards", [1, 2, 3, 8])
def test_shard_ranges_are_disjoint_and_cover_everything(n_chunks: int, n_shards: int) -> None:
    ranges = [shard_range(n_chunks, f"{i}/{n_shards}") for i in range(n_shards)]
    covered = [c for r in ranges for c in r]
    assert covered == list(range(n_chunks))  # contiguous, in order, each chunk exactly once
    sizes = [len(r) for r in ranges]
    assert max(sizes) - min(sizes) <= 1
    assert shard_range(n_chunks, "") == range(n_chunks)


@pytest.mark.parametrize("shard", ["1", "a/b", "2/2", "-1/3", "1/2/3"])
def test_malformed_shard_is_a_config_error(shard: str) -> None:
    with pytest.raises(ConfigError, match="data.shard"):
        shard_range(10, shard)


def _chunk_ids(x: torch.Tensor, seq_len: int) -> list[int]:
    # With tokens = arange(n), a window's first token tells which chunk it is.
    return (x[:, 0] // (seq_len + 1)).tolist()


def test_sampler_epoch_is_a_permutation_and_x_y_are_shifted() -> None:
    seq_len, n_chunks = 8, 12
    sampler = BatchSampler(torch.arange(n_chunks * (seq_len + 1) + 5), seq_len, batch_size=4, seed=3)
    assert sampler.tokens_per_batch == 32 and sampler.n_chunks == n_chunks
    seen = []
    for _ in range(3):
        x, y = sampler.next_batch()
        assert x.shape == y.shape == (4, seq_len) and x.dtype == y.dtype == torch.int64
        torch.testing.assert_close(y, x + 1)  # arange tokens: the target is the next byte
        seen += _chunk_ids(x, seq_len)
    assert sorted(seen) == list(range(n_chunks))


def test_sampler_is_deterministic_per_seed_and_differs_between_seeds() -> None:
    tokens = torch.arange(50 * 17)

    def take(seed: int, n: int = 30) -> list[int]:  # 30 batches of 4 = 2.4 epochs of 50 chunks
        sampler = BatchSampler(tokens, seq_len=16, batch_size=4, seed=seed)
        return [c for _ in range(n) for c in _chunk_ids(sampler.next_batch()[0], 16)]

    assert take(1) == take(1)
    assert take(1) != take(2)
    first = take(1)
    assert first[:50] != first[50:100]  # reshuffled each epoch
    assert sorted(first[50:100]) == list(range(50))


def test_a_skipping_sampler_continues_where_one_that_drew_left_off() -> None:
    """A resumed peer skips the batches its tokens say it drew (rather than replaying its order from
    the start after every restart), across epoch ends and a batch straddling one."""
    tokens = torch.arange(50 * 17)
    for drawn in (0, 3, 12, 13, 37):  # 4-chunk batches of 50 chunks: 12.5 batches an epoch
        drew, skipped = (BatchSampler(tokens, seq_len=16, batch_size=4, seed=5) for _ in range(2))
        for _ in range(drawn):
            drew.next_batch()
        skipped.skip(drawn)
        for _ in range(20):
            assert _chunk_ids(skipped.next_batch()[0], 16) == _chunk_ids(drew.next_batch()[0], 16)


def test_sampler_shards_draw_from_disjoint_chunks() -> None:
    tokens = torch.arange(30 * 9).to(torch.int64)
    seen = []
    for i in range(3):
        sampler = BatchSampler(tokens, seq_len=8, batch_size=5, seed=0, shard=f"{i}/3")
        assert sampler.chunk_range == range(10 * i, 10 * (i + 1))
        ids = {c for _ in range(4) for c in _chunk_ids(sampler.next_batch()[0], 8)}
        assert ids == set(range(10 * i, 10 * (i + 1)))
        seen.append(ids)
    assert not (seen[0] & seen[1]) and not (seen[1] & seen[2]) and not (seen[0] & seen[2])


def test_sampler_accepts_uint8_and_rejects_empty_shards() -> None:
    tokens = torch.arange(0, 250, dtype=torch.uint8)
    x, y = BatchSampler(tokens, seq_len=9, batch_size=3, seed=0).next_batch()
    torch.testing.assert_close(y, x + 1)
    with pytest.raises(ConfigError, match="shard 0/4 holds no window of 10 bytes"):
        BatchSampler(torch.zeros(35, dtype=torch.uint8), seq_len=9, batch_size=2, seed=0, shard="0/4")
    with pytest.raises(ConfigError, match="the text holds no window"):
        BatchSampler(torch.zeros(5, dtype=torch.uint8), seq_len=9, batch_size=2, seed=0)


def test_eval_batches_are_fixed_and_spread_over_the_text() -> None:
    seq_len = 8
    tokens = torch.arange(100 * (seq_len + 1))
    batches = eval_batches(tokens, seq_len, batch_size=4, n_batches=5)
    again = eval_batches(tokens, seq_len, batch_size=4, n_batches=5)
    assert len(batches) == 5
    ids = []
    for (x, y), (x2, y2) in zip(batches, again, strict=True):
        assert x.shape == (4, seq_len) and torch.equal(x, x2) and torch.equal(y, y2)
        torch.testing.assert_close(y, x + 1)
        ids += _chunk_ids(x, seq_len)
    assert ids == [5 * k for k in range(20)]  # 20 windows evenly over 100 chunks


def test_eval_batches_shrink_with_short_text() -> None:
    window = 9
    assert len(eval_batches(torch.arange(10 * window), 8, batch_size=4, n_batches=5)) == 2
    (only,) = eval_batches(torch.arange(3 * window), 8, batch_size=4, n_batches=5)
    assert only[0].shape == (3, 8)
    assert eval_batches(torch.arange(window - 1), 8, batch_size=4, n_batches=5) == []
