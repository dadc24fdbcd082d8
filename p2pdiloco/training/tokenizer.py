"""Tokenizers: the byte-level default (every byte a token, vocabulary 256) or a Hugging Face `tokenizer.json`.

`data.tokenizer = "bytes"` keeps the byte-level model that every machine agrees on by construction; a path to
a `tokenizer.json` (HF `tokenizers`, e.g. a byte-level BPE trained with `p2pdiloco tokenizer train`) gives a
real vocabulary. Every peer of a swarm must use the same one: its digest is part of the swarm fingerprint.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Protocol

from p2pdiloco.config import ConfigError
from p2pdiloco.util.files import write_atomic

LOG = logging.getLogger(__name__)

BYTES = "bytes"
"""`data.tokenizer` value of the byte-level tokenizer."""
END_OF_TEXT = "<|endoftext|>"
"""The one special token of a tokenizer from `train_bpe` (id 0): a document boundary for samplers and exports.
The data loader does not insert it; text that spells it out literally still encodes to this one id."""
MIN_BPE_VOCAB = 257
"""The smallest vocabulary `train_bpe` accepts: the special token and the 256 bytes (no merge yet)."""


class Tokenizer(Protocol):
    """Text to token ids and back."""

    vocab_size: int
    """Token ids are in [0, vocab_size)."""
    digest: str
    """What every peer of a swarm must agree on: "bytes", or a hash of the tokenizer file."""

    def encode(self, text: str) -> list[int]:
        """Token ids of `text` (no special tokens added)."""
        ...

    def decode(self, ids: list[int]) -> str:
        """The text of `ids` (invalid byte sequences replaced)."""
        ...

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """`encode` of each text (in parallel where the library can)."""
        ...


class ByteTokenizer:
    """Every UTF-8 byte is a token."""

    vocab_size = 256
    digest = BYTES

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]


class HFTokenizer:
    """A Hugging Face `tokenizers` tokenizer loaded from its `tokenizer.json`.

    Args:
        path: the `tokenizer.json` file.
    """

    def __init__(self, path: Path):
        try:
            from tokenizers import Tokenizer as _HF
        except ImportError as e:  # pragma: no cover - tokenizers is a dependency
            raise ConfigError(f"data.tokenizer {str(path)!r} needs the 'tokenizers' package: {e}") from None
        self.path = Path(path)
        try:
            raw = self.path.read_bytes()
            self._tok = _HF.from_str(raw.decode("utf-8"))
        except Exception as e:  # OSError, a bad encoding, or the tokenizers library's own errors
            raise ConfigError(f"data.tokenizer {str(path)!r}: cannot load it ({e})") from None
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.digest = "sha256:" + hashlib.sha256(raw).hexdigest()[:16]

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=False)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        # the Rust side spreads a batch over the cores; encode_batch_fast (tokenizers >= 0.20) skips the offsets
        fast = getattr(self._tok, "encode_batch_fast", self._tok.encode_batch)
        return [e.ids for e in fast(texts, add_special_tokens=False)]


def load_tokenizer(spec: str) -> Tokenizer:
    """The tokenizer `data.tokenizer` names: "bytes" or a path to a `tokenizer.json`.

    Raises:
        ConfigError: the file is missing or is not a tokenizer.
    """
    if spec in ("", BYTES):
        return ByteTokenizer()
    path = Path(spec).expanduser()
    if not path.is_file():
        raise ConfigError(f"data.tokenizer {spec!r}: no such file (give 'bytes' or a tokenizer.json)")
    return HFTokenizer(path)


def check_vocab(tokenizer: Tokenizer, vocab_size: int, spec: str) -> None:
    """Raise a one-line ConfigError unless the model's vocabulary is the tokenizer's.

    Args:
        tokenizer: the loaded tokenizer.
        vocab_size: `model.vocab_size`.
        spec: `data.tokenizer`, for the message.
    """
    if tokenizer.vocab_size != vocab_size:
        raise ConfigError(f"data.tokenizer {spec!r} has {tokenizer.vocab_size} tokens but model.vocab_size is "
                          f"{vocab_size}; set model.vocab_size = {tokenizer.vocab_size}")


def check_bpe_args(vocab_size: int, out: Path) -> Path:
    """`out`, expanded, if `train_bpe` can train `vocab_size` tokens and write them there; else ConfigError."""
    if vocab_size < MIN_BPE_VOCAB:
        raise ConfigError(f"--vocab-size must be >= {MIN_BPE_VOCAB} (the 256 bytes and {END_OF_TEXT}), got {vocab_size}")
    out = Path(out).expanduser()
    if out.is_dir():
        raise ConfigError(f"cannot write {out}: it is a folder (give a file name, e.g. {out / 'tokenizer.json'})")
    if not out.parent.is_dir() or not os.access(out.parent, os.W_OK):
        raise ConfigError(f"cannot write {out}: {out.parent} is not a writable folder")
    return out


def train_bpe(texts: Iterable[str], vocab_size: int, out: Path, min_frequency: int = 2,
              progress: Callable[[str], None] = LOG.info) -> HFTokenizer:
    """Train a byte-level BPE tokenizer (GPT-2's scheme) on `texts` and write its `tokenizer.json` to `out`.

    Deterministic: the same texts give a byte-identical file, so peers that train their own from
    the same data agree on its digest. Ids: 0 is `END_OF_TEXT`, 1..256 the bytes, then merges in the order learnt.

    Args:
        texts: the training text, e.g. one string per file or document.
        vocab_size: tokens wanted, at least `MIN_BPE_VOCAB`; fewer result when the text has too few pairs
            seen `min_frequency` times.
        out: where to write the `tokenizer.json`; written to a temporary file first and renamed, so a reader
            never sees half of it.
        min_frequency: fewest occurrences of a pair for it to become a merge.
        progress: called with one line per phase.

    Raises:
        ConfigError: `vocab_size` is too small, or `out` cannot be written.
    """
    from tokenizers import Tokenizer as _HF
    from tokenizers import decoders, models, pre_tokenizers, trainers

    out = check_bpe_args(vocab_size, out)
    tok = _HF(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency, show_progress=False,
                                  special_tokens=[END_OF_TEXT], initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    t0 = time.monotonic()
    progress(f"training a byte-level BPE of {vocab_size} tokens")
    tok.train_from_iterator(texts, trainer=trainer)
    progress(f"trained {tok.get_vocab_size()} tokens in {time.monotonic() - t0:.1f} s")
    try:
        write_atomic(out, tok.to_str())
    except OSError as e:
        raise ConfigError(f"cannot write {out}: {e.strerror}") from None
    written = HFTokenizer(out)
    progress(f"wrote {out} ({written.vocab_size} tokens, {written.digest})")
    return written
