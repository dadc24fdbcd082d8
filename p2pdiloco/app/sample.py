"""`p2pdiloco sample RUN_DIR --prompt TEXT`: text from a run's latest global model, with the run's tokenizer."""

from __future__ import annotations

from pathlib import Path

import torch

from p2pdiloco.app.saved_model import latest_model, run_tokenizer
from p2pdiloco.config import ConfigError
from p2pdiloco.training.accel import pick_device
from p2pdiloco.training.generate import generate


def sample_text(run_dir: str | Path, prompt: str, n_tokens: int = 200, temperature: float = 0.8, top_k: int = 50,
                seed: int | None = None, device: str = "cpu") -> str:
    """The prompt and its continuation by the latest global model of `run_dir` (either arch).

    Args:
        run_dir: a peer's or a `local` run's folder.
        prompt: the text to continue.
        n_tokens: tokens to generate.
        temperature: sampling temperature (0: greedy).
        top_k: sample among the k most likely tokens (0: all).
        seed: seed of the draws; None draws a fresh one.
        device: where the forward passes run ('auto', 'cpu', 'cuda', ...).

    Raises:
        ConfigError: no model in `run_dir`, its tokenizer is gone, or a flag is out of range.
    """
    if n_tokens < 0 or temperature < 0 or top_k < 0:
        raise ConfigError("--tokens, --temperature and --top-k must be >= 0")
    saved = latest_model(run_dir)
    tokenizer = run_tokenizer(saved)
    ids = tokenizer.encode(prompt)
    if not ids:
        raise ConfigError("--prompt has no tokens: give at least one character")
    dev = pick_device(device)
    generator = torch.Generator()
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    out = generate(saved.model.to(dev), ids, n_tokens, saved.cfg.model.seq_len, temperature, top_k, generator, dev)
    return prompt + tokenizer.decode(out)
