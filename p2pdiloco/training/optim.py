"""The inner optimizer: torch's AdamW, or bitsandbytes' 8-bit AdamW where memory is short.

AdamW keeps two fp32 moments per parameter (8 bytes); `bitsandbytes.optim.AdamW8bit` keeps them
block-wise quantized to 8 bits (about 2 bytes), which is what lets a ~1B-parameter model train on a 24 GB
GPU (Dettmers et al., "8-bit Optimizers via Block-wise Quantization", arXiv 2110.02861). Its tensors
smaller than `min_8bit_size` keep fp32 state, as in bitsandbytes.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch

from p2pdiloco.algorithm.outer import cosine_lr
from p2pdiloco.config import ConfigError, InnerOptConfig

logger = logging.getLogger(__name__)


def build_inner_optimizer(params: Iterable[torch.nn.Parameter], cfg: InnerOptConfig,
                          device: torch.device) -> torch.optim.Optimizer:
    """The optimizer `cfg.optimizer` names, over `params` (which live on `device`).

    Raises:
        ConfigError: adamw8bit where bitsandbytes cannot be imported or has no 8-bit optimizer kernels
            for `device`.
    """
    kwargs = {"lr": cfg.lr, "betas": (cfg.beta1, cfg.beta2), "weight_decay": cfg.weight_decay}
    if cfg.optimizer == "adamw":
        return torch.optim.AdamW(params, **kwargs)
    if cfg.optimizer != "adamw8bit":
        raise ConfigError(f"unknown inner.optimizer {cfg.optimizer!r} (use adamw or adamw8bit)")
    try:
        import bitsandbytes as bnb
    except Exception as e:  # any import failure (missing library, no kernels) means the same to the user
        raise ConfigError(f"inner.optimizer = 'adamw8bit' needs bitsandbytes, which failed to import: {e!r}; "
                          "use inner.optimizer = 'adamw'") from None
    params = list(params)
    if not supports_8bit(device):
        raise ConfigError(f"bitsandbytes {bnb.__version__} has no 8-bit AdamW kernels for {device.type}; "
                          "use inner.optimizer = 'adamw'")
    return bnb.optim.AdamW8bit(params, **kwargs)


_SUPPORT: dict[str, bool] = {}


def supports_8bit(device: torch.device) -> bool:
    """Whether bitsandbytes' 8-bit AdamW can step a parameter on `device` (tried once per device type, on a
    tensor large enough to get 8-bit state)."""
    if device.type not in _SUPPORT:
        try:
            import bitsandbytes as bnb

            p = torch.nn.Parameter(torch.ones(4096, device=device))
            p.grad = torch.full_like(p, 0.5)
            opt = bnb.optim.AdamW8bit([p], lr=1e-3)
            opt.step()
            _SUPPORT[device.type] = bool(torch.isfinite(p).all()) and bool((p < 1).all())
        except Exception as e:  # kernels missing for this device: bitsandbytes raises various types
            logger.debug("bitsandbytes AdamW8bit on %s: %r", device.type, e)
            _SUPPORT[device.type] = False
    return _SUPPORT[device.type]


class InnerSchedule:
    """The inner optimizer's lr: warmup + cosine over the whole run, re-warmed after joining with empty moments.

    A joiner adopts the swarm's step (deep into the schedule) but starts with zero AdamW moments; Adam's first
    bias-corrected updates are then ±lr on every coordinate, a shock to the model it just downloaded. So
    after such a join the lr ramps up linearly again over `warmup_steps` from where it joined.

    Args:
        cfg: the inner optimizer's settings (peak lr, warmup, floor).
        total_steps: the run's length in inner steps.
    """

    def __init__(self, cfg: InnerOptConfig, total_steps: int):
        self.cfg, self.total_steps = cfg, total_steps
        self.moments_fresh = True
        """The optimizer has no moments from earlier training (a new process, not a checkpoint)."""
        self.rewarm_from: int | None = None
        """The step at which this peer adopted the swarm's state with fresh moments."""

    def lr(self, step: int) -> float:
        """The lr of inner step `step`."""
        c = self.cfg
        lr = cosine_lr(step, c.lr, c.warmup_steps, self.total_steps, c.min_lr_ratio)
        if self.rewarm_from is not None and c.warmup_steps > 0:
            since = step - self.rewarm_from
            if since < c.warmup_steps:
                return lr * (since + 1) / c.warmup_steps
            self.rewarm_from = None
        return lr

    def joined_at(self, step: int) -> None:
        """This peer continues from the swarm's state at `step`: re-warm if its moments are fresh."""
        if self.moments_fresh and step > 0:
            self.rewarm_from = step

    def moments_restored(self) -> None:
        """The optimizer's moments came from a checkpoint: no re-warm is needed."""
        self.moments_fresh, self.rewarm_from = False, None
