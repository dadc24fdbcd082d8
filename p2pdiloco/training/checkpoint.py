"""Checkpoints: a peer's global model, outer and inner optimizer state and counters, in safetensors.

Written atomically (temporary file, fsync, rename, fsync of the folder), so a kill at any moment leaves
either the old set of checkpoints or the old set plus a complete new one. A checksum of the tensors is
stored in the metadata and checked at load, so a damaged file is skipped for the previous good one. A learner
writes them in the background (`CheckpointWriter`): the inner steps go on while one is serialized and fsynced.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import signal
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from p2pdiloco.network.state_sync import GlobalState
from p2pdiloco.util.files import replacing

logger = logging.getLogger(__name__)

PATTERN = "ckpt-*.safetensors"


def _checksum(tensors: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(tensors):
        h.update(name.encode())
        h.update(tensors[name].contiguous().numpy().tobytes())
    return h.hexdigest()


def save_checkpoint(folder: Path, round_: int, tensors: dict[str, torch.Tensor], meta: dict, keep: int = 2,
                    kill_midway: bool = False) -> Path:
    """Write `ckpt-{round}.safetensors` atomically and keep only the newest `keep` checkpoints.

    Args:
        folder: where checkpoints live.
        round_: the round counter, used in the file name (higher is newer).
        tensors: CPU tensors by name.
        meta: JSON-serializable counters and config.
        keep: how many checkpoints to keep.
        kill_midway: test hook: SIGKILL this process after writing half the file.
    """
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
    blob = st_save(tensors, metadata={"meta": json.dumps(meta), "sha256": _checksum(tensors)})
    path = folder / f"ckpt-{round_:08d}.safetensors"
    # a visible name of its own (not `temp_beside`'s hidden one): a kill mid-write leaves it, and `load_latest` skips it
    with replacing(path, tmp=path.with_name(path.name + ".tmp"), durable=True) as tmp, tmp.open("wb") as f:
        if kill_midway:
            f.write(blob[: len(blob) // 2])
            f.flush()
            os.fsync(f.fileno())
            os.kill(os.getpid(), signal.SIGKILL)
        f.write(blob)
    for old in sorted(folder.glob(PATTERN))[:-keep]:
        old.unlink(missing_ok=True)
    return path


class CheckpointWriter:
    """`save_checkpoint` in a thread of its own, one write at a time, in the order they were handed over.

    Serializing, hashing and two fsyncs took ~10 ms of the training thread per checkpoint for the bench model
    (bench churn checkpoints every 5 rounds) and take seconds for a large model. The tensors handed over must not
    change afterwards (copies, or θg and momentum, which are replaced, never changed in place). A checkpoint
    handed over while the last one is still being written waits for it, so at most one copy is held. A failed
    write raises at the next `submit` or `wait`."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint")
        self._pending: Future | None = None

    def submit(self, folder: Path, round_: int, tensors: dict[str, torch.Tensor], meta: dict,
               kill_midway: bool = False) -> None:
        """Write this checkpoint once the one being written is on disk; returns at once (see `save_checkpoint`)."""
        self.wait()
        self._pending = self._pool.submit(save_checkpoint, folder, round_, tensors, meta, kill_midway=kill_midway)

    def wait(self) -> Path | None:
        """Block until the checkpoint being written is on disk; its path (None if there was none)."""
        pending, self._pending = self._pending, None
        return pending.result() if pending is not None else None

    def close(self) -> None:
        """Finish the write in progress and stop the thread."""
        try:
            self.wait()
        finally:
            self._pool.shutdown(wait=True)


def load_checkpoint(path: Path) -> tuple[dict[str, torch.Tensor], dict]:
    """The tensors and metadata of one checkpoint file, checksum verified.

    Raises:
        OSError, SafetensorError, ValueError, KeyError, json.JSONDecodeError: unreadable or damaged
            (`DAMAGED` lists them).
    """
    blob = path.read_bytes()
    tensors = st_load(blob)
    with memoryview(blob) as view:
        header_len = int.from_bytes(view[:8], "little")
        header = json.loads(bytes(view[8 : 8 + header_len]))
    meta = header.get("__metadata__", {})
    if meta.get("sha256") != _checksum(tensors):
        raise ValueError("checksum mismatch")
    return tensors, json.loads(meta["meta"])


DAMAGED = (OSError, SafetensorError, ValueError, KeyError, json.JSONDecodeError)
"""What `load_checkpoint` raises for a checkpoint that cannot be used."""


def load_latest(folder: Path) -> tuple[dict[str, torch.Tensor], dict, Path] | None:
    """The newest checkpoint that loads and verifies, or None. Damaged ones are logged and skipped;
    leftover temporary files (a kill mid-write) are ignored."""
    for path in sorted(folder.glob(PATTERN), reverse=True):
        try:
            tensors, meta = load_checkpoint(path)
            return tensors, meta, path
        except DAMAGED as e:
            logger.warning("skipping damaged checkpoint %s: %s", path.name, e)
    return None


def adam_state_flat(opt: torch.optim.Optimizer, params: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """AdamW's moments as two flat fp32 CPU tensors (in `params` order) and its step; {} before the first step."""
    if not all(p in opt.state for p in params):
        return {}
    st = [opt.state[p] for p in params]
    return {
        "adam_exp_avg": torch.cat([s["exp_avg"].flatten().float().cpu() for s in st]),
        "adam_exp_avg_sq": torch.cat([s["exp_avg_sq"].flatten().float().cpu() for s in st]),
        "adam_step": torch.as_tensor(st[0]["step"], dtype=torch.float32).reshape(1).cpu().clone(),  # not a view
    }


def load_adam_state_flat(opt: torch.optim.Optimizer, params: list[torch.Tensor], tensors: dict[str, torch.Tensor]) -> None:
    """Inverse of `adam_state_flat`; does nothing if the checkpoint has no optimizer state."""
    if "adam_exp_avg" not in tensors:
        return
    sizes = [p.numel() for p in params]
    moments = zip(params, tensors["adam_exp_avg"].split(sizes), tensors["adam_exp_avg_sq"].split(sizes), strict=True)
    for p, m, v in moments:
        opt.state[p] = {
            "step": tensors["adam_step"].clone().reshape(()),
            "exp_avg": m.view_as(p).to(p.device, p.dtype).clone(),
            "exp_avg_sq": v.view_as(p).to(p.device, p.dtype).clone(),
        }


OPT_PREFIX = "inner_opt."
"""Tensor names of an optimizer's state other than torch's AdamW: `inner_opt.{param index}.{state key}`."""


def optimizer_state_tensors(opt: torch.optim.Optimizer, params: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """The inner optimizer's state as named CPU tensors; {} before the first step.

    torch's AdamW keeps `adam_state_flat`'s flat fp32 layout. Any other optimizer (bitsandbytes' AdamW8bit:
    uint8 moments `state1`/`state2`, their block scales `absmax1`/`absmax2` and code books `qmap1`/`qmap2`, an
    int `step`) is saved entry by entry as it is, so a resumed 8-bit optimizer continues bit for bit.
    """
    if isinstance(opt, torch.optim.AdamW):
        return adam_state_flat(opt, params)
    if not all(p in opt.state for p in params):
        return {}
    out = {}
    for i, p in enumerate(params):
        for key, value in opt.state[p].items():
            if isinstance(value, torch.Tensor):
                # a copy: bitsandbytes shares one code book (qmap) among parameters, and safetensors refuses
                # tensors that share memory
                out[f"{OPT_PREFIX}{i}.{key}"] = value.detach().cpu().clone()
            elif isinstance(value, int | float) and not isinstance(value, bool):
                # a scalar tensor of the value's kind, so that load gives back an int where it was one
                out[f"{OPT_PREFIX}{i}.{key}"] = torch.tensor(value, dtype=torch.int64 if isinstance(value, int)
                                                             else torch.float64)
    return out


def load_optimizer_state(opt: torch.optim.Optimizer, params: list[torch.Tensor],
                         tensors: dict[str, torch.Tensor]) -> bool:
    """Inverse of `optimizer_state_tensors`. A checkpoint with no optimizer state, or with state of another
    optimizer (inner.optimizer changed between runs), leaves `opt` fresh, with a warning in the second case.

    Returns:
        True if `opt` now holds the checkpoint's moments, False if it was left fresh.
    """
    has_adam = "adam_exp_avg" in tensors
    has_other = any(k.startswith(OPT_PREFIX) for k in tensors)
    if isinstance(opt, torch.optim.AdamW):
        if has_other:
            logger.warning("checkpoint holds another optimizer's state; the inner AdamW starts fresh")
        load_adam_state_flat(opt, params, tensors)
        return has_adam
    if has_adam or not has_other:
        if has_adam:
            logger.warning("checkpoint holds torch AdamW state, not %s's; the inner optimizer starts fresh",
                           type(opt).__name__)
        return False
    for i, p in enumerate(params):
        prefix = f"{OPT_PREFIX}{i}."
        state = {}
        for name, value in tensors.items():
            if name.startswith(prefix):
                key = name[len(prefix):]
                # scalars were saved as 0-dim tensors: give back python numbers (bitsandbytes' step is an int)
                state[key] = value.item() if value.dim() == 0 else value.to(p.device).clone()
        if not state:
            raise ValueError(f"checkpoint has no optimizer state for parameter {i}")
        opt.state[p] = state
    return True


RESIDUAL = "error_feedback"
"""Tensor name of the error-feedback residual (`feedback.ErrorFeedback.residual`) in a learner's checkpoint."""


def learner_checkpoint(state: GlobalState, tokens: int, opt: torch.optim.Optimizer, params: list[torch.Tensor],
                       config: dict, extra: dict | None = None,
                       residual: torch.Tensor | None = None) -> tuple[dict[str, torch.Tensor], dict]:
    """A learner's checkpoint as (tensors, meta): θg, outer momentum, inner optimizer state (copies), the
    error-feedback residual and counters.

    Args:
        state: the learner's global state now (its counters included).
        tokens: tokens this peer has trained on (survives a resume).
        opt, params: the inner optimizer and the model's parameters, in order.
        config: the run's config as a dict, for the record.
        extra: more metadata (JSON), under keys of its own.
        residual: the error-feedback residual, flat fp32 (None: none yet, or error feedback off); never changed in
            place (`ErrorFeedback.commit` replaces it), so the tensor itself is handed over.
    """
    tensors = {"global_params": state.global_params, "momentum": state.momentum,
               **optimizer_state_tensors(opt, params), **({RESIDUAL: residual} if residual is not None else {})}
    meta = {**(extra or {}), "round": state.round, "step": state.step, "tokens": tokens,
            "global_tokens": state.global_tokens, "config": config}
    return tensors, meta


def learner_state(tensors: dict[str, torch.Tensor], meta: dict) -> tuple[GlobalState, int]:
    """The global state and token count of a learner's checkpoint (inverse of `learner_checkpoint`,
    less the optimizer state, which `load_optimizer_state` restores)."""
    state = GlobalState(tensors["global_params"], tensors["momentum"], int(meta["round"]), int(meta["step"]),
                        float(meta["global_tokens"]))
    return state, int(meta.get("tokens", 0))


def feedback_residual(tensors: dict[str, torch.Tensor], n_params: int) -> torch.Tensor | None:
    """The error-feedback residual a learner's checkpoint holds; None (a zero residual) where it holds none (a
    checkpoint written before it held one, or with error feedback off) or one that does not fit the model."""
    residual = tensors.get(RESIDUAL)
    if residual is None or residual.numel() != n_params:
        return None
    return residual.float().flatten().clone()
