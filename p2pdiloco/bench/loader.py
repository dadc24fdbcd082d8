"""`p2pdiloco bench loader`: the data loader's tokens/s beside the trainer's, so that the loader is known never to
limit training (target: at least 10x).

Three figures, on the configured data, tokenizer and model (`--set`): the cold load (read, tokenize, write the
cache) in tokens/s and MB of text/s, the warm load (from the cache) in seconds, the loader's `next_batch` in
tokens/s, and the trainer's inner steps (forward, backward, clip, AdamW) on CPU in tokens/s. About half a minute.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import torch
from rich.console import Console

from p2pdiloco.bench.common import machine, write_results
from p2pdiloco.config import load_config, parse_set
from p2pdiloco.training.batches import BatchSampler
from p2pdiloco.training.corpus import load_corpus
from p2pdiloco.training.model import build_model
from p2pdiloco.training.optim import build_inner_optimizer
from p2pdiloco.training.tokenizer import check_vocab, load_tokenizer

BENCH_LOADER = ["data.max_bytes=8000000"]
"""8 MB of text: long enough for a steady tokenization rate, short enough for a cold load of a few seconds."""


def _timed(fn, seconds: float) -> tuple[int, float]:
    """Call `fn` until `seconds` pass; (calls, elapsed seconds)."""
    n, t0 = 0, time.monotonic()
    while time.monotonic() - t0 < seconds:
        fn()
        n += 1
    return n, time.monotonic() - t0


def bench_loader(out: Path, sets: list[str] | None = None, seconds: float = 8.0, console: Console | None = None) -> dict:
    """Measure the loader against the trainer; writes out/loader.json.

    Args:
        out: results folder; its `cache/` subfolder is the token cache, emptied first so the cold load is cold.
        sets: ``section.key=value`` overrides (e.g. data.tokenizer, data.dataset, model.vocab_size).
        seconds: how long the trainer's inner steps are timed (the loader's `next_batch` gets a quarter of it).
    """
    console = console or Console()
    out.mkdir(parents=True, exist_ok=True)
    cache = out / "cache"
    shutil.rmtree(cache, ignore_errors=True)
    cfg = load_config(None, [parse_set([*BENCH_LOADER, f"data.cache_dir={cache}", *(sets or [])])])
    tokenizer = load_tokenizer(cfg.data.tokenizer)
    check_vocab(tokenizer, cfg.model.vocab_size, cfg.data.tokenizer)
    min_tokens = 2 * (cfg.model.seq_len + 1)

    t0 = time.monotonic()
    data = load_corpus(cfg.data, tokenizer, min_tokens)
    cold_s = time.monotonic() - t0
    t0 = time.monotonic()
    data = load_corpus(cfg.data, tokenizer, min_tokens)
    warm_s = time.monotonic() - t0
    n_tokens = data.train.numel() + data.val.numel()

    sampler = BatchSampler(data.train, cfg.model.seq_len, cfg.data.batch_size, cfg.run.seed, cfg.data.shard)
    calls, elapsed = _timed(sampler.next_batch, seconds / 4)
    loader_tps = calls * sampler.tokens_per_batch / elapsed

    if cfg.run.threads > 0:
        torch.set_num_threads(cfg.run.threads)
    device = torch.device("cpu")
    model = build_model(cfg.model)
    opt = build_inner_optimizer(model.parameters(), cfg.inner, device)
    batch = sampler.next_batch()

    def inner_step() -> None:  # the same batch each time: the loader's share is measured above, alone
        _, loss = model(*batch)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.inner.grad_clip)
        opt.step()

    _timed(inner_step, 1.0)  # warm-up
    steps, elapsed = _timed(inner_step, seconds)
    trainer_tps = steps * sampler.tokens_per_batch / elapsed

    results = {
        "machine": machine(), "tokenizer": tokenizer.digest, "vocab_size": tokenizer.vocab_size,
        "source": data.source, "text_bytes": data.n_bytes, "tokens": n_tokens, "bytes_per_token": data.n_bytes / n_tokens,
        "cold_load_s": cold_s, "cold_tokens_per_s": n_tokens / cold_s, "cold_mb_per_s": data.n_bytes / 1e6 / cold_s,
        "warm_load_s": warm_s, "loader_tokens_per_s": loader_tps, "trainer_tokens_per_s": trainer_tps,
        "trainer_steps": steps, "ratio": loader_tps / trainer_tps,
        "model": cfg.model.model_dump(), "batch_size": cfg.data.batch_size, "threads": torch.get_num_threads(),
    }
    path = write_results(out, "loader", results)
    console.print(f"machine: {results['machine']}")
    console.print(f"data: {data.source}, {data.n_bytes / 1e6:.1f} MB of text, {n_tokens} tokens "
                  f"({results['bytes_per_token']:.2f} bytes a token, tokenizer {tokenizer.digest})")
    cached = "the cache" if tokenizer.digest != "bytes" or cfg.data.dataset else "the files again (bytes: no cache)"
    console.print(f"cold load (read, tokenize, cache): {cold_s:.2f} s = {results['cold_tokens_per_s']:,.0f} tokens/s "
                  f"({results['cold_mb_per_s']:.2f} MB/s); warm load from {cached}: {warm_s:.2f} s")
    console.print(f"tokens/s: loader next_batch {loader_tps:,.0f} ÷ trainer inner steps {trainer_tps:,.0f} "
                  f"(CPU, {torch.get_num_threads()} threads) = {results['ratio']:,.0f}x (target >= 10x)")
    console.print(f"wrote {path}")
    return results
