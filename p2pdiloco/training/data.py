"""Byte-level text data: find text files, read them into one uint8 tensor, split train/val by file (batches.py samples it).

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
