"""Hostile peers on demand (`p2pdiloco local --hostile INDEX:KIND`, config field emulate.hostile).

A hostile peer runs the ordinary code but corrupts its own pseudo-gradient before it offers it to a merge,
as a broken accelerator or a peer with bad intent would. It changes nothing in other peers' processes:
what they see is only what it sends.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future

import torch

from p2pdiloco.config import HOSTILE_KINDS as KINDS
from p2pdiloco.network.merger import Contribution, Merger, MergeResult

logger = logging.getLogger(__name__)

SCALE = 1000.0
"""The `scale` kind multiplies Δ by this."""


def corrupt(pseudo_grad: torch.Tensor, kind: str, generator: torch.Generator | None = None) -> torch.Tensor:
    """A corrupted copy of Δ.

    Kinds: nan (every value NaN), scale (Δ × 1000), noise (Gaussian noise with Δ's norm: no signal, so only
    its direction gives it away), signflip (−Δ: gradient ascent, same norm).
    """
    if kind == "nan":
        return torch.full_like(pseudo_grad, float("nan"))
    if kind == "scale":
        return pseudo_grad * SCALE
    if kind == "noise":
        noise = torch.randn(pseudo_grad.shape, generator=generator, dtype=pseudo_grad.dtype)
        norm = torch.linalg.vector_norm(noise)
        return noise * (torch.linalg.vector_norm(pseudo_grad) / norm) if norm > 0 else noise
    if kind == "signflip":
        return -pseudo_grad
    raise ValueError(f"unknown hostile kind {kind!r} (known: {', '.join(KINDS)})")


class HostileMerger:
    """Wraps this peer's merger and corrupts every contribution it submits.

    Args:
        inner: the real merger.
        kind: one of `KINDS`.
        seed: seed of the noise kind.
    """

    def __init__(self, inner: Merger, kind: str, seed: int = 0):
        if kind not in KINDS:
            raise ValueError(f"unknown hostile kind {kind!r}")
        self.inner, self.kind = inner, kind
        self.peer_id = inner.peer_id
        self._gen = torch.Generator().manual_seed(seed)
        logger.warning("[%s] HOSTILE peer: every contribution is corrupted (%s)", self.peer_id[-6:], kind)

    def submit(self, contribution: Contribution) -> Future[MergeResult]:
        bad = corrupt(contribution.pseudo_grad, self.kind, self._gen)
        return self.inner.submit(Contribution(**{**contribution.__dict__, "pseudo_grad": bad}))

    def close(self) -> None:
        self.inner.close()
