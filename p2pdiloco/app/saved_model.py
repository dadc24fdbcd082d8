"""The latest global model θg of a run folder, for `p2pdiloco sample` and `p2pdiloco export`.

A run folder is one peer's (`p2pdiloco peer --run-dir RUN_DIR`) or a whole local swarm's
(`p2pdiloco local`: each peer in RUN_DIR/peers/peerN/). A peer leaves θg in two kinds of files:
`model.safetensors` (named weights, written when it ends normally) and `checkpoints/ckpt-*.safetensors` (θg
as one flat vector, written every few merges and at the end). The newest file of either kind, over every
peer of the folder, is the latest global model; a damaged checkpoint is skipped for the next newest.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from p2pdiloco.config import Config, ConfigError, load_config
from p2pdiloco.training.checkpoint import DAMAGED, PATTERN, load_checkpoint
from p2pdiloco.training.flat import load_flat_
from p2pdiloco.training.model import build_model, load_named_weights_
from p2pdiloco.training.tokenizer import BYTES, Tokenizer, load_tokenizer

logger = logging.getLogger(__name__)

MODEL_FILE = "model.safetensors"


@dataclass
class SavedModel:
    """A global model read back from a run folder."""

    cfg: Config
    """The run's config, as the run recorded it."""
    model: torch.nn.Module
    """The model with θg's weights, on CPU, in eval mode."""
    path: Path
    """The file it came from."""
    run_dir: Path
    """The run folder it was found in."""


def model_files(run_dir: Path) -> list[Path]:
    """Every file of `run_dir` that may hold a global model, newest first (by modification time)."""
    folders = [run_dir, *sorted(p for p in (run_dir / "peers").glob("*") if p.is_dir())]
    files = []
    for folder in folders:
        files += [f for f in [folder / MODEL_FILE] if f.is_file()]
        files += sorted((folder / "checkpoints").glob(PATTERN))
    return sorted(files, key=lambda f: f.stat().st_mtime, reverse=True)


def recorded_config(values: dict, source: Path) -> Config:
    """The run's config from the dict it recorded (`Config.to_dict`)."""
    try:
        return load_config(None, [values])
    except ConfigError as e:
        raise ConfigError(f"{source}: the recorded config does not load: {e}") from None


def _summary_config(folder: Path) -> dict | None:
    """The config in a summary.json of this peer's folder or, for a `local` peer, of the run above it."""
    for path in (folder / "summary.json", folder.parent.parent / "summary.json"):
        if path.is_file():
            try:
                return json.loads(path.read_text())["config"]
            except (OSError, ValueError, KeyError):
                continue
    return None


def _read_model_file(path: Path) -> tuple[dict | None, dict[str, torch.Tensor]]:
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
    recorded = json.loads(meta["config"]) if "config" in meta else _summary_config(path.parent)
    return recorded, load_file(str(path))


def read_saved(path: Path, run_dir: Path) -> SavedModel:
    """The model in one file of `model_files`.

    Raises:
        ConfigError: no config is recorded for it, or its weights do not fit that config.
        `checkpoint.DAMAGED`: the file cannot be read.
    """
    if path.name == MODEL_FILE:
        recorded, tensors = _read_model_file(path)
    else:
        tensors, meta = load_checkpoint(path)
        recorded = meta.get("config")
    if recorded is None:
        raise ConfigError(f"{path}: no config recorded with it (nor in a summary.json beside it)")
    cfg = recorded_config(recorded, path)
    model = build_model(cfg.model)
    try:
        if path.name == MODEL_FILE:
            load_named_weights_(model, tensors)
        else:
            load_flat_(model, tensors["global_params"])
    except (ValueError, RuntimeError) as e:
        raise ConfigError(f"{path}: its weights do not fit the recorded model config ({e})") from None
    return SavedModel(cfg, model.eval(), path, run_dir)


def latest_model(run_dir: str | Path) -> SavedModel:
    """The latest global model of `run_dir` (see the module docstring).

    Raises:
        ConfigError: `run_dir` is not a folder, or holds no usable model.
    """
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ConfigError(f"{run_dir} is not a folder (expected a run folder, e.g. runs/latest)")
    for path in model_files(run_dir):
        try:
            return read_saved(path, run_dir)
        except DAMAGED as e:  # ConfigError is a ValueError: a file with no usable config is skipped too
            logger.warning("skipping %s: %s", path, e)
    raise ConfigError(f"no model in {run_dir}: no {MODEL_FILE} or checkpoints/ckpt-*.safetensors "
                      "(nor in peers/*/); a run writes them after its first merges and when it ends")


def run_tokenizer(saved: SavedModel) -> Tokenizer:
    """The tokenizer the run trained with (`data.tokenizer`). A relative path is taken as the run took it:
    relative to the folder the run was started from; if that is not this one, relative to the run folder.

    Raises:
        ConfigError: the tokenizer file is gone.
    """
    spec = saved.cfg.data.tokenizer
    if spec in ("", BYTES):
        return load_tokenizer(spec)
    for candidate in (Path(spec).expanduser(), saved.run_dir / spec):
        if candidate.is_file():
            return load_tokenizer(str(candidate))
    raise ConfigError(f"the run's tokenizer {spec!r} (data.tokenizer) is gone: no such file here or in "
                      f"{saved.run_dir}; the model needs the very tokenizer it was trained with")
