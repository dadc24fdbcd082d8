"""The run's text as tokens: text files (`data.paths`) or a dataset (`data.dataset`), encoded with the run's
tokenizer, split into training and validation by document, and cached on disk (token_cache.py).

With the byte tokenizer and no dataset this is `data.load_text`, unchanged. Otherwise every document (a text file,
or a row of a dataset) goes whole to one side: validation when `is_val_file` says so of its key (the file's
relative path, or ``file#row``), so that every peer holding the same data makes the same split. Documents are
read in a fixed order until `data.max_bytes` bytes of text, and `data.shard` later cuts the training tokens into
contiguous parts (`BatchSampler`), so that a peer's part depends only on the data and its shard, never on who
else is in the swarm.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch

from p2pdiloco.config import ConfigError, DataConfig
from p2pdiloco.training import datasets, token_cache
from p2pdiloco.training.data import TextData, is_val_file, list_candidates, load_text, read_texts
from p2pdiloco.training.tokenizer import BYTES, Tokenizer

LOG = logging.getLogger(__name__)

CACHE_FORMAT = 1
"""Bump when the tokens a given source, tokenizer and settings produce change (e.g. documents get separators)."""
ENCODE_CHARS = 4_000_000
"""Characters per `encode_batch` call: big enough to keep every core busy, small enough to bound memory."""


def token_dtype(vocab_size: int) -> torch.dtype:
    """The smallest dtype that holds ids below `vocab_size`: uint8, uint16 or int32."""
    return torch.uint8 if vocab_size <= 256 else torch.uint16 if vocab_size <= 65536 else torch.int32


def documents(cfg: DataConfig) -> tuple[list[tuple[str, str]], str]:
    """``[(key, text)]`` in reading order until `cfg.max_bytes` bytes of UTF-8 text, and the source's name: what
    the run trains on, and what `p2pdiloco tokenizer train` learns its merges from."""
    if not cfg.dataset:
        texts, source = read_texts(cfg.paths, cfg.max_bytes)
        # the byte budget may cut the last file mid-character: drop the partial character
        return [(rel, data.decode("utf-8", errors="ignore")) for rel, data in texts], source
    docs, total = [], 0
    for key, text in datasets.iter_documents(cfg.dataset, cfg.text_field):
        if total >= cfg.max_bytes:
            break
        raw = text.encode("utf-8")
        if len(raw) > cfg.max_bytes - total:
            raw = raw[: cfg.max_bytes - total]
            text = raw.decode("utf-8", errors="ignore")
        if text:
            docs.append((key, text))
            total += len(raw)
    if not docs:
        raise ConfigError(f"no text in data.dataset {cfg.dataset} (field {cfg.text_field!r})")
    return docs, f"dataset {cfg.dataset}"


def _encode(tokenizer: Tokenizer, texts: list[str], dtype: torch.dtype) -> torch.Tensor:
    """The texts' tokens, one after another, as a 1-D tensor of `dtype`."""
    if tokenizer.digest == BYTES:  # a dataset read as bytes: no need to go through lists of ints
        raw = bytearray("".join(texts).encode("utf-8"))
        return torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
    parts, batch, chars = [], [], 0
    np_dtype = {torch.uint8: np.uint8, torch.uint16: np.uint16, torch.int32: np.int32}[dtype]
    for i, text in enumerate(texts):
        batch.append(text)
        chars += len(text)
        if chars >= ENCODE_CHARS or i == len(texts) - 1:
            parts += [np.asarray(ids, dtype=np_dtype) for ids in tokenizer.encode_batch(batch)]
            batch, chars = [], 0
    return torch.from_numpy(np.concatenate(parts) if parts else np.zeros(0, dtype=np_dtype))


def _cache_parts(cfg: DataConfig, tokenizer: Tokenizer) -> dict:
    """Everything the tokens depend on: the source's files (path, size, modification time), the tokenizer and the
    settings that change which text is read or how it is split."""
    if cfg.dataset:
        stamp = datasets.source_stamp(cfg.dataset, cfg.text_field)
    else:
        stamp = []
        for c in list_candidates(cfg.paths)[0]:
            try:
                st = c.path.stat()
                stamp.append([c.rel_path, str(c.path.resolve()), st.st_size, st.st_mtime_ns])
            except OSError:  # gone or unreadable since the listing: reading skips it too
                stamp.append([c.rel_path, None])
    # not the paths as written: "data" and "/home/me/data" (a peer of `local` gets resolved paths) are one source
    return {"format": CACHE_FORMAT, "tokenizer": tokenizer.digest, "source": stamp,
            "text_field": cfg.text_field if cfg.dataset else "", "max_bytes": cfg.max_bytes,
            "val_fraction": cfg.val_fraction}


def tokenize(cfg: DataConfig, tokenizer: Tokenizer) -> tuple[dict[str, torch.Tensor], dict]:
    """Read and encode the documents, split by document: ``{"train", "val"}`` tokens and their counts (meta)."""
    t0 = time.monotonic()
    docs, source = documents(cfg)
    n_bytes = sum(len(text.encode("utf-8")) for _, text in docs)
    LOG.info("tokenizing %d documents (%.1f MB) from %s", len(docs), n_bytes / 1e6, source)
    val_docs = [text for key, text in docs if is_val_file(key, cfg.val_fraction)]
    train_docs = [text for key, text in docs if not is_val_file(key, cfg.val_fraction)]
    dtype = token_dtype(tokenizer.vocab_size)
    arrays = {"train": _encode(tokenizer, train_docs, dtype), "val": _encode(tokenizer, val_docs, dtype)}
    meta = {"n_files": len(docs), "n_bytes": n_bytes, "val_bytes": sum(len(t.encode("utf-8")) for t in val_docs),
            "source": source}
    LOG.info("tokenized %.1f MB into %d tokens in %.1f s", n_bytes / 1e6, sum(a.numel() for a in arrays.values()),
             time.monotonic() - t0)
    return arrays, meta


def load_corpus(cfg: DataConfig, tokenizer: Tokenizer, min_tokens: int = 2) -> TextData:
    """The run's training and validation tokens, from the cache when it holds them.

    Args:
        cfg: the `[data]` table: paths or dataset, byte budget, validation share, cache folder.
        tokenizer: the run's tokenizer (`load_tokenizer(cfg.tokenizer)`).
        min_tokens: fewest tokens to accept; the trainer passes ``2 * (seq_len + 1)`` so that both splits can
            hold a window. If the split by document leaves a side with fewer than half of them (e.g. one file),
            the tail of all tokens is held out instead.

    Returns:
        The two splits, 1-D tensors of `token_dtype(tokenizer.vocab_size)`, and `val_bytes`, the bytes of text
        the validation tokens encode (for the eval loss per byte).

    Raises:
        ConfigError: the data cannot be read (see `read_texts`, `datasets.iter_documents`) or is too short.
    """
    if tokenizer.digest == BYTES and not cfg.dataset:
        return load_text(cfg, min_bytes=min_tokens)
    if cfg.dataset:
        datasets.require_datasets()
    t0 = time.monotonic()
    path = token_cache.cache_file(cfg.cache_dir, _cache_parts(cfg, tokenizer))
    cached = token_cache.read_tokens(path)
    if cached is not None:
        arrays, meta = cached
        LOG.info("tokens from the cache %s in %.2f s", path, time.monotonic() - t0)
    else:
        arrays, meta = tokenize(cfg, tokenizer)
        if path is not None:
            token_cache.write_tokens(path, arrays, meta)
    train, val, val_bytes = arrays["train"], arrays["val"], meta["val_bytes"]
    total = train.numel() + val.numel()
    min_tokens = max(min_tokens, 2)
    if total < min_tokens:
        raise ConfigError(f"only {total} tokens of text in {meta['source']}; need at least {min_tokens}")
    need = min_tokens // 2
    if train.numel() < need or val.numel() < need:
        # too few documents for a split by document: hold out the tail, the same on every peer; its bytes are
        # estimated at the corpus's average bytes per token
        everything = torch.cat([train, val])
        held = min(max(int(total * cfg.val_fraction), need), total - need)
        LOG.info("split by document left a side short of %d tokens; holding out the last %d tokens", need, held)
        train, val, val_bytes = everything[: total - held], everything[total - held:], meta["n_bytes"] * held // total
    data = TextData(train=train, val=val, n_files=meta["n_files"], n_bytes=meta["n_bytes"], source=meta["source"],
                    val_bytes=max(val_bytes, 1))
    LOG.info("tokens: %d documents, %d train + %d val tokens (%.2f bytes a token) from %s", data.n_files,
             train.numel(), val.numel(), 1 / data.tokens_per_byte, data.source)
    return data
