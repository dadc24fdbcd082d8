"""Whatever accelerator a peer has: device choice, compute precision, FLOPs, MFU and peak memory.

Peers of one swarm may train on a laptop CPU, an Apple GPU or a data-centre GPU. Whatever the device and
the precision of its inner steps, what a peer merges is fp32 on CPU (`Learner._local_params`), so peers on
different hardware merge the same kind of numbers.
"""

from __future__ import annotations

import contextlib
import logging
import resource
import sys
from collections.abc import Callable

import torch

from p2pdiloco.config import PRECISIONS, ConfigError, ModelConfig

logger = logging.getLogger(__name__)

# Dense bf16 tensor-core peak of each GPU in FLOP/s, from the vendors' data sheets (no sparsity). Matched
# against torch.cuda.get_device_name() by the first key contained in it, so more specific names come first.
PEAK_BF16_FLOPS: list[tuple[str, float]] = [
    ("H200", 989e12),
    ("H100 PCIe", 756e12),
    ("H100", 989e12),  # SXM
    ("A100", 312e12),
    ("L40S", 362e12),
    ("L4", 121e12),
    ("RTX 4090", 165e12),
    ("RTX 3090", 71e12),
    ("RTX A6000", 155e12),
    ("V100", 125e12),  # fp16: V100 has no bf16 tensor cores
    ("T4", 65e12),  # fp16, as above
]


def _mps_available() -> bool:
    return getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available()


def _xpu_available() -> bool:
    return hasattr(torch, "xpu") and torch.xpu.is_available()


def pick_device(name: str) -> torch.device:
    """'auto' picks cuda > mps > xpu > cpu; anything else must name a device this machine has."""
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if _mps_available():
            return torch.device("mps")
        if _xpu_available():
            return torch.device("xpu")
        return torch.device("cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ConfigError(f"unknown device {name!r} (use auto, cpu, cuda, cuda:N, mps or xpu)") from None
    available = {"cpu": True, "cuda": torch.cuda.is_available(), "mps": _mps_available(), "xpu": _xpu_available()}
    if not available.get(device.type, False):
        raise ConfigError(f"device {name!r} is not available on this machine")
    return device


def compute_dtype(device: torch.device, precision: str = "auto") -> torch.dtype:
    """The dtype inner steps compute in (parameters and optimizer state stay fp32 either way).

    Args:
        device: where inner steps run.
        precision: 'auto' uses bf16 where it is fast and safe without a loss scaler (CUDA GPUs that support
            bf16, Intel XPUs) and fp32 elsewhere: on CPU bf16 autocast is slower than fp32 unless the CPU has
            AMX, and on MPS it needs macOS 14, which we cannot check here. 'fp32' or 'bf16' force one.
    """
    if precision not in PRECISIONS:
        raise ConfigError(f"run.precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    if precision == "fp32":
        return torch.float32
    if precision == "bf16":
        return torch.bfloat16
    if device.type == "cuda" and torch.cuda.is_bf16_supported():
        return torch.bfloat16
    if device.type == "xpu":
        return torch.bfloat16
    return torch.float32


def autocast_for(device: torch.device, precision: str = "auto"):
    """A context for forward passes: bf16 autocast where `compute_dtype` says bf16, else nothing."""
    if compute_dtype(device, precision) == torch.bfloat16:
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def flops_per_token(cfg: ModelConfig, n_params: int) -> float:
    """Training FLOPs per token: 6·N for the weight matmuls (forward and backward) plus 12·L·d·T for attention
    scores and values (PaLM, arXiv 2204.02311, appendix B).

    Args:
        cfg: the model's shape (L = n_layer, d = d_model, T = seq_len) and arch.
        n_params: all parameters (a tied matrix once). Tables that are only looked up, and so do no matmul,
            are left out of N: the gpt's position embeddings, and an untied llama's input embeddings (a tied
            one is also the output layer, a matmul). Norm gains are counted though they do no matmul
            (d per norm: noise).
    """
    if cfg.arch == "llama":
        n = n_params if cfg.tie_embeddings else n_params - cfg.vocab_size * cfg.d_model
    else:
        n = n_params - cfg.seq_len * cfg.d_model
    return 6.0 * n + 12.0 * cfg.n_layer * cfg.d_model * cfg.seq_len


class EagerFallback:
    """Runs forward passes through a `torch.compile`d model, and through the eager model from the first time
    compiling fails on: torch.compile compiles lazily, at the first call, so a missing C++ compiler or an
    unsupported backend only shows there.

    Args:
        compiled: `torch.compile(model)`.
        eager: the model itself.
        tag: the peer's short id, for the log line.
    """

    def __init__(self, compiled: Callable, eager: torch.nn.Module, tag: str = ""):
        self.compiled, self.eager, self.tag = compiled, eager, tag
        self.failed: str | None = None
        """Why compiling failed (then every call is eager), or None."""

    def __call__(self, *args, **kwargs):
        if self.failed is None:
            try:
                return self.compiled(*args, **kwargs)
            except Exception as e:  # torch's compile stack raises many kinds (BackendCompilerFailed, OSError, ...)
                self.failed = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                logger.warning("[%s] torch.compile failed, training eager instead: %s", self.tag, self.failed)
        return self.eager(*args, **kwargs)


def compile_for_training(model: torch.nn.Module, tag: str = "") -> Callable:
    """What inner steps should call for `run.compile = true`: the model compiled with torch.compile, falling back
    to `model` itself, with a logged warning, where torch.compile is missing or fails (see `EagerFallback`).

    Args:
        model: the model, already on its device.
        tag: the peer's short id, for log lines.
    """
    if not hasattr(torch, "compile"):
        logger.warning("[%s] run.compile: this torch has no torch.compile; training eager", tag)
        return model
    try:
        compiled = torch.compile(model)
    except Exception as e:  # e.g. an unsupported Python version
        logger.warning("[%s] torch.compile failed, training eager instead: %r", tag, e)
        return model
    return EagerFallback(compiled, model, tag)


def peak_flops(device: torch.device, override: float = 0.0) -> float | None:
    """The device's peak FLOP/s for MFU: `override` if > 0, else the known GPU's dense bf16 peak, else None
    (CPUs, Apple and Intel GPUs, and GPUs not in `PEAK_BF16_FLOPS`: MFU is then unknown)."""
    if override > 0:
        return override
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in PEAK_BF16_FLOPS if key in name), None)


def mfu(tokens_per_s: float, flops_per_tok: float, peak: float | None, n_devices: int = 1) -> float | None:
    """Model FLOPs utilization: achieved training FLOP/s ÷ peak FLOP/s of all `n_devices`; None if unknown."""
    if peak is None or peak <= 0:
        return None
    return tokens_per_s * flops_per_tok / (peak * n_devices)


def peak_memory(device: torch.device) -> dict[str, int | None]:
    """Peak resident host memory of this process, and peak memory allocated by torch on `device` (None
    where torch does not track it: CPU, MPS), both in bytes."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    host = rss if sys.platform == "darwin" else rss * 1024  # macOS reports bytes, Linux kilobytes
    dev = None
    if device.type == "cuda":
        dev = int(torch.cuda.max_memory_allocated(device))
    elif device.type == "xpu":
        dev = int(torch.xpu.max_memory_allocated(device))
    return {"peak_host_bytes": int(host), "peak_device_bytes": dev}
