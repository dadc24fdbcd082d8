"""Training math of DiLoCo as pure functions on flat fp32 tensors: no network, no threads.

References: DiLoCo (arXiv 2311.08105) for the pseudo-gradient and the Nesterov outer step; Async Local-SGD
(arXiv 2401.09135) for keeping the inner steps taken while a merge is in flight (the rebase). `outer_round` is
all a landed merge does to a peer's tensors; `eager_step` what a decoupled peer does at a submit.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch


def pseudo_gradient(global_params: torch.Tensor, local_params: torch.Tensor) -> torch.Tensor:
    """Δ = θg − θ: how far this peer's inner steps moved it from the global model.

    Args:
        global_params: flat fp32 global model θg at the start of the round.
        local_params: flat fp32 local model θ at the end of the round.

    Returns:
        A new flat fp32 tensor. It points *against* the direction of progress, like a gradient.
    """
    return global_params.float() - local_params.float()


def outer_step(
    global_params: torch.Tensor,
    momentum: torch.Tensor,
    pseudo_grad: torch.Tensor,
    lr: float,
    mu: float,
    nesterov: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One step of (Nesterov) SGD on the global model, as torch.optim.SGD computes it.

    m ← μ·m + Δ;  θg ← θg − lr·(Δ + μ·m) with Nesterov, else θg ← θg − lr·m.

    Args:
        global_params: flat fp32 θg before the step.
        momentum: flat fp32 momentum buffer m (zeros before the first step).
        pseudo_grad: flat fp32 merged Δ̄.
        lr: outer learning rate (DiLoCo: 0.7).
        mu: outer momentum (DiLoCo: 0.9).
        nesterov: use the Nesterov form.

    Returns:
        (new θg, new m), both new tensors; the inputs are not modified.
    """
    new_momentum = momentum * mu + pseudo_grad
    update = pseudo_grad + new_momentum * mu if nesterov else new_momentum
    return global_params - update * lr, new_momentum


STATE_REACH = 16.0
"""A peer adopts a merge group's averaged global model only within this many of its own outer steps."""


def state_within_reach(own: torch.Tensor, adopted: torch.Tensor, own_step: torch.Tensor,
                       reach: float = STATE_REACH, longest_recent: float = 0.0) -> bool:
    """Whether a group's averaged θg is close enough to this peer's own θg to adopt: ‖adopted − own‖ ≤ reach·‖step‖.

    Global models of honest peers differ by the outer steps they took apart (a merge alone, a failed merge),
    so a difference of more than `reach` of them did not come from honest divergence: a member that offered
    −θg, or one whose model drifted far off. Averaging models that far apart is not agreement (it can leave the
    global model worse than its initialization), and the length of this peer's own steps is a scale no other
    peer can claim. The unit is the longer of this round's step and `longest_recent`, the longest of this peer's
    recent ones: steps shrink as the inner lr decays, while the divergence was taken in the longer steps before
    (with this round's step alone as the unit, honest members would refuse a run's last agreement, taken in its
    shortest steps, and the run would end apart).

    Args:
        own: flat fp32 θg of this peer before the merge.
        adopted: flat fp32 θg the group's agreement produced.
        own_step: this round's outer step on this peer's own θg (new θg − θg).
        reach: how many steps away is still adopted.
        longest_recent: the length of this peer's longest outer step of its last `reach` merges (0: none).
    """
    step = max(float(torch.linalg.vector_norm(own_step.float())), longest_recent)
    distance = float(torch.linalg.vector_norm(adopted.float() - own.float()))
    return math.isfinite(distance) and distance <= reach * step


def stale_share_kept(new_global: torch.Tensor, local_at_submit: torch.Tensor, keep: float) -> float:
    """The share of the inner steps taken while a merge was in flight that `rebase` keeps when it lands.

    Those steps were taken from θ_at_submit (the eager update), not from the θg the merge produced: they are
    stale, and kept whole they cost decoupled peers eval loss against `--sync`. `keep` = `outer.rebase_keep` of
    them is kept (0.5 by default, as Streaming DiLoCo mixes a landed fragment half and half, arXiv 2501.18512;
    docs/benchmarks.md, "Steps taken while a merge is in flight", has how it was chosen). Steps taken from the
    very model the merge landed on (a merge alone after an eager update) are not stale: all kept.
    """
    return 1.0 if torch.equal(new_global, local_at_submit) else keep


def rebase(new_global: torch.Tensor, local_now: torch.Tensor, local_at_submit: torch.Tensor,
           keep: float = 1.0) -> torch.Tensor:
    """θ ← θg + keep·(θ − θ_at_submit): move onto the new global model with `keep` of the steps taken since the
    submit (see `stale_share_kept`)."""
    return new_global + (local_now - local_at_submit) * keep


class OuterSettings(Protocol):
    """The outer optimizer's settings `outer_round` reads (config.OuterOptConfig has them)."""

    lr: float
    """Outer lr of a step on a group's Δ̄."""
    alone_lr: float
    """Outer lr of a step on this peer's own Δ alone (a merge alone, an eager update); 0: `lr`."""
    momentum: float
    nesterov: bool
    rebase_keep: float
    """Share of the inner steps taken while a merge was in flight that the rebase keeps (`stale_share_kept`)."""


def alone_lr(cfg: OuterSettings) -> float:
    """The outer lr of steps on this peer's own Δ alone: `cfg.alone_lr`, or `cfg.lr` where that is 0."""
    return cfg.alone_lr or cfg.lr


def eager_step(params: torch.Tensor, momentum: torch.Tensor, own_delta: torch.Tensor,
               cfg: OuterSettings) -> torch.Tensor:
    """The eager update (arXiv 2502.12996): the local model to go on from while a merge is in flight, the outer
    step on this peer's own Δ at `alone_lr`, a stand-in for the Δ̄ in flight, so that steps taken meanwhile start
    near where the merge lands (its rebase moves them by the difference). Not θg − Δ, far from it: at H = 10
    merges land ~7 steps late. θg and the momentum themselves wait for the merge."""
    eager, _ = outer_step(params, momentum, own_delta, alone_lr(cfg), cfg.momentum, cfg.nesterov)
    return eager


@dataclass(frozen=True)
class OuterRound:
    """What a landed merge makes of this peer's state (`outer_round`)."""

    params: torch.Tensor
    """θg after the outer step."""
    momentum: torch.Tensor
    """The outer momentum after the step."""
    adopted: bool
    """False where the group's agreed (θg, momentum) was refused (too far, see `state_within_reach`), else True."""
    step: float
    """Length of this outer step, ‖θg after − θg before‖: a unit of the next merges' `state_within_reach`."""
    local: torch.Tensor | None
    """The local model moved onto the new θg (`rebase`); None where no local model was given."""
    keep: float
    """Share of the inner steps taken since the submit that `local` keeps (0: none, or no local model)."""


def outer_round(params: torch.Tensor, momentum: torch.Tensor, pseudo_grad: torch.Tensor, cfg: OuterSettings, *,
                alone: bool = False, agreed_state: torch.Tensor | None = None, own_weight: float = 1.0,
                longest_recent: float = 0.0, local_now: torch.Tensor | None = None,
                local_at_submit: torch.Tensor | None = None) -> OuterRound:
    """One landed merge: adopt the group's agreed global state if it is within reach, take the outer step on Δ̄,
    and rebase the local model onto the new θg (DiLoCo, arXiv 2311.08105; Async Local-SGD, arXiv 2401.09135).

    Args:
        params: flat fp32 θg of this peer before the merge (not modified).
        momentum: flat fp32 outer momentum before the merge (not modified).
        pseudo_grad: the merged Δ̄ (this peer's own Δ when alone).
        cfg: the outer optimizer's settings.
        alone: merged alone: the step takes `alone_lr`.
        agreed_state: where members' global models differed, the group's (θg, momentum) concatenated.
        own_weight: tokens this peer's θg has absorbed. With none (a fresh peer) the agreed state is adopted
            whatever it is; otherwise only within reach of this peer's own (`state_within_reach`, whose unit is
            the longer of this round's step on its own θg and `longest_recent`).
        longest_recent: the longest of this peer's last outer steps (`OuterRound.step`; 0: none).
        local_now: the local model θ now; None: no rebase.
        local_at_submit: θ when Δ was taken (after an eager update, `eager_step`'s). θ ← θg + keep·(θ −
            θ_at_submit), keep from `stale_share_kept`; in sync mode no step was taken since, so θ ← θg exactly.
            None restarts from θg, every step since the submit given up.
    """
    adopted = True
    if agreed_state is not None:
        n = params.numel()
        agreed_params, agreed_momentum = agreed_state[:n], agreed_state[n:]
        if own_weight > 0:
            own_next, _ = outer_step(params, momentum, pseudo_grad, cfg.lr, cfg.momentum, cfg.nesterov)
            adopted = state_within_reach(params, agreed_params, own_next - params, longest_recent=longest_recent)
        if adopted:  # a copy: the agreed state's buffer belongs to the merge
            params, momentum = agreed_params.clone(), agreed_momentum.clone()
    lr = alone_lr(cfg) if alone else cfg.lr
    new_params, new_momentum = outer_step(params, momentum, pseudo_grad, lr, cfg.momentum, cfg.nesterov)
    step = float(torch.linalg.vector_norm(new_params - params))
    local, keep = None, 0.0
    if local_now is not None:
        at_submit, keep = ((local_now, 0.0) if local_at_submit is None
                           else (local_at_submit, stale_share_kept(new_params, local_at_submit, cfg.rebase_keep)))
        local = rebase(new_params, local_now, at_submit, keep)
    return OuterRound(new_params, new_momentum, adopted, step, local, keep)


def weighted_average(tensors: Sequence[torch.Tensor], weights: Sequence[float]) -> torch.Tensor:
    """Σ wᵢ·xᵢ / Σ wᵢ, summed in the given order so that every peer computing it gets the same bits.

    Args:
        tensors: same-shape fp32 tensors, one per merge-group member, in group order.
        weights: non-negative weights (tokens processed); if all are zero, members count equally.
    """
    if len(tensors) != len(weights) or not tensors:
        raise ValueError("need one weight per tensor and at least one tensor")
    if any(w < 0 for w in weights):
        raise ValueError("weights must be non-negative")
    total = float(sum(weights))
    if total <= 0:
        weights, total = [1.0] * len(tensors), float(len(tensors))
    out = torch.zeros_like(tensors[0], dtype=torch.float32)
    for x, w in zip(tensors, weights, strict=True):
        out.add_(x.float(), alpha=w / total)
    return out


def weight_shares(weights: Sequence[float], kept: Sequence[bool] | None = None) -> list[float]:
    """Each member's share wᵢ / Σ w of a weighted average, as `weighted_average` counts the weights.

    Args:
        weights: non-negative weights, one per member.
        kept: which members' parts the average used (None: all); the others' share is 0 and the kept ones
            share the whole. If every kept weight is zero, the kept members count equally.
    """
    kept = [True] * len(weights) if kept is None else list(kept)
    used = [w if k else 0.0 for w, k in zip(weights, kept, strict=True)]
    total = float(sum(used))
    if total <= 0:
        n = sum(kept)
        return [1.0 / n if k else 0.0 for k in kept] if n else [0.0] * len(weights)
    return [w / total for w in used]


def cosine_lr(step: int, peak_lr: float, warmup_steps: int, total_steps: int, min_ratio: float) -> float:
    """Linear warmup to `peak_lr`, then cosine decay to `min_ratio`·peak at `total_steps` (nanoGPT's get_lr)."""
    min_lr = peak_lr * min_ratio
    if step < warmup_steps:
        return peak_lr * (step + 1) / warmup_steps
    if step >= total_steps:
        return min_lr
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (peak_lr - min_lr)


def state_digest(*tensors: torch.Tensor) -> str:
    """A short hash of tensors' exact bytes: equal digests mean bit-identical global state."""
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().contiguous().cpu().numpy())  # the array's buffer, not a copy of it
    return h.hexdigest()[:16]
