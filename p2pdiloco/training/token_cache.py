"""Tokenized text on disk, so that a peer's second start (a restart, the next run on the same data) skips the
tokenization.

One file per key (a hash of the source files' stamps, the tokenizer's digest and the settings that change the
tokens, see corpus.py). Layout: `MAGIC`, the header's length (8 bytes, little-endian), the header (JSON: the
arrays' names, dtypes and lengths, what the caller keeps beside them, and a BLAKE2b digest of the payload), then
the arrays' raw bytes. Written to a temporary file and renamed; read back only if everything checks out, so a
damaged file (a crash mid-write on a file system without atomic rename, a disk error) is rebuilt, never trusted.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any

import torch

from p2pdiloco.util.files import replacing

LOG = logging.getLogger(__name__)

MAGIC = b"P2PDILOCO-TOKENS-1\n"
"""First bytes of a cache file (the format's version is part of it)."""
DTYPES = {"uint8": torch.uint8, "uint16": torch.uint16, "int32": torch.int32}
"""The token dtypes a cache file may hold."""


def cache_key(parts: dict[str, Any]) -> str:
    """A file-name-safe hash of `parts` (JSON-able): equal parts, equal key."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:32]


def cache_file(cache_dir: str, parts: dict[str, Any]) -> Path | None:
    """Where the tokens of `parts` are cached under `data.cache_dir`; None when the cache is off (empty)."""
    if not cache_dir:
        return None
    return Path(cache_dir).expanduser() / f"{cache_key(parts)}.tokens"


def _digest(payload: bytes | bytearray | memoryview) -> str:
    return hashlib.blake2b(payload, digest_size=16).hexdigest()


def write_tokens(path: Path, arrays: dict[str, torch.Tensor], meta: dict[str, Any]) -> bool:
    """Write `arrays` (1-D tensors of a `DTYPES` dtype) and `meta` (JSON-able) to `path`, atomically.

    Returns:
        True if written; False (with a warning) if the folder cannot be written: the run goes on uncached.
    """
    # an empty array made from numpy has stride 0, which `view` refuses (a corpus with no validation document)
    blobs = {name: t.contiguous().view(torch.uint8).numpy().tobytes() if t.numel() else b""
             for name, t in arrays.items()}
    payload = b"".join(blobs.values())
    header = json.dumps({
        "arrays": [{"name": n, "dtype": str(t.dtype).removeprefix("torch."), "numel": t.numel()}
                   for n, t in arrays.items()],
        "meta": meta, "payload_bytes": len(payload), "blake2b": _digest(payload),
    }).encode()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        # peers of one machine may race here: each renames a complete file of its own
        with replacing(path) as tmp, open(tmp, "wb") as f:
            f.write(MAGIC + len(header).to_bytes(8, "little") + header)
            f.write(payload)
        return True
    except OSError as e:
        LOG.warning("cannot write the token cache %s (%s); going on without it", path, e.strerror or e)
        return False


def read_tokens(path: Path | None) -> tuple[dict[str, torch.Tensor], dict[str, Any]] | None:
    """The arrays and meta that `write_tokens` wrote at `path`; None if there is no such file, or (with a warning)
    if it is damaged in any way: wrong magic, a bad header, a short payload, a digest that does not match."""
    if path is None or not path.is_file():
        return None
    try:
        with open(path, "rb") as f:
            if f.read(len(MAGIC)) != MAGIC:
                raise ValueError("not a token cache file")
            size = os.fstat(f.fileno()).st_size
            header = json.loads(f.read(min(int.from_bytes(f.read(8), "little"), size)))
            if not 0 <= int(header["payload_bytes"]) <= size:
                raise ValueError("payload length exceeds the file")
            payload = bytearray(int(header["payload_bytes"]))
            if f.readinto(payload) != len(payload) or f.read(1):
                raise ValueError("payload length differs from the header's")
        if _digest(payload) != header["blake2b"]:
            raise ValueError("payload digest differs from the header's")
        arrays, offset = {}, 0
        for a in header["arrays"]:
            dtype = DTYPES[a["dtype"]]
            arrays[a["name"]] = torch.frombuffer(payload, dtype=dtype, count=a["numel"], offset=offset) \
                if a["numel"] else torch.empty(0, dtype=dtype)
            offset += a["numel"] * dtype.itemsize
        if offset != len(payload):
            raise ValueError("arrays do not fill the payload")
        return arrays, header["meta"]
    except (OSError, ValueError, KeyError, TypeError) as e:  # JSONDecodeError is a ValueError
        LOG.warning("token cache %s is damaged (%s); tokenizing again", path, e)
        return None
