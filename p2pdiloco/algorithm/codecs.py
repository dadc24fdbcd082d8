"""Compression of merge payloads, with error feedback: pure functions on flat fp32 CPU tensors.

A codec turns a slice of a pseudo-gradient into bytes and back. Every codec here is deterministic: the same
input gives the same bytes, and the same bytes decode to the same tensor on every machine, so members of a
merge group that decode one averaged slice hold the same bits.

| codec | bits/value | per-element error bound |
|---|---|---|
| none | 32 | 0 |
| fp16 | 16 | 2^-11·|x| (values clamped to ±65504) |
| bf16 | 16 | 2^-8·|x| |
| int8 | 8 + 32/4096 | absmax of the 4096-value block × half the widest gap of bitsandbytes' dynamic map (+1%) |
| int4 | 4 + 32/128 | absmax of the 128-value block × half the widest gap of the NF4 map |

Error feedback (1-bit SGD, Seide et al. 2014; EF-SGD, Karimireddy et al. 2019; INTELLECT-1 uses it with
int8): what a round's quantization dropped is added to the next round's pseudo-gradient, so the error does
not accumulate over rounds: the sum of what was sent tracks the sum of the true pseudo-gradients to within
one round's error.
"""

from __future__ import annotations

import contextlib
import io
import logging
import math
from dataclasses import dataclass

import torch

from p2pdiloco.algorithm.names import CODECS

logger = logging.getLogger(__name__)

FP16_MAX = 65504.0


class CodecError(ValueError):
    """Bytes that cannot be decoded as the expected number of values."""


class NonFiniteError(CodecError):
    """Bytes that decode, but to a non-finite block scale (the sender quantized NaN or inf)."""


def _bnb_functional():
    # bitsandbytes prints a warning about CPU 4-bit gemm kernels on import; it is harmless for quantization.
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        import bitsandbytes.functional as F
    return F


def _from_bytes(data: bytes | bytearray | memoryview, dtype: torch.dtype, count: int) -> torch.Tensor:
    if count == 0:
        return torch.empty(0, dtype=dtype)
    return torch.frombuffer(bytearray(data), dtype=dtype, count=count)


@dataclass(frozen=True)
class Codec:
    """Lossless fp32: the bytes of the tensor as they are."""

    name: str = "none"

    @property
    def lossy(self) -> bool:
        return False

    def encoded_size(self, n: int) -> int:
        """Exact number of bytes `encode` produces for `n` values (receivers check it before decoding)."""
        return 4 * n

    def encode(self, x: torch.Tensor) -> bytes:
        return x.detach().float().contiguous().cpu().numpy().tobytes()

    def decode(self, data: bytes | memoryview, n: int) -> torch.Tensor:
        self._check(data, n)
        return _from_bytes(data, torch.float32, n)

    def error_bound(self, x: torch.Tensor) -> torch.Tensor:
        """Largest |x − decode(encode(x))| per element that this codec allows."""
        return torch.zeros_like(x)

    def _check(self, data: bytes | memoryview, n: int) -> None:
        if n < 0 or len(data) != self.encoded_size(n):
            raise CodecError(f"{self.name}: {len(data)} bytes cannot hold {n} values ({self.encoded_size(n)} expected)")


@dataclass(frozen=True)
class HalfCodec(Codec):
    """fp16 or bf16: round to nearest, half the bytes."""

    name: str = "fp16"

    @property
    def lossy(self) -> bool:
        return True

    @property
    def dtype(self) -> torch.dtype:
        return torch.float16 if self.name == "fp16" else torch.bfloat16

    def encoded_size(self, n: int) -> int:
        return 2 * n

    def encode(self, x: torch.Tensor) -> bytes:
        x = x.detach().float().contiguous().cpu()
        if self.name == "fp16":
            x = x.clamp(-FP16_MAX, FP16_MAX)  # beyond ±65504 fp16 holds only inf
        return x.to(self.dtype).view(torch.int16).numpy().tobytes()

    def decode(self, data: bytes | memoryview, n: int) -> torch.Tensor:
        self._check(data, n)
        return _from_bytes(data, torch.int16, n).view(self.dtype).float()

    def error_bound(self, x: torch.Tensor) -> torch.Tensor:
        mantissa_bits = 10 if self.name == "fp16" else 7
        rel = x.abs() * 2.0 ** -(mantissa_bits + 1)
        if self.name == "fp16":  # subnormals: absolute spacing 2^-24; and clamping beyond the largest value
            rel = rel + 2.0**-25 + (x.abs() - FP16_MAX).clamp(min=0)
        return rel


@dataclass(frozen=True)
class BlockwiseCodec(Codec):
    """bitsandbytes blockwise quantization: one fp32 absmax per block, then 8-bit (dynamic map) or 4-bit
    (NF4) codes of the values divided by it. Layout: absmax (fp32 × blocks), then the codes."""

    name: str = "int8"

    @property
    def lossy(self) -> bool:
        return True

    @property
    def blocksize(self) -> int:
        return 4096 if self.name == "int8" else 128

    def _blocks(self, n: int) -> int:
        return math.ceil(n / self.blocksize)

    def _code_bytes(self, n: int) -> int:
        return n if self.name == "int8" else (n + 1) // 2

    def encoded_size(self, n: int) -> int:
        return 4 * self._blocks(n) + self._code_bytes(n)

    def encode(self, x: torch.Tensor) -> bytes:
        x = x.detach().float().contiguous().cpu()
        if x.numel() == 0:
            return b""
        F = _bnb_functional()
        if self.name == "int8":
            codes, state = F.quantize_blockwise(x, blocksize=self.blocksize)
        else:
            codes, state = F.quantize_4bit(x, blocksize=self.blocksize, quant_type="nf4")
        absmax = state.absmax.float().contiguous()
        return absmax.numpy().tobytes() + codes.contiguous().view(torch.uint8).numpy().tobytes()

    def decode(self, data: bytes | memoryview, n: int) -> torch.Tensor:
        self._check(data, n)
        if n == 0:
            return torch.empty(0)
        F = _bnb_functional()
        blocks = self._blocks(n)
        absmax = _from_bytes(memoryview(data)[: 4 * blocks], torch.float32, blocks)
        codes = _from_bytes(memoryview(data)[4 * blocks:], torch.uint8, self._code_bytes(n))
        if not torch.isfinite(absmax).all():
            raise NonFiniteError(f"{self.name}: non-finite block scale")
        if self.name == "int8":
            state = F.QuantState(absmax=absmax, code=_dynamic_map(), blocksize=self.blocksize,
                                 shape=torch.Size([n]), dtype=torch.float32)
            return F.dequantize_blockwise(codes, state).float()
        state = F.QuantState(absmax=absmax, shape=torch.Size([n]), code=_nf4_map(), blocksize=self.blocksize,
                             quant_type="nf4", dtype=torch.float32)
        return F.dequantize_4bit(codes.view(-1, 1), state).float().reshape(n)

    def error_bound(self, x: torch.Tensor) -> torch.Tensor:
        x = x.detach().float().reshape(-1)
        if x.numel() == 0:
            return x.clone()
        pad = self._blocks(x.numel()) * self.blocksize - x.numel()
        absmax = torch.nn.functional.pad(x.abs(), (0, pad)).reshape(-1, self.blocksize).amax(dim=1)
        code = _dynamic_map() if self.name == "int8" else _nf4_map()
        half_gap = torch.diff(code.sort().values).max() / 2
        # bitsandbytes' CPU quantizer does not always pick the nearest code: measured up to 0.2% past the
        # half gap on Gaussian data; 1% of slack keeps the bound honest without hiding a real regression
        return (absmax * (half_gap * 1.01) + 1e-30).repeat_interleave(self.blocksize)[: x.numel()]


_MAPS: dict[str, torch.Tensor] = {}


def _dynamic_map() -> torch.Tensor:
    if "int8" not in _MAPS:
        _MAPS["int8"] = _bnb_functional().create_dynamic_map().float()
    return _MAPS["int8"]


def _nf4_map() -> torch.Tensor:
    if "int4" not in _MAPS:
        _, state = _bnb_functional().quantize_4bit(torch.zeros(64), blocksize=64, quant_type="nf4")
        _MAPS["int4"] = state.code.float().clone()
    return _MAPS["int4"]


def get_codec(name: str) -> Codec:
    """The codec called `name` (one of `CODECS`)."""
    if name == "none":
        return Codec()
    if name in ("fp16", "bf16"):
        return HalfCodec(name)
    if name in ("int8", "int4"):
        return BlockwiseCodec(name)
    raise ValueError(f"unknown codec {name!r} (known: {', '.join(CODECS)})")


def warm_up(codec: Codec) -> None:
    """Load what the codec needs (bitsandbytes takes seconds to import on a busy machine) before a merge
    needs it, so that the first merge is not the one that pays for it and times out."""
    roundtrip(codec, torch.zeros(256))


def roundtrip(codec: Codec, x: torch.Tensor) -> tuple[bytes, torch.Tensor]:
    """(bytes sent, what the receiver will decode from them)."""
    data = codec.encode(x)
    return data, codec.decode(data, x.numel())


class ErrorFeedback:
    """The residual of past rounds' quantization, added to the next pseudo-gradient.

    Usage per round: ``target = ef.compensate(delta)``; send ``q = Q(target)``; if the merge that sent it
    is applied, ``ef.commit(target, q)`` (residual ← target − q); if it failed, nothing was sent and the
    residual stays as it was.

    Args:
        enabled: with False, `compensate` returns Δ unchanged and the residual stays zero.
    """

    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self.residual: torch.Tensor | None = None

    def compensate(self, pseudo_grad: torch.Tensor) -> torch.Tensor:
        if not self.enabled or self.residual is None or self.residual.shape != pseudo_grad.shape:
            return pseudo_grad
        return pseudo_grad + self.residual

    def commit(self, target: torch.Tensor, transmitted: torch.Tensor) -> None:
        if self.enabled:
            residual = (target - transmitted).float()
            # a non-finite pseudo-gradient (a broken accelerator) must not poison every later round
            self.residual = residual if torch.isfinite(residual).all() else None

    def norm(self) -> float:
        return float(self.residual.norm()) if self.residual is not None else 0.0
