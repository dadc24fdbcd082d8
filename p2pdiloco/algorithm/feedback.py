"""Error feedback: the part of a pseudo-gradient a lossy codec did not send is kept and sent with a later one.

The residual is the learner's state (training/learner.py): it is saved in checkpoints, so a restarted peer sends the
same next pseudo-gradient as one that was not. A merge only reports what it sent (`Merged.sent`).
"""

from __future__ import annotations

import torch


class ErrorFeedback:
    """The residual of past rounds' quantization, added to the next pseudo-gradient.

    Usage per round: ``target = ef.compensate(delta)``; send ``q = Q(target)``; if the merge that sent it
    is applied, ``ef.commit(target, q)`` (residual ← target − q); if it failed, nothing was sent and the
    residual stays as it was.

    Args:
        enabled: with False, `compensate` returns Δ unchanged and the residual stays zero.
        decay: β, the residual's weight when it is added (1: plain error feedback). SparseLoCo (arXiv 2508.15706)
            decays it and drops the outer momentum: the decayed accumulator stands in for it.
    """

    def __init__(self, enabled: bool = True, decay: float = 1.0):
        self.enabled, self.decay = enabled, decay
        self.residual: torch.Tensor | None = None

    def compensate(self, pseudo_grad: torch.Tensor) -> torch.Tensor:
        if not self.enabled or self.residual is None or self.residual.shape != pseudo_grad.shape:
            return pseudo_grad
        return pseudo_grad + self.decay * self.residual if self.decay != 1.0 else pseudo_grad + self.residual

    def commit(self, target: torch.Tensor, transmitted: torch.Tensor) -> None:
        if self.enabled:
            residual = (target - transmitted).float()
            # a non-finite pseudo-gradient (a broken accelerator) must not poison every later round
            self.residual = residual if torch.isfinite(residual).all() else None

    def norm(self) -> float:
        return float(self.residual.norm()) if self.residual is not None else 0.0


def rejected_as_dropped(sent: torch.Tensor, delta: torch.Tensor, shares: list[float],
                        bounds: list[tuple[int, int]]) -> torch.Tensor:
    """What error feedback counts as gone of each slice (`ErrorFeedback.commit`'s `transmitted`): what was sent, and
    in slices whose owner left this peer's part out (share 0) this round's own Δ, so that the residual there stays
    the residual carried in.

    The rejected Δ is dropped, not kept: kept whole, a part would come back the next round on top of the next Δ,
    larger, be left out again by the norm check, and grow every round, until a group small enough to accept it
    (two members, where each owner's norm reference is its own part) applied it and left the global model worse
    than its initialization. The residual carried in is not charged as sent: it goes out with the next merge.

    Args:
        sent: the compensated Δ as the group's average took it, the whole vector.
        delta: this round's own Δ, uncompensated.
        shares: this peer's share of each slice's average, by slice (0: left out).
        bounds: [start, end) of each slice (`allreduce.slice_bounds`).
    """
    if all(s > 0 for s in shares):
        return sent
    sent = sent.clone()
    for share, (lo, hi) in zip(shares, bounds, strict=True):
        if share <= 0:
            sent[lo:hi] = delta[lo:hi]
    return sent
