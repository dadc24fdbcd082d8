"""Tokenizers: the byte-level default (every byte a token, vocabulary 256) or a Hugging Face `tokenizer.json`.

`data.tokenizer = "bytes"` keeps the byte-level model that every machine agrees on by construction; a path to
a `tokenizer.json` (HF `tokenizers`, e.g. a byte-level BPE trained with `p2pdiloco tokenizer train`) gives a
real vocabulary. Every peer of a swarm must use the same one: its digest is part of the swarm fingerprint.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Protocol

from p2pdiloco.config import ConfigError

BYTES = "bytes"
"""`data.tokenizer` value of the byte-level tokenizer."""


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


class ByteTokenizer:
    """Every UTF-8 byte is a token."""

    vocab_size = 256
    digest = BYTES

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


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
