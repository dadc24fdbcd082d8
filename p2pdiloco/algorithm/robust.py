"""Robust aggregation of merge-group members' contributions, as pure functions on flat fp32 tensors.

A plain weighted mean lets one member move the result arbitrarily far. These rules bound what a minority
of bad contributions can do. Each is computed once, by the slice's owner, in group order, so every member
still receives the same bits.

- `centered_clip`: CenteredClip (Karimireddy, He, Jaggi, "Learning from History for Byzantine Robust
  Optimization", ICML 2021; also used by hivemind's BTARD): move from a robust start towards each member,
  but by at most τ.
- `trimmed_mean`: coordinate-wise trimmed mean (Yin et al., "Byzantine-Robust Distributed Learning", 2018).
- `radial_directional_average`: average the members' directions and keep their mean norm (Decoupled
  DiLoCo's RDA), so the merged update does not shrink as groups grow and directions disagree. Not robust
  by itself; it is offered as an alternative mean.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from p2pdiloco.algorithm.names import AGGREGATORS
from p2pdiloco.algorithm.outer import weighted_average

ROBUST = ("centered_clip", "trimmed_mean")
"""The rules that bound what a minority can do (`aggregate` applies them from `min_group` members on)."""


def _normalized(weights: Sequence[float], n: int) -> list[float]:
    total = float(sum(weights))
    if total <= 0:
        return [1.0 / n] * n
    return [float(w) / total for w in weights]


def coordinate_median_low(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """Coordinate-wise median; for an even count the lower of the two middle values (as torch.median does).

    Not guards.coordinate_median_midpoint, which takes the mean of the two middles: this one is CenteredClip's
    start, and changing it would change the result of every CenteredClip merge of an even-sized group.
    """
    return torch.stack([p.float() for p in parts]).median(dim=0).values


def _start_and_radius(xs: Sequence[torch.Tensor]) -> tuple[torch.Tensor, list[float], float]:
    """CenteredClip's start (the coordinate-wise median), each part's distance to it, and their median (τ)."""
    v = coordinate_median_low(xs)
    dist = [float(torch.linalg.vector_norm(x.float() - v)) for x in xs]
    return v, dist, float(torch.tensor(dist).median())


def centered_clip(parts: Sequence[torch.Tensor], weights: Sequence[float], tau: float | None = None,
                  iters: int = 5, tie_vote: torch.Tensor | None = None) -> torch.Tensor:
    """CenteredClip: v ← v + Σ wᵢ·(xᵢ − v)·min(1, τ/‖xᵢ − v‖), starting from the coordinate-wise median.

    Args:
        parts: same-shape fp32 tensors, one per member, in group order.
        weights: non-negative weights (tokens); normalized here.
        tau: clipping radius (L2); None takes the median of the members' distances to the start, so the
            radius scales with the contributions and an outlier moves the result by at most ~τ·its weight.
        iters: fixed-point iterations.
        tie_vote: with an even count of parts, one more vote in the median start and the radius (not in the
            iterations), so that a 2–2 split is decided by it, not by the lower middle (see `aggregate`).
    """
    if not parts:
        raise ValueError("need at least one tensor")
    w = _normalized(weights, len(parts))
    xs = [p.float() for p in parts]
    votes = [*xs, tie_vote.float()] if tie_vote is not None and len(xs) % 2 == 0 else xs
    v, _, median_distance = _start_and_radius(votes)
    tau = median_distance if tau is None else tau
    if tau <= 0:
        return v  # a majority agree exactly: that is the answer
    for _ in range(iters):
        step = torch.zeros_like(v)
        for x, wi in zip(xs, w, strict=True):
            diff = x - v
            dist = float(torch.linalg.vector_norm(diff))
            step.add_(diff, alpha=wi * min(1.0, tau / dist) if dist > 0 else 0.0)
        v = v + step
    return v


FAR_FACTOR = 4.0
"""`far_from_majority`: a part farther than this many times the median distance from the coordinate-wise median
is left out of a global-model agreement."""


def far_from_majority(parts: Sequence[torch.Tensor], factor: float = FAR_FACTOR) -> list[bool]:
    """Which parts lie farther than `factor` × τ from the coordinate-wise median, τ being the median of all the
    parts' distances to it (CenteredClip's start and radius). None is far where τ is 0: a majority agree
    exactly, and CenteredClip already returns their bits.

    For agreements on global models, against members that offer −θg (a `takeover`). CenteredClip bounds a far
    part's pull by τ per iteration, but always in that part's direction: with honest models a few rounds apart (τ
    their spread) and 2 of 5 members offering −θg, the result moves along −θg by about the honest spread at every
    such agreement (docs/security.md, "Insiders who lie about themselves", has the measurement). Left out,
    such a part pulls nothing; an honest model that far from the rest is one the robust rule would clip anyway.
    Parts are left out only where those kept are a strict majority.
    """
    if len(parts) < 3:
        return [False] * len(parts)
    _, dist, tau = _start_and_radius([p.float() for p in parts])
    far = [tau > 0 and d > factor * tau for d in dist]
    # only a majority outvotes: with 2 of 4 far (torch's median of an even count is the lower middle, so τ can be
    # the nearer pair's distance) leaving a pair out would let the other pair decide
    return far if 2 * far.count(False) > len(far) else [False] * len(far)


def trimmed_mean(parts: Sequence[torch.Tensor], trim: float = 0.2) -> torch.Tensor:
    """Coordinate-wise mean after dropping the k smallest and k largest values, k = max(1, ⌊trim·n⌋).

    Weights are not used: a trimmed mean counts kept values equally (weighting after trimming would let a
    member that claims many tokens dominate again). With fewer than 3 parts nothing can be trimmed and the
    plain mean is returned.
    """
    if not parts:
        raise ValueError("need at least one tensor")
    n = len(parts)
    if n < 3:
        return torch.stack([p.float() for p in parts]).mean(dim=0)
    k = min(max(1, int(trim * n)), (n - 1) // 2)
    values = torch.stack([p.float() for p in parts]).sort(dim=0).values
    return values[k:n - k].mean(dim=0)


def radial_directional_average(parts: Sequence[torch.Tensor], weights: Sequence[float]) -> torch.Tensor:
    """RDA: (Σ wᵢ‖xᵢ‖) · unit(Σ wᵢ xᵢ/‖xᵢ‖), with weights normalized (Decoupled DiLoCo, arXiv 2604.21428).

    Members with a zero vector add nothing to the direction but count in the mean norm.
    """
    if not parts:
        raise ValueError("need at least one tensor")
    w = _normalized(weights, len(parts))
    direction = torch.zeros_like(parts[0], dtype=torch.float32)
    mean_norm = 0.0
    for x, wi in zip(parts, w, strict=True):
        norm = float(torch.linalg.vector_norm(x.float()))
        mean_norm += wi * norm
        if norm > 0:
            direction.add_(x.float(), alpha=wi / norm)
    d_norm = float(torch.linalg.vector_norm(direction))
    if d_norm == 0:
        return torch.zeros_like(direction)
    return direction * (mean_norm / d_norm)


def aggregate(name: str, parts: Sequence[torch.Tensor], weights: Sequence[float], min_group: int = 3,
              trim: float = 0.2, tie_vote: torch.Tensor | None = None) -> torch.Tensor:
    """Combine members' contributions by rule `name` (one of `AGGREGATORS`).

    The robust rules (centered_clip, trimmed_mean) apply only from `min_group` members on: with fewer, no
    majority exists to be robust with, and the weighted mean is used.

    `tie_vote` (centered_clip only): the vote that decides an even count's median start. An agreement passes the
    zero difference, its anchor, the state every member holds: 2 members at the anchor and 2 offering −θg
    (a 5-peer swarm with 2 hostile, one honest peer merging alone) got the hostile pair's value wherever it was
    the lower one, and adopted it; with the anchor's vote the result is the anchor there.
    """
    if name not in AGGREGATORS:
        raise ValueError(f"unknown aggregator {name!r}")
    if name == "rda":
        return radial_directional_average(parts, weights)
    if name == "mean" or len(parts) < max(min_group, 3):
        return weighted_average(parts, weights)
    if name == "trimmed_mean":
        return trimmed_mean(parts, trim)
    return centered_clip(parts, weights, tie_vote=tie_vote)
