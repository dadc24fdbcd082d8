"""Compression of merge payloads, with error feedback: pure functions on flat fp32 CPU tensors.

A codec turns a slice of a pseudo-gradient into bytes and back. Every codec here is deterministic: the same
input gives the same bytes, and the same bytes decode to the same tensor on every machine, so members of a
merge group that decode one averaged slice hold the same bits.

| codec | bits/value | per-element error bound |
|---|---|---|
| none | 32 | 0 |
| fp16 | 16 | 2^-11·|x| (values clamped to ±65504) |
| bf16 | 16 | 2^-8·|x| |
| int8 | 8 + 32/4096 | absmax of the 4096-value block × half the widest gap of bitsandbytes' dynamic map |
| int4 | 4 + 32/128 | absmax of the 128-value block × half the widest gap of the NF4 map |
| sparseloco | ~0.12 (top 48 of 4096 by default, 2 bits + ~8 position bits each) | chunk absmax (sparse.py) |

Error feedback (1-bit SGD, Seide et al. 2014; EF-SGD, Karimireddy et al. 2019; INTELLECT-1 uses it with
int8): what a round's quantization dropped is added to the next round's pseudo-gradient, so the error does
not accumulate over rounds: the sum of what was sent tracks the sum of the true pseudo-gradients to within
one round's error.
"""

from __future__ import annotations

import logging
import math
import zlib
from dataclasses import dataclass, field

import torch

from p2pdiloco.algorithm.names import CODECS

logger = logging.getLogger(__name__)

FP16_MAX = 65504.0


class CodecError(ValueError):
    """Bytes that cannot be decoded as the expected number of values."""


class NonFiniteError(CodecError):
    """Bytes that decode, but to a non-finite block scale (the sender quantized NaN or inf)."""


def _from_bytes(data: bytes | bytearray | memoryview, dtype: torch.dtype, count: int) -> torch.Tensor:
    if count == 0:
        return torch.empty(0, dtype=dtype)
    return torch.frombuffer(bytearray(data), dtype=dtype, count=count)


def _in_blocks(x: torch.Tensor, size: int) -> torch.Tensor:
    """A flat tensor as rows of `size` values, the last row padded with zeros (blockwise codecs' layout)."""
    return torch.nn.functional.pad(x, (0, math.ceil(x.numel() / size) * size - x.numel())).reshape(-1, size)


@dataclass(frozen=True)
class Codec:
    """Lossless fp32: the bytes of the tensor as they are."""

    name: str = "none"

    @property
    def lossy(self) -> bool:
        return False

    @property
    def exact_size(self) -> bool:
        """`encoded_size` is the exact size (True), or only a bound (sparse codecs, whose size varies)."""
        return True

    @property
    def sliced(self) -> bool:
        """Averaged slice by slice (allreduce.py); False: whole parts are all-gathered (sparse_exchange.py)."""
        return True

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
    """Blockwise quantization in plain torch: one fp32 absmax per block, then the index of the code nearest to
    each value ÷ absmax, in bitsandbytes' 8-bit dynamic map (int8) or the NF4 map (int4, two codes a byte, the
    first in the high nibble). Layout: absmax (fp32 × blocks), then the codes.

    The maps are bitsandbytes' numbers, computed here so that a peer need not import bitsandbytes (which pulls in
    torch._dynamo: seconds of every peer's start-up) for a few lines of arithmetic. Each value takes the nearest
    code (bitsandbytes' CPU kernel sometimes picks the second nearest).
    """

    name: str = "int8"

    @property
    def lossy(self) -> bool:
        return True

    @property
    def blocksize(self) -> int:
        return 4096 if self.name == "int8" else 128

    @property
    def code(self) -> torch.Tensor:
        return DYNAMIC_MAP if self.name == "int8" else NF4_MAP

    def _blocks(self, n: int) -> int:
        return math.ceil(n / self.blocksize)

    def _code_bytes(self, n: int) -> int:
        return n if self.name == "int8" else (n + 1) // 2

    def encoded_size(self, n: int) -> int:
        return 4 * self._blocks(n) + self._code_bytes(n)

    def encode(self, x: torch.Tensor) -> bytes:
        x = x.detach().float().contiguous().cpu().reshape(-1)
        n = x.numel()
        if n == 0:
            return b""
        padded = _in_blocks(x, self.blocksize)
        absmax = padded.abs().amax(dim=1)
        scale = torch.where(absmax > 0, absmax, torch.ones_like(absmax))  # an all-zero block codes as zeros
        code = self.code
        codes = torch.bucketize(padded / scale[:, None], (code[1:] + code[:-1]) / 2).to(torch.uint8).reshape(-1)[:n]
        if self.name == "int4":
            if n % 2:
                codes = torch.cat([codes, codes.new_zeros(1)])
            codes = (codes[0::2] << 4) | codes[1::2]
        return absmax.numpy().tobytes() + codes.numpy().tobytes()

    def decode(self, data: bytes | memoryview, n: int) -> torch.Tensor:
        self._check(data, n)
        if n == 0:
            return torch.empty(0)
        blocks = self._blocks(n)
        absmax = _from_bytes(memoryview(data)[: 4 * blocks], torch.float32, blocks)
        codes = _from_bytes(memoryview(data)[4 * blocks:], torch.uint8, self._code_bytes(n))
        if not torch.isfinite(absmax).all():
            raise NonFiniteError(f"{self.name}: non-finite block scale")
        if self.name == "int4":
            codes = torch.stack([codes >> 4, codes & 15], dim=1).reshape(-1)[:n]
        values = self.code[codes.long()]
        return values * absmax.repeat_interleave(self.blocksize)[:n]

    def error_bound(self, x: torch.Tensor) -> torch.Tensor:
        x = x.detach().float().reshape(-1)
        if x.numel() == 0:
            return x.clone()
        absmax = _in_blocks(x.abs(), self.blocksize).amax(dim=1)
        half_gap = torch.diff(self.code).max() / 2
        # the nearest code is picked; the slack covers fp32 rounding of x ÷ absmax and of code × absmax
        return (absmax * (half_gap * (1 + 1e-5)) + 1e-30).repeat_interleave(self.blocksize)[: x.numel()]


@dataclass(frozen=True)
class LinearInt8Codec(Codec):
    """int8 on a linear grid: per block of 256 values one fp32 scale (absmax ÷ 127) and round(x ÷ scale); every
    value is off by at most absmax ÷ 254 of its block. For (θg, momentum) and their differences in agreements
    (p2p_merger.py), where no error feedback follows and each member encodes and decodes every part of its slice:
    far less CPU to encode than the dynamic map's nearest code (a bucketize over 256 codes), whose CPU would slow
    agreements where many peers share few cores (docs/experiments.md, "Agreements"), and a smaller worst error
    (1/254 of a 256-value block against 0.007 of a 4096-value one); the dynamic map's finer
    steps near zero are what a pseudo-gradient's few large values need, not a state."""

    name: str = "int8-linear"
    BLOCK = 256

    @property
    def lossy(self) -> bool:
        return True

    def encoded_size(self, n: int) -> int:
        return 4 * math.ceil(n / self.BLOCK) + n

    def encode(self, x: torch.Tensor) -> bytes:
        x = x.detach().float().contiguous().cpu().reshape(-1)
        n = x.numel()
        padded = _in_blocks(x, self.BLOCK)
        scale = padded.abs().amax(dim=1) / 127
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero block codes as zeros
        codes = torch.round(padded / safe[:, None]).clamp(-127, 127).to(torch.int8).reshape(-1)[:n]
        return scale.numpy().tobytes() + codes.numpy().tobytes()

    def decode(self, data: bytes | memoryview, n: int) -> torch.Tensor:
        self._check(data, n)
        blocks = math.ceil(n / self.BLOCK)
        scale = _from_bytes(memoryview(data)[: 4 * blocks], torch.float32, blocks)
        if not torch.isfinite(scale).all():
            raise NonFiniteError(f"{self.name}: non-finite block scale")
        codes = _from_bytes(memoryview(data)[4 * blocks:], torch.int8, n)
        return codes.float() * scale.repeat_interleave(self.BLOCK)[:n]

    def error_bound(self, x: torch.Tensor) -> torch.Tensor:
        x = x.detach().float().reshape(-1)
        absmax = _in_blocks(x.abs(), self.BLOCK).amax(dim=1)
        return (absmax / 254 * (1 + 1e-5) + 1e-30).repeat_interleave(self.BLOCK)[: x.numel()]


def _dynamic_map(max_exponent_bits: int = 7, total_bits: int = 8) -> torch.Tensor:
    """bitsandbytes' signed 8-bit dynamic map (`create_dynamic_map`, Dettmers 2016): for each exponent 10^-6 … 10^0
    the midpoints of a linear grid over [0.1, 1], both signs, then 0 and 1; 256 values, sorted."""
    data: list[float] = []
    non_sign_bits = total_bits - 1
    for i in range(max_exponent_bits):
        boundaries = torch.linspace(0.1, 1, 2 ** (i + non_sign_bits - max_exponent_bits) + 1, dtype=torch.float32)
        means = (boundaries[:-1] + boundaries[1:]) / 2.0
        scale = 10 ** (-(max_exponent_bits - 1) + i)
        data += (scale * means).tolist() + (-scale * means).tolist()  # fp32 products, as bitsandbytes computes them
    data += [0.0, 1.0]
    assert len(data) == 2**total_bits
    return torch.tensor(sorted(data), dtype=torch.float32)


DYNAMIC_MAP = _dynamic_map()
NF4_MAP = torch.tensor([
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
    -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
    0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
], dtype=torch.float32)
"""NormalFloat4 (QLoRA, Dettmers et al. 2023): quantiles of a standard normal scaled to [−1, 1], as bitsandbytes
ships them."""


@dataclass(frozen=True)
class DeflatedCodec(Codec):
    """Another codec's bytes, deflated (zlib level 1): for vectors that are mostly zero, such as the differences
    of members' global models from an anchor after sparse updates (p2p_merger.py, tag 'a'). Its size is only
    bounded; decoding never inflates past the inner codec's exact size, so a crafted payload cannot balloon."""

    name: str = "int8+deflate"
    inner: Codec = field(default_factory=lambda: BlockwiseCodec("int8"))

    @property
    def lossy(self) -> bool:
        return self.inner.lossy

    @property
    def exact_size(self) -> bool:
        return False

    def encoded_size(self, n: int) -> int:
        raw = self.inner.encoded_size(n)
        return raw + raw // 1000 + 64  # deflate's worst case on incompressible bytes, with slack

    def encode(self, x: torch.Tensor) -> bytes:
        return zlib.compress(self.inner.encode(x), 1)

    def decode(self, data: bytes | memoryview, n: int) -> torch.Tensor:
        raw_size = self.inner.encoded_size(n)
        if n < 0 or len(data) > self.encoded_size(n):
            raise CodecError(f"{self.name}: {len(data)} bytes is more than {n} values can take")
        d = zlib.decompressobj()
        try:
            raw = d.decompress(bytes(data), raw_size + 1)
        except zlib.error as e:
            raise CodecError(f"{self.name}: {e}") from None
        if len(raw) != raw_size or not d.eof or d.unused_data:
            raise CodecError(f"{self.name}: does not inflate to {raw_size} bytes")
        return self.inner.decode(raw, n)

    def error_bound(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner.error_bound(x)


def get_codec(name: str, sparse_keep: int = 64) -> Codec:
    """The codec called `name` (one of `CODECS`); `sparse_keep`: values sparseloco keeps per chunk of 4096."""
    if name == "none":
        return Codec()
    if name in ("fp16", "bf16"):
        return HalfCodec(name)
    if name in ("int8", "int4"):
        return BlockwiseCodec(name)
    if name == "sparseloco":
        from p2pdiloco.algorithm.sparse import SparseCodec  # it imports this module

        return SparseCodec(keep=sparse_keep)
    raise ValueError(f"unknown codec {name!r} (known: {', '.join(CODECS)})")


def as_held(part: torch.Tensor, exact: torch.Tensor, held: torch.Tensor, share: float, n_members: int) -> torch.Tensor:
    """A slice owner's own part as the average the group holds counts it, for error feedback.

    The owner averages its slice exactly (its own part exact, the others' decoded), then sends that average through
    the codec, and every member (the owner too) holds the decoded copy: the average's rounding, exact − held, is
    lost to the whole group. Owner-side error feedback (as in Tang et al.'s DoubleSqueeze, arXiv 1905.05957,
    and 1-bit Adam's server error, 2102.02888) keeps it: the loss is charged to the owner's part, so that the
    owner's residual (its target less this) holds it and its next part brings it back into a later average
    through that part's share.

    Args:
        part: the owner's own part of the slice, as it entered the average (exact).
        exact: the owner's average of the slice before the codec.
        held: that average as every member decodes it.
        share: the owner's share of the average (0: its part was left out, nothing is charged).
        n_members: the group's size: the share is taken as at least 1/n_members, so that a member with a small
            share is not charged many times the rounding (the rest of the rounding is then lost, as before).

    Returns:
        part − (exact − held) / max(share, 1/n_members): weighted by `share`, what the held average took of it.
    """
    if share <= 0 or exact.shape != part.shape or held.shape != part.shape:
        return part
    return part - (exact - held) / max(share, 1.0 / n_members)
