"""The inner optimizer: torch's AdamW, or bitsandbytes' 8-bit AdamW where memory is short.

AdamW keeps two fp32 moments per parameter (8 bytes); `bitsandbytes.optim.AdamW8bit` keeps them
block-wise quantized to 8 bits (about 2 bytes), which is what lets a ~1B-parameter model train on a 24 GB
GPU (Dettmers et al., "8-bit Optimizers via Block-wise Quantization", arXiv 2110.02861). Its tensors
smaller than `min_8bit_size` keep fp32 state, as in bitsandbytes.
"""

from __future__ import annotations

import inspect
import logging
import sys
from collections.abc import Iterable

import torch

from p2pdiloco.algorithm.outer import cosine_lr
from p2pdiloco.config import ConfigError, InnerOptConfig

logger = logging.getLogger(__name__)


def _defer_dynamo(cls: type) -> None:
    """Keep the methods of `cls` that torch wraps in `torch._disable_dynamo` (Optimizer's `add_param_group`,
    `zero_grad`, `state_dict`, ...; shared by every optimizer of the process) from importing torch._dynamo at
    their first call, for as long as nothing else has imported it.

    That wrapper imports torch._dynamo only to tell it not to trace the method; while torch._dynamo is not
    imported nothing can be tracing, so the method runs as it is. Once it is imported (run.compile,
    bitsandbytes), torch's wrapper decides again, as if this had never run. A torch whose wrapper differs is
    left as it is: the import then happens as before, and only the memory is lost.
    """
    wrapper_code = torch._disable_dynamo(lambda: None).__code__
    for klass in cls.__mro__:
        for method in vars(klass).values():
            fn = getattr(method, "__wrapped__", None)
            if getattr(method, "__code__", None) is not wrapper_code or fn is None:
                continue
            if getattr(fn, "__dynamo_disable", None) is not None:  # done, or dynamo already decided
                continue

            def until_dynamo(*args, _fn=fn, _method=method, **kwargs):
                if "torch._dynamo" in sys.modules:  # from now on torch's own wrapper decides
                    del _fn.__dynamo_disable
                    return _method(*args, **kwargs)
                return _fn(*args, **kwargs)

            fn.__dynamo_disable = until_dynamo


_ADAM_STEP = inspect.unwrap(torch.optim.Adam.step)
"""torch's Adam step without its wrappers (hooks, and the grad mode switch that imports torch._dynamo)."""


class AdamW(torch.optim.AdamW):
    """torch's AdamW, the same math bit for bit, that never imports torch._dynamo.

    torch's `step` imports torch._dynamo at every call (`_use_grad_for_differentiable`), only to place graph
    breaks for torch.compile; with it come sympy and ~800 modules: ~70 MB in a peer's process, imported after
    the DHT process forked, so that the pages the two shared are copied too (~110 MB PSS a peer in all on the
    benchmark model). This one runs torch's own step body under `torch.no_grad()`, which is what that
    wrapper does for an optimizer that is not `differentiable` (the inner optimizer never is); step hooks still
    run (torch wraps this class's `step` with them as it does any optimizer's).
    """

    @torch.no_grad()
    def step(self, closure=None):
        return _ADAM_STEP(self, closure)


_defer_dynamo(AdamW)


def build_inner_optimizer(params: Iterable[torch.nn.Parameter], cfg: InnerOptConfig,
                          device: torch.device) -> torch.optim.Optimizer:
    """The optimizer `cfg.optimizer` names, over `params` (which live on `device`).

    Raises:
        ConfigError: adamw8bit where bitsandbytes cannot be imported or has no 8-bit optimizer kernels
            for `device`.
    """
    kwargs = {"lr": cfg.lr, "betas": (cfg.beta1, cfg.beta2), "weight_decay": cfg.weight_decay}
    if cfg.optimizer == "adamw":
        return AdamW(params, **kwargs)
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
