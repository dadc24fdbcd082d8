"""A float32 vector as its exact difference from another one both sides hold: lossless, and small where they are close.

A member outside its group's majority fetches the majority's global model (network/catch_up.py), and must end on
its bits exactly: the digest it checks is of those bits. Sent as fp32 that is 4 bytes a value (8 a parameter, with
the momentum). But the fetcher and the holder usually hold a recent common state (an anchor: the group's model one
merge back, before the fetcher merged alone), and the majority's model is a few outer steps from it.

The difference is taken on the bit patterns, as 32-bit integers modulo 2³² (so it is exact whatever the values,
NaNs and infinities included, and adding it back gives the same bits): two floats of one sign and close magnitude
have close patterns, so a small step is a small integer. Zigzag (0, -1, 1, -2, ... -> 0, 1, 2, 3, ...) makes small
negative ones small too; the four bytes of each are split into four planes (the high planes are then mostly zero,
the low ones carry the mantissa's noise) and the whole deflated. Nothing in it is lossy: the bytes decode to the
target's bits or to nothing.
"""

from __future__ import annotations

import zlib

import numpy as np
import torch

from p2pdiloco.algorithm.codecs import CodecError

LEVEL = 1
"""zlib level: on these planes level 6 saved a few percent more for several times the CPU."""


def encoded_bound(n: int) -> int:
    """The most bytes the encoding of `n` values may take and still be worth sending (fp32's own size)."""
    return 4 * n


def encode_exact_delta(target: torch.Tensor, base: torch.Tensor) -> bytes:
    """`target`'s bits as their difference from `base`'s (both flat float32 of one length), deflated byte planes."""
    t = _bits(target)
    b = _bits(base)
    if t.shape != b.shape:
        raise ValueError(f"target has {t.size} values, base {b.size}")
    s = (t - b).view(np.int32)  # modulo 2**32: exact whatever the values
    z = ((s << 1) ^ (s >> 31)).view(np.uint32)  # zigzag
    planes = np.ascontiguousarray(z.view(np.uint8).reshape(-1, 4).T)
    return zlib.compress(planes.tobytes(), LEVEL)


def decode_exact_delta(data: bytes | memoryview, base: torch.Tensor) -> torch.Tensor:
    """The float32 vector whose encoded difference from `base` is `data` (bit for bit what was encoded).

    Raises:
        CodecError: `data` is larger than fp32 would be, is not deflate, or does not inflate to exactly 4 bytes a
            value of `base` (it never inflates past that: a crafted payload cannot balloon).
    """
    b = _bits(base)
    n = b.size
    if len(data) > encoded_bound(n):
        raise CodecError(f"exact delta: {len(data)} bytes is more than fp32 of {n} values")
    d = zlib.decompressobj()
    try:
        raw = d.decompress(bytes(data), 4 * n + 1)
    except zlib.error as e:
        raise CodecError(f"exact delta: {e}") from None
    if len(raw) != 4 * n or not d.eof or d.unused_data:
        raise CodecError(f"exact delta: does not inflate to {4 * n} bytes")
    z = np.ascontiguousarray(np.frombuffer(raw, dtype=np.uint8).reshape(4, n).T).view(np.uint32).reshape(-1)
    s = (z >> 1) ^ (np.uint32(0) - (z & 1))  # undo the zigzag
    return torch.from_numpy((b + s).view(np.float32).copy())


def _bits(x: torch.Tensor) -> np.ndarray:
    """The bit patterns of a flat float32 tensor, as uint32 (a copy on CPU only where it is not one already)."""
    if x.dtype != torch.float32:
        raise ValueError(f"exact delta takes float32, not {x.dtype}")
    return x.detach().cpu().contiguous().reshape(-1).numpy().view(np.uint32)
