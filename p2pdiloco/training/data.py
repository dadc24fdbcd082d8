"""Byte-level text data: read files into one uint8 tensor, split by file, and sample windows.

Every byte is a token (vocabulary 256), so any UTF-8 text works without a tokenizer and every peer
agrees on the encoding by construction.
"""

from __future__ import annotations

import codecs
import hashlib
import logging
import os
import platform
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch

from p2pdiloco.config import ConfigError, DataConfig

LOG = logging.getLogger(__name__)

SNIFF_BYTES = 8192
"""A file with a NUL byte in its first this many bytes is taken as binary and skipped."""

# The stdlib's own tests are skipped: in CPython 3.11 they are 60% of the .py bytes (31 MB with them,
# 12 MB without), full of deliberately odd data (bad encodings, huge literals, generated tables), and
# the library code alone is already more text than a default run reads. site-packages is not the
# stdlib at all and differs between machines, which would break the same-split-everywhere promise.
_STDLIB_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"})


@dataclass
class TextData:
    """The training and validation text, as tokens (bytes here; tokenizer ids from corpus.py)."""

    train: torch.Tensor
    """Training tokens, 1-D: uint8 bytes, or uint16/int32 ids of a tokenizer."""
    val: torch.Tensor
    """Validation tokens, 1-D, of the same dtype."""
    n_files: int
    """Files (or documents of a dataset) read, the last one possibly cut short by the byte budget."""
    n_bytes: int
    """Bytes of text in train and val together."""
    source: str
    """Human-readable description of where the text came from."""
    val_bytes: int = -1
    """Bytes of text the validation tokens encode (-1: one byte a token, as here)."""

    @property
    def tokens_per_byte(self) -> float:
        """Validation tokens per byte of validation text: eval loss per token times this is loss per byte."""
        return self.val.numel() / self.val_bytes if self.val_bytes > 0 else 1.0


@dataclass(frozen=True)
class _Candidate:
    """A file that may hold text, and how to name it the same way on every peer."""

    rel_path: str
    """Path relative to the folder it was found in (POSIX separators), or the file name."""
    path: Path
    """Where to read it on this machine."""
    explicit: bool
    """The user named this file directly, so problems with it are errors rather than skips."""


def stdlib_source_dir() -> Path:
    """Folder of the running Python's standard library sources (e.g. ``/usr/lib/python3.11``)."""
    return Path(sysconfig.get_paths()["stdlib"])


def is_val_file(rel_path: str, val_fraction: float) -> bool:
    """Whether a file belongs to the validation split.

    The choice hashes only the relative path, so every peer that holds the same files makes the same
    split without talking to anyone.

    Args:
        rel_path: The file's path relative to the folder it was found in, with ``/`` separators.
        val_fraction: Expected share of files held out, in [0, 1].

    Returns:
        True when ``sha256(rel_path)`` maps below ``val_fraction`` on [0, 1).
    """
    bucket = int(hashlib.sha256(rel_path.encode("utf-8")).hexdigest()[:8], 16) / 2**32
    return bucket < val_fraction


def _stdlib_candidates(root: Path) -> list[_Candidate]:
    if not root.is_dir():
        raise ConfigError(f"standard library sources not found at {root}; pass data.paths instead")
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _STDLIB_SKIP_DIRS]
        for name in filenames:
            if name.endswith(".py"):
                path = Path(dirpath, name)
                found.append(_Candidate(path.relative_to(root).as_posix(), path, explicit=False))
    return sorted(found, key=lambda c: c.rel_path)


def _folder_candidates(root: Path) -> list[_Candidate]:
    def unreadable(err: OSError) -> None:
        # The top folder itself must be listable; a sub-folder we cannot enter is only skipped.
        if Path(err.filename) == root:
            raise ConfigError(f"cannot read data folder {root}: {err.strerror}")
        LOG.warning("skipping unreadable folder %s: %s", err.filename, err.strerror)

    found = []
    for dirpath, dirnames, filenames in os.walk(root, onerror=unreadable):
        # Hidden entries are tool state (.git objects, .venv, editor swap files), not the user's text.
        dirnames[:] = [d for d in dirnames if not d.startswith(".") and d != "__pycache__"]
        for name in filenames:
            if not name.startswith("."):
                path = Path(dirpath, name)
                found.append(_Candidate(path.relative_to(root).as_posix(), path, explicit=False))
    return sorted(found, key=lambda c: c.rel_path)


def _user_candidates(paths: list[str]) -> list[_Candidate]:
    """Files named in ``paths`` and files inside folders named there, each folder sorted."""
    found: list[_Candidate] = []
    for raw in paths:
        path = Path(raw).expanduser()
        try:
            exists, is_dir = path.exists(), path.is_dir()
        except OSError as e:  # e.g. a parent folder we may not enter
            raise ConfigError(f"cannot read data path {raw}: {e.strerror}") from None
        if not exists:
            raise ConfigError(f"data path does not exist: {raw}")
        if is_dir:
            found += _folder_candidates(path)
        else:
            found.append(_Candidate(path.name, path, explicit=True))
    seen: set[Path] = set()
    unique = []
    for cand in found:
        # A file named twice (directly and through its folder) would otherwise be trained on twice.
        key = cand.path.resolve()
        if key not in seen:
            seen.add(key)
            unique.append(cand)
    return unique


def _is_text(data: bytes, complete: bool) -> bool:
    """Whether ``data`` is UTF-8 text; ``complete=False`` allows a character cut off at the end."""
    # The NUL check is the cheap test that rejects most binary files before decoding them.
    if b"\0" in data[:SNIFF_BYTES]:
        return False
    try:
        codecs.getincrementaldecoder("utf-8")().decode(data, final=complete)
    except UnicodeDecodeError:
        return False
    return True


def _read_text(cand: _Candidate, limit: int) -> bytes | None:
    """Up to ``limit`` bytes of the file if it is UTF-8 text, else None (or ConfigError if explicit)."""
    try:
        with open(cand.path, "rb") as f:
            data = f.read(min(SNIFF_BYTES, limit))
            if b"\0" not in data and len(data) < limit:
                data += f.read(limit - len(data))
            at_end = not f.read(1)
    except OSError as e:
        if cand.explicit:
            raise ConfigError(f"cannot read data file {cand.path}: {e.strerror}") from None
        LOG.warning("skipping unreadable file %s: %s", cand.path, e.strerror)
        return None
    if not _is_text(data, complete=at_end):
        if cand.explicit:
            raise ConfigError(f"data file {cand.path} is not UTF-8 text")
        LOG.debug("skipping non-text file %s", cand.path)
        return None
    return data


def _to_tensor(parts: list[bytes]) -> torch.Tensor:
    # bytearray.join copies once into a writable buffer that torch.frombuffer can share without a
    # second copy (and without its warning about read-only buffers).
    return torch.frombuffer(bytearray().join(parts), dtype=torch.uint8)


def list_candidates(paths: list[str]) -> tuple[list[_Candidate], str]:
    """The files `paths` names (empty: the stdlib sources), in the order they are read, and a description.

    Raises:
        ConfigError: A path does not exist or cannot be listed.
    """
    if paths:
        return _user_candidates(paths), ", ".join(paths)
    root = stdlib_source_dir()
    return _stdlib_candidates(root), f"Python {platform.python_version()} standard library at {root}"


def read_texts(paths: list[str], max_bytes: int) -> tuple[list[tuple[str, bytes]], str]:
    """The UTF-8 text files `paths` names, read in sorted relative-path order until `max_bytes` are collected.

    The one file discovery behind training data and tokenizer training (`p2pdiloco tokenizer train --data`),
    so that both mean the same thing by the same paths.

    Args:
        paths: Files or folders; empty for the running Python's standard library sources.
        max_bytes: Byte budget; the last file read may be cut short (at a byte, possibly mid-character).

    Returns:
        ``[(relative path, bytes)]`` and a description of the source; ConfigError if none is text.
    """
    candidates, source = list_candidates(paths)
    texts: list[tuple[str, bytes]] = []
    total = 0
    for cand in candidates:
        if total >= max_bytes:
            break
        data = _read_text(cand, max_bytes - total)
        if data:
            texts.append((cand.rel_path, data))
            total += len(data)
    if not texts:
        raise ConfigError(f"no text files found in {source}")
    return texts, source


def load_text(cfg: DataConfig, min_bytes: int = 2) -> TextData:
    """Read the run's text and split it into training and validation bytes.

    Files are read by `read_texts` until ``cfg.max_bytes`` bytes are collected. A file goes to validation
    when `is_val_file` says so; if that leaves either side shorter than ``min_bytes // 2`` (e.g. a single
    file), the last ``cfg.val_fraction`` of all bytes is held out instead.

    Args:
        cfg: Paths (files or folders; empty for the stdlib sources), byte budget, validation share.
        min_bytes: Fewest bytes of text to accept. The trainer passes ``2 * (seq_len + 1)`` so that
            both splits can hold at least one window.

    Returns:
        The two splits as uint8 tensors, with counts and a description of the source.

    Raises:
        ConfigError: As `read_texts`, or there are fewer than ``min_bytes`` bytes of text.
    """
    texts, source = read_texts(cfg.paths, cfg.max_bytes)
    total = sum(len(data) for _, data in texts)
    min_bytes = max(min_bytes, 2)
    if total < min_bytes:
        raise ConfigError(f"only {total} bytes of text in {source}; need at least {min_bytes}")

    train_parts = [data for rel, data in texts if not is_val_file(rel, cfg.val_fraction)]
    val_parts = [data for rel, data in texts if is_val_file(rel, cfg.val_fraction)]
    need = min_bytes // 2
    if sum(map(len, train_parts)) < need or sum(map(len, val_parts)) < need:
        # Too few files for a split by file: hold out the tail of the text. Still the same on every
        # peer, since the order and the byte budget are.
        everything = b"".join(data for _, data in texts)
        held = min(max(int(total * cfg.val_fraction), need), total - need)
        LOG.info("split by file left a side short of %d bytes; holding out the last %d bytes", need, held)
        train_parts, val_parts = [everything[: total - held]], [everything[total - held :]]

    data = TextData(train=_to_tensor(train_parts), val=_to_tensor(val_parts), n_files=len(texts), n_bytes=total,
                    source=source)
    LOG.info("text: %d files, %d train + %d val bytes from %s", data.n_files, data.train.numel(), data.val.numel(),
             source)
    return data


def parse_shard(shard: str) -> tuple[int, int]:
    """Split ``"i/n"`` into ``(i, n)`` with ``0 <= i < n``.

    Args:
        shard: The shard spec, e.g. ``"0/4"`` for the first of four parts.

    Raises:
        ConfigError: The spec is malformed or out of range.
    """
    try:
        i, n = (int(x) for x in shard.split("/"))
    except ValueError:
        raise ConfigError(f"data.shard must look like 'i/n', got {shard!r}") from None
    if not 0 <= i < n:
        raise ConfigError(f"data.shard {shard!r}: need 0 <= i < n")
    return i, n


def shard_range(n_chunks: int, shard: str) -> range:
    """Indices of the chunks that shard ``"i/n"`` owns: the i-th of n contiguous, disjoint ranges.

    Args:
        n_chunks: Chunks in the whole text.
        shard: ``"i/n"``, or empty for all chunks.

    Returns:
        A range of chunk indices; over i = 0..n-1 the ranges cover ``range(n_chunks)`` exactly once.
    """
    if not shard:
        return range(n_chunks)
    i, n = parse_shard(shard)
    return range(i * n_chunks // n, (i + 1) * n_chunks // n)


class BatchSampler:
    """Random batches of non-overlapping windows of the text, reshuffled every epoch.

    The text is cut into chunks of ``seq_len + 1`` bytes (the trailing remainder is unused); each
    chunk gives one input sequence and its next-byte targets.

    Args:
        tokens: Byte tokens, a 1-D tensor (uint8 or any integer dtype).
        seq_len: Tokens per sequence.
        batch_size: Sequences per batch.
        seed: Seed of the chunk order; the same seed gives the same batches.
        shard: ``"i/n"`` to use only the i-th of n contiguous, disjoint ranges of chunks (so peers of
            one machine see disjoint text), or empty for all chunks.

    Raises:
        ConfigError: The shard is malformed or holds no chunk.
    """

    def __init__(
        self, tokens: torch.Tensor, seq_len: int, batch_size: int, seed: int, shard: str = ""
    ) -> None:
        if tokens.dim() != 1:
            raise ValueError(f"tokens must be 1-D, got shape {tuple(tokens.shape)}")
        if seq_len < 1 or batch_size < 1:
            raise ValueError(f"seq_len and batch_size must be >= 1, got {seq_len} and {batch_size}")
        self.seq_len = seq_len
        self.batch_size = batch_size
        window = seq_len + 1
        n_chunks = tokens.numel() // window
        self.chunk_range = shard_range(n_chunks, shard)
        if len(self.chunk_range) < 1:
            where = f"shard {shard}" if shard else "the text"
            raise ConfigError(
                f"{where} holds no window of {window} bytes ({tokens.numel()} bytes, {n_chunks} windows in all)"
            )
        # A view, not a copy: chunk c of this shard is row c.
        all_chunks = tokens[: n_chunks * window].view(n_chunks, window)
        self._chunks = all_chunks[self.chunk_range.start : self.chunk_range.stop]
        self._generator = torch.Generator().manual_seed(seed)
        self._order = torch.empty(0, dtype=torch.long)
        self._pos = 0

    @property
    def tokens_per_batch(self) -> int:
        """Input tokens in one batch: batch_size * seq_len."""
        return self.batch_size * self.seq_len

    @property
    def n_chunks(self) -> int:
        """Windows this sampler draws from (one epoch)."""
        return len(self._chunks)

    def _next_ids(self) -> torch.Tensor:
        ids = []
        missing = self.batch_size
        while missing:
            if self._pos == len(self._order):
                # A fresh permutation per epoch; a batch may straddle two epochs.
                self._order = torch.randperm(self.n_chunks, generator=self._generator)
                self._pos = 0
            take = self._order[self._pos : self._pos + missing]
            self._pos += len(take)
            missing -= len(take)
            ids.append(take)
        return torch.cat(ids)

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The next batch.

        Returns:
            ``(x, y)``, int64 of shape (batch_size, seq_len), where ``y[:, t]`` is the byte after
            ``x[:, t]``.
        """
        windows = self._chunks[self._next_ids()].long()
        return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()


def eval_batches(
    tokens: torch.Tensor, seq_len: int, batch_size: int, n_batches: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Fixed validation batches, spread evenly over the text, the same on every peer.

    Args:
        tokens: Validation bytes, 1-D.
        seq_len: Tokens per sequence.
        batch_size: Sequences per batch.
        n_batches: Batches wanted.

    Returns:
        Up to ``n_batches`` ``(x, y)`` pairs of int64 (batch_size, seq_len) tensors. Fewer when the
        text holds fewer than ``n_batches * batch_size`` windows; a single smaller batch when it holds
        fewer than ``batch_size``; empty when it holds no window at all.
    """
    window = seq_len + 1
    n_chunks = tokens.numel() // window
    n_rows = min(n_chunks, n_batches * batch_size)
    if n_rows >= batch_size:
        n_rows -= n_rows % batch_size
    if n_rows < 1:
        return []
    # Integer arithmetic so that indices stay exact and distinct for any length of text.
    ids = torch.arange(n_rows) * n_chunks // n_rows
    windows = tokens[: n_chunks * window].view(n_chunks, window)[ids].long()
    return [(rows[:, :-1].contiguous(), rows[:, 1:].contiguous()) for rows in windows.split(batch_size)]
