"""SparseLoCo's pseudo-gradient codec (arXiv 2508.15706): per chunk of 4096 values, the top-k by magnitude, each
kept value in 2 bits, its position gap-coded. Pure functions on flat fp32 CPU tensors, like codecs.py.

Per chunk of `chunk` values the `keep` largest |x| are kept (the paper's density is 64 of 4096 = 1.56 %; the
default `codec.sparse_keep` is 48, 1.17 %, which cleared 100× fewer bytes than fp32 in groups of 4); the
rest are dropped, to be sent later through error feedback (feedback.ErrorFeedback). A kept value travels as
2 bits: its sign, and which of the chunk's two magnitudes it takes: the mean |x| of the chunk's kept values
in the lower half by magnitude, and of those in the upper half (a 2-level quantizer per chunk; both bf16).

Positions: sorted within the chunk and sent as gaps (the number of dropped values before each kept one),
Rice-coded with parameter r (Golomb 1966, Rice 1979): the low r bits of each gap in one bit field, the high
part in unary in another, so that both decode with array operations. A gap of a density-p selection is about
geometric with mean 1/p, and Rice coding spends ~log2(e/p) + 0.5 bits on it: ~8 bits at 1.56 %, against 12
for a raw index into 4096. With the 2 value bits and the scales that is ~0.16 bits a value, ~190× fewer than
fp32 (the paper's 12-bit indices: 146×).

Layout: u32 little-endian unary bit count U; scales (2 × bf16 a chunk: low, high magnitude); sign and
magnitude bits (2 a kept value); the low r bits of each gap; the unary field (U bits). Bit fields are packed
big-endian (numpy.packbits), each padded to a whole byte. The size depends on the positions, so receivers
check it against `encoded_size`, an upper bound, and `decode` checks every field before it is trusted.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from p2pdiloco.algorithm.codecs import Codec, CodecError, NonFiniteError

CHUNK = 4096
KEEP = 64
"""Values kept per chunk of 4096: 1.56 %, the paper's density (SparseLoCo, Table 1)."""


def rice_parameter(chunk: int, keep: int) -> int:
    """Rice parameter for gaps of `keep` positions out of `chunk`: log2 of ln 2 × the mean gap (Gallager and
    van Voorhis 1975: the best Golomb parameter of a geometric source is about ln 2 × its mean)."""
    mean_gap = max(chunk - keep, 0) / max(keep, 1)
    return max(0, int(math.floor(math.log2(max(1.0, mean_gap * math.log(2))))))


def _pack(bits: np.ndarray) -> bytes:
    return np.packbits(bits.astype(np.uint8)).tobytes()


def _unpack(data: memoryview, count: int) -> np.ndarray:
    return np.unpackbits(np.frombuffer(data, dtype=np.uint8), count=count) if count else np.zeros(0, np.uint8)


def _bits_of(values: np.ndarray, width: int) -> np.ndarray:
    """Each value's low `width` bits, most significant first, flattened."""
    if width == 0:
        return np.zeros(0, np.uint8)
    shifts = np.arange(width - 1, -1, -1, dtype=np.int64)
    return ((values[:, None] >> shifts[None, :]) & 1).astype(np.uint8).reshape(-1)


def _from_bits(bits: np.ndarray, width: int, count: int) -> np.ndarray:
    """`count` values of `width` bits each, most significant first (inverse of `_bits_of`)."""
    if width == 0:
        return np.zeros(count, np.int64)
    weights = (1 << np.arange(width - 1, -1, -1, dtype=np.int64))
    return (bits.reshape(-1, width).astype(np.int64) * weights).sum(axis=1)


def rice_encode(gaps: np.ndarray, r: int) -> tuple[np.ndarray, np.ndarray]:
    """Gaps (non-negative ints) as (low r bits of each, unary high parts: q ones then a zero for each)."""
    q = gaps >> r
    unary = np.ones(int(q.sum()) + len(gaps), np.uint8)
    unary[np.cumsum(q + 1) - 1] = 0  # each gap's terminating zero
    return _bits_of(gaps & ((1 << r) - 1), r), unary


def rice_decode(low_bits: np.ndarray, unary: np.ndarray, count: int, r: int) -> np.ndarray:
    """The `count` gaps coded by `rice_encode`; raises CodecError if the unary field does not hold exactly
    `count` terminated values."""
    zeros = np.flatnonzero(unary == 0)
    if len(zeros) != count or (count and zeros[-1] != len(unary) - 1):
        raise CodecError(f"sparseloco: unary field holds {len(zeros)} terminated gaps, expected {count}")
    q = np.diff(zeros, prepend=-1) - 1
    return (q.astype(np.int64) << r) | _from_bits(low_bits, r, count)


@dataclass(frozen=True)
class SparseCodec(Codec):
    """Chunked top-k, 2-bit values, Rice-coded positions (see the module docstring).

    Args:
        chunk: values per chunk (4096 in the paper).
        keep: values kept per chunk (the last, shorter chunk keeps at most its length).
    """

    name: str = "sparseloco"
    chunk: int = CHUNK
    keep: int = KEEP

    @property
    def lossy(self) -> bool:
        return True

    @property
    def exact_size(self) -> bool:
        """False: `encoded_size` bounds the bytes, the positions decide them."""
        return False

    @property
    def sliced(self) -> bool:
        return False  # parts are all-gathered: an average of sparse parts is as dense as their union

    @property
    def rice(self) -> int:
        return rice_parameter(self.chunk, self.keep)

    def counts(self, n: int) -> list[int]:
        """Values kept in each chunk of a vector of n values."""
        chunks = math.ceil(n / self.chunk)
        last = n - (chunks - 1) * self.chunk if chunks else 0
        return [min(self.keep, self.chunk)] * (chunks - 1) + ([min(self.keep, last)] if chunks else [])

    def _fixed_size(self, n: int) -> int:
        counts = self.counts(n)
        kept = sum(counts)
        return 4 + 4 * len(counts) + (2 * kept + 7) // 8 + (self.rice * kept + 7) // 8

    def _max_unary_bits(self, n: int) -> int:
        counts = self.counts(n)
        lengths = [self.chunk] * (len(counts) - 1) + [n - (len(counts) - 1) * self.chunk] if counts else []
        # the gaps of one chunk sum to at most (its length − kept), so their high parts to at most that >> r
        return sum(k + ((length - k) >> self.rice) for k, length in zip(counts, lengths, strict=True))

    def encoded_size(self, n: int) -> int:
        """Most bytes `encode` produces for n values (positions that leave every gap large make the most)."""
        return self._fixed_size(n) + (self._max_unary_bits(n) + 7) // 8

    def select(self, x: torch.Tensor) -> torch.Tensor:
        """Positions within the chunk of each chunk's `keep` largest |x|, largest first: shape (chunks, keep). The
        last chunk is padded with -1s, so a padding position is picked only where it holds fewer than `keep`
        values (`encode` drops those)."""
        n, c = x.numel(), self.chunk
        chunks = math.ceil(n / c)
        mags = torch.nn.functional.pad(x.abs(), (0, chunks * c - n), value=-1.0).reshape(chunks, c)
        mags = torch.nan_to_num(mags, nan=float("inf"))  # a NaN is sent (and refused by the guards), never hidden
        return mags.topk(min(self.keep, c), dim=1, sorted=True).indices

    def encode(self, x: torch.Tensor) -> bytes:
        x = x.detach().float().contiguous().cpu().reshape(-1)
        n = x.numel()
        if n == 0:
            return (0).to_bytes(4, "little")
        counts = self.counts(n)
        by_size = self.select(x)
        rank = torch.arange(by_size.shape[1]).expand_as(by_size)
        high = rank < torch.tensor(counts)[:, None] // 2  # the upper half by magnitude takes the high scale
        positions, order = by_size.sort(dim=1)
        high = high.gather(1, order)
        flat = positions + torch.arange(len(counts))[:, None] * self.chunk
        valid = flat < n  # the last chunk's padding, never among the chunk's real values if it has enough
        values = torch.where(valid, x[flat.clamp(max=n - 1)], torch.zeros(()))
        mags = values.abs()
        scales = _two_scales(mags, valid & ~high, valid & high)
        scales = scales.to(torch.bfloat16)
        sign = (values < 0).numpy()[valid.numpy()]
        high_bit = high.numpy()[valid.numpy()]
        kept_positions = positions.numpy()[valid.numpy()].astype(np.int64)
        starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
        previous = np.empty_like(kept_positions)
        previous[1:] = kept_positions[:-1]
        previous[starts] = -1  # a chunk's first gap counts from its start
        gaps = kept_positions - previous - 1
        low, unary = rice_encode(gaps, self.rice)
        value_bits = np.stack([sign, high_bit], axis=1).reshape(-1)
        return (len(unary).to_bytes(4, "little") + scales.view(torch.int16).numpy().tobytes() + _pack(value_bits)
                + _pack(low) + _pack(unary))

    def decode(self, data: bytes | memoryview, n: int) -> torch.Tensor:
        data = memoryview(bytes(data))
        if n < 0 or len(data) < 4:
            raise CodecError(f"sparseloco: {len(data)} bytes cannot hold {n} values")
        if n == 0:
            if len(data) != 4:
                raise CodecError("sparseloco: bytes beyond an empty vector")
            return torch.empty(0)
        counts, r = self.counts(n), self.rice
        kept, fixed = sum(counts), self._fixed_size(n)
        unary_bits = int.from_bytes(data[:4], "little")
        if not kept <= unary_bits <= self._max_unary_bits(n) or len(data) != fixed + (unary_bits + 7) // 8:
            raise CodecError(f"sparseloco: {len(data)} bytes ({unary_bits} unary bits) cannot hold {n} values")
        at = 4
        scales_raw = np.frombuffer(data[at:at + 4 * len(counts)], dtype=np.int16).copy()
        scales = torch.from_numpy(scales_raw).view(torch.bfloat16).float().reshape(-1, 2)
        at += 4 * len(counts)
        if not torch.isfinite(scales).all():
            raise NonFiniteError("sparseloco: non-finite chunk scale")
        value_bits = _unpack(data[at:at + (2 * kept + 7) // 8], 2 * kept).reshape(-1, 2)
        at += (2 * kept + 7) // 8
        low = _unpack(data[at:at + (r * kept + 7) // 8], r * kept)
        at += (r * kept + 7) // 8
        gaps = rice_decode(low, _unpack(data[at:], unary_bits), kept, r)
        chunk_of = np.repeat(np.arange(len(counts)), counts)
        steps = np.cumsum(gaps + 1)
        starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
        before = np.where(starts > 0, steps[np.maximum(starts - 1, 0)], 0)
        positions = steps - np.repeat(before, counts) - 1  # within the chunk
        lengths = np.minimum(self.chunk, n - np.arange(len(counts)) * self.chunk)
        if (positions >= np.repeat(lengths, counts)).any():
            raise CodecError("sparseloco: a position beyond its chunk")
        flat = torch.from_numpy(chunk_of * self.chunk + positions)
        bits = torch.from_numpy(value_bits.astype(np.int64))
        chunk_t = torch.from_numpy(chunk_of)
        values = scales[chunk_t, bits[:, 1]] * (1 - 2 * bits[:, 0]).float()
        out = torch.zeros(n)
        out[flat] = values
        return out

    def error_bound(self, x: torch.Tensor) -> torch.Tensor:
        """A dropped value errs by |x|, a kept one by at most the chunk's largest |x| (same sign, both magnitudes
        at most that; bf16 rounding of a scale adds 2^-8 of it)."""
        x = x.detach().float().reshape(-1)
        if x.numel() == 0:
            return x.clone()
        chunks = math.ceil(x.numel() / self.chunk)
        absmax = torch.nn.functional.pad(x.abs(), (0, chunks * self.chunk - x.numel())).reshape(chunks, -1).amax(1)
        return (absmax * (1 + 2.0**-7) + 1e-30).repeat_interleave(self.chunk)[: x.numel()]


def _two_scales(mags: torch.Tensor, low: torch.Tensor, high: torch.Tensor) -> torch.Tensor:
    """Each chunk's (low, high) magnitude: the mean |x| of its kept values in each half. A chunk keeping one value
    has no lower half: both scales are that value's. Non-finite values stay non-finite (the guards refuse them)."""
    def mean(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        count = mask.sum(dim=1)
        return torch.where(mask, mags, torch.zeros(())).sum(dim=1) / count.clamp(min=1), count

    lo, n_lo = mean(low)
    hi, n_hi = mean(high)
    return torch.stack([torch.where(n_lo > 0, lo, hi), torch.where(n_hi > 0, hi, lo)], dim=1)
