"""The trust screens: how much a member's pseudo-gradient part counts, judged against the outer momentum.

There are two rules, one per way parts are combined, and they cannot be one without changing what either decides:

- `trust_by_history` (a slice's owner, sliced all-reduce): a weight per part, from the member's *history* of
  cosines to the owner's momentum (a moving average kept across merges). Only the owner decides, so a member's
  score may be the owner's own; slice ownership rotates, so the history covers the whole vector.
- `trusted` (all-gathered parts): all or nothing, judged from this merge alone. Every member decides for the whole
  vector and must decide alike; members' histories differ (they merged in different groups), so no history can
  count, and a weight between 0 and 1 would let members whose momenta differ slightly end on different models.

Both take the momentum as their reference because no member of the merge chose it (a median of the parts is
left without a direction by 2 sign-flipped parts of 5), and both leave nothing out where the upper median of the
scores is not positive: with an honest majority, a majority pointing against the momentum means the momentum is
what is wrong.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from p2pdiloco.algorithm.guards import TRUST, cosines_to, moving_trust, trust_factors


def trust_by_history(parts: Sequence[torch.Tensor], reasons: Sequence[str], reference: torch.Tensor,
                     history: Sequence[float | None], decay: float,
                     own: int) -> tuple[list[float], list[float | None], list[float | None]]:
    """How much each part of one slice counts (`guards.trust_factors` of the members' trust scores), with each
    member's score updated by this part's cosine to `reference` (`guards.moving_trust`).

    The owner's own part always counts fully: an honest owner has no reason to doubt it and a hostile one decides
    its slice anyway, and a young momentum could leave an honest owner's own part out. Its score still counts in the
    median: in a pair, it is the vote that judges the other.

    Args:
        parts: the members' parts of the slice, in group order.
        reasons: '' for the parts the screens accepted; the others count 0 and their scores are not updated.
        reference: the owner's slice of its outer momentum.
        history: each member's trust score before this merge (None: none yet).
        decay: the moving average's decay (`guards.moving_trust`).
        own: index of the owner's part.

    Returns:
        (each part's factor in [0, 1], each member's score after this merge (None: none), each part's cosine to
        `reference` (None where it has none)). Without any cosine (a zero momentum: the run's first merge) every
        factor is 1 and no score changes.
    """
    n = len(parts)
    cosines = cosines_to(parts, reference)
    if all(c is None for c in cosines):
        return [1.0] * n, list(history), cosines
    trust = [None if r else h if c is None else moving_trust(h, c, decay)
             for r, c, h in zip(reasons, cosines, history, strict=True)]
    it = iter(trust_factors([t for t, r in zip(trust, reasons, strict=True) if not r], reference.numel()))
    factors = [0.0 if r else next(it) for r in reasons]
    if not reasons[own]:
        factors[own] = 1.0
    return factors, trust, cosines


TRUST_SHARE = 0.15
"""A part counts only if its cosine to the momentum is above this share of the group's upper-median cosine."""


def trusted(parts: list[torch.Tensor], reasons: list[str], reference: torch.Tensor | None,
            forked: bool = False) -> list[str]:
    """The trust screen for all-gathered parts: `reasons` with TRUST added for each part whose cosine to the outer
    momentum `reference` is at most max(TRUST_SHARE × the upper median of the cosines, 1/√n); without a momentum
    (the run's first merge), for each part that fewer others point with than the group's upper median (`supported`).

    Every member holds the momentum bit for bit while its global state is the same as the others': a
    sign-flipped part points against it and same-norm noise is nearly orthogonal to it.

    The first merge matters most: its average becomes the momentum every later merge is judged by. Let in, 2
    sign-flipped parts of 5 can turn it so that the next honest parts point against it; the majority rule below
    then turns the screen off for good (docs/security.md, "Trust for sparse parts").

    An honest part left out loses only this round's Δ (error feedback keeps the residual it carried). If the upper
    median is not positive, nothing is left out. If it is positive but no more than 1/√n, the cosine of a random
    direction, the floor would leave out at least half of the parts, and at times every part: there only parts
    that point against the momentum are left out. In a merge whose members' global states differ (`forked`: an
    agreement is part of it) their momenta differ, so their decisions could too, and a fork would last: there the
    parts are judged by their support among themselves (`supported`), which every member computes from the same
    parts alike.
    """
    if reference is None:
        return list(reasons)
    if forked:
        return supported(parts, reasons)
    cosines = cosines_to(parts, reference)
    scored = sorted(c for c, r in zip(cosines, reasons, strict=True) if c is not None and not r)
    if not scored:
        return supported(parts, reasons)
    median, chance = scored[len(scored) // 2], 1.0 / math.sqrt(max(reference.numel(), 1))
    if median <= 0:
        return list(reasons)
    # where the momentum tells parts apart no better than chance, only the sign of their cosine is kept from it
    floor = max(TRUST_SHARE * median, chance) if median > chance else 0.0
    return [r or (TRUST if c is not None and c <= floor else "") for c, r in zip(cosines, reasons, strict=True)]


def supported(parts: list[torch.Tensor], reasons: list[str]) -> list[str]:
    """`reasons` with TRUST added for each part that fewer other parts have a positive cosine with than the upper
    median of that count, from 3 parts on: the trust screen's rule where there is no momentum to judge by.

    Honest members' first pseudo-gradients point alike (their sparse parts' pairwise cosines are positive), so
    with h honest and f flipped parts an honest one has h − 1 + 0 supporters
    and a flipped one f − 1: while honest parts are a majority, the upper median is an honest count."""
    idx = [i for i, r in enumerate(reasons) if not r]
    if len(idx) < 3:
        return list(reasons)
    unit = {i: parts[i].float() / max(float(torch.linalg.vector_norm(parts[i].float())), 1e-30) for i in idx}
    support = {i: sum(float(torch.dot(unit[i], unit[j])) > 0 for j in idx if j != i) for i in idx}
    bar = sorted(support.values())[len(idx) // 2]
    return [r or (TRUST if support[i] < bar else "") for i, r in enumerate(reasons)]
