"""Guards on received contributions: pure checks, and the book of rejections and bans.

The slice owner of a merge sees every member's part of its slice, so it judges each part against the
others (DESIGN.md, step 5): wrong length or dtype, non-finite values, a norm far from the group's median,
a direction that disagrees with the group's coordinate-wise median, or a member whose round counter lags
the group's far behind. The trust screen (trust.py) weighs each accepted pseudo-gradient part by how its member's
parts have agreed with the judge's outer momentum over past merges (`cosines_to`, `moving_trust`,
`trust_factors`). A rejected part is left out of that slice's average (aggregate.py); all members still receive
the same averaged slice, so they stay bit-identical. Each owner decides for its own slice (see
docs/security.md for why that is acceptable).
"""

from __future__ import annotations

import logging
import math
import statistics
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from p2pdiloco.util.numbers import finite_number

logger = logging.getLogger(__name__)

NONFINITE, NORM, DIRECTION, STALE, BANNED, SHAPE, TRUST, FAR, FORGED = (
    "nonfinite", "norm", "direction", "stale", "banned", "shape", "trust", "far", "forged")
"""Rejection reasons, as counted in metrics."""


def _norm(x: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(x.float()))


def coordinate_median_midpoint(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """Coordinate-wise median; for an even count the mean of the two middle values (of two parts: their mean).

    Not robust.coordinate_median_low (torch.median's lower middle): with two other parts, the lower middle
    would take each coordinate's smaller value, a reference that points towards neither part, so the
    direction check would judge against a vector no member sent.
    """
    values = torch.stack([p.float() for p in parts]).sort(dim=0).values
    n = len(parts)
    return values[n // 2] if n % 2 else (values[n // 2 - 1] + values[n // 2]) / 2


def screen_parts(parts: Sequence[torch.Tensor], own: int, norm_bound: float, min_cosine: float) -> list[str]:
    """Judge members' parts of one slice; returns one reason per part, '' for an accepted part.

    Args:
        parts: fp32 tensors of equal length, one per member, in group order.
        own: index of the judging member's own part (the trusted reference when only 2 are in the group).
        norm_bound: reject a part whose L2 norm exceeds this many times the reference norm (the median of
            the finite parts' norms from 3 members on, else the judge's own norm); 0 disables.
        min_cosine: reject a part whose cosine similarity to the reference direction is below this; the
            reference is the coordinate-wise median of the *other* finite parts (a median that included the
            part itself would lean towards it); -1 disables. Only from 3 finite parts on: with two, the only
            reference is the judge's own part, and two honest peers training on different data can point
            apart (measured: a 2-peer swarm of the tiny test model fell below 0.1 after ~80 rounds and the
            peers banned each other), so a direction check there cannot tell honest from hostile.
    """
    reasons = ["" if bool(torch.isfinite(p).all()) else NONFINITE for p in parts]
    finite = [i for i, r in enumerate(reasons) if not r]
    if not finite:
        return reasons
    if len(finite) >= 3:
        ref_norm = statistics.median(_norm(parts[i]) for i in finite)
    elif own in finite:
        ref_norm = _norm(parts[own])
    else:
        return reasons  # two members and ours is broken: nothing trustworthy to compare with
    for i in finite:
        if norm_bound > 0 and ref_norm > 0 and _norm(parts[i]) > norm_bound * ref_norm:
            reasons[i] = NORM
    if min_cosine <= -1 or len(finite) < 3:
        return reasons
    for i in finite:
        if reasons[i]:
            continue
        reference = coordinate_median_midpoint([parts[j] for j in finite if j != i])
        n_i, r_norm = _norm(parts[i]), _norm(reference)
        if n_i == 0 or r_norm == 0:
            continue  # a zero part moves nothing; a zero reference gives no direction to judge by
        if float(torch.dot(parts[i].float(), reference)) / (n_i * r_norm) < min_cosine:
            reasons[i] = DIRECTION
    return reasons


def cosines_to(parts: Sequence[torch.Tensor], reference: torch.Tensor) -> list[float | None]:
    """Each part's cosine similarity to `reference`; None where the part or the reference is zero or not finite.

    The trust screen's reference is the judge's slice of its own outer momentum: the direction the swarm's global
    model has been moving over past merges (the same on every member while their digests agree). No member of
    this merge chose it, unlike a median of the parts (which 2 sign-flipped parts of 5 leave without a direction).
    Not the judge's own part either: a hostile owner running this code would then keep only its allies' parts.
    """
    ref = reference.float()
    r_norm = _norm(ref)
    if not math.isfinite(r_norm) or r_norm == 0:
        return [None] * len(parts)
    out: list[float | None] = []
    for p in parts:
        n = _norm(p)
        out.append(float(torch.dot(p.float(), ref)) / (n * r_norm) if math.isfinite(n) and n > 0 else None)
    return out


def trust_factors(trust: Sequence[float | None], length: int, scale: float = 0.5) -> list[float]:
    """How much each member's part counts, from its trust score: min(1, max(0, tᵢ / s)).

    s = max(`scale` × the upper median of the scores, 1/√length). If 2 of 5 members are hostile, the upper median
    is the lowest honest score, so honest members at or above half of it count fully, whatever the hostile ones
    score; a sign-flipped part (trust < 0) counts 0, same-norm noise (~±1/√length) next to nothing. 1/√length is
    the cosine of noise: below it a score says nothing.

    If the upper median is not positive, a majority points against the reference: with an honest majority, the
    reference is what is wrong (sign-flipped parts once won a merge and the momentum turned their way; measured
    once in a decoupled bench run, which then ended at 574 × the clean loss), so every part counts fully and the
    robust rule alone decides until honest parts agree with the momentum again.

    Args:
        trust: one score per member (an average of its parts' cosines to the judge's momentum, see
            `moving_trust`); None: no score yet (counts fully, and is not part of the median).
        length: values in the slice judged.
        scale: share of the upper-median score at which a member counts fully.
    """
    scored = sorted(t for t in trust if t is not None)
    if not scored or scored[len(scored) // 2] <= 0:
        return [1.0] * len(trust)
    s = max(scale * scored[len(scored) // 2], 1.0 / math.sqrt(max(length, 1)))
    return [1.0 if t is None else min(1.0, max(0.0, t / s)) for t in trust]


def moving_trust(old: float | None, cosine: float, decay: float) -> float:
    """A member's trust score after one more part: t ← decay·t + (1 − decay)·cosine, starting from the first cosine.

    One slice's cosine is noisy, and an honest peer with unusual data can point against the others on some slices
    for a long time; since slice ownership rotates from merge to merge (allreduce.owned_slice), the average runs
    over all of the vector, where an honest member stays positive and a sign-flipping one is negative on every
    slice.

    Args:
        old: the score so far (None: none yet).
        cosine: this part's cosine to the judge's momentum.
        decay: weight of the score so far.
    """
    return cosine if old is None else decay * old + (1 - decay) * cosine


WEIGHT_CAP = 2.0
"""No member's weight counts for more than this many times the group's median claim (see `bounded_weights`)."""


def bounded_weights(weights: Sequence[object], cap: float = WEIGHT_CAP) -> list[float]:
    """Members' claimed weights as the group counts them: each capped at `cap` × the median of the positive claims.

    A weight is what a member says about itself (tokens in its round, tokens its θg has absorbed) and nothing
    can check it. Capped, a member claiming 1e30 counts at most `cap` times the median member, so it cannot
    take the average over (uncapped, a `takeover` member's `state_weight = 1e30` would replace a whole group's
    model). The
    median is the lower middle of the positive claims, so in a group of two the larger claim is capped at
    `cap` times the smaller; an honest fast peer paired with a slow one loses some of its weight, which costs
    less than letting a claim decide. Claims of 0 stay 0 (a fresh peer's θg counts for nothing); negative,
    non-finite and non-numeric claims count 0.

    Args:
        weights: one claim per member, in group order.
        cap: the largest multiple of the median claim that counts.
    """
    clean = [float(w) if finite_number(w) and w > 0 else 0.0 for w in weights]
    positive = sorted(w for w in clean if w > 0)
    if not positive:
        return clean
    reference = positive[(len(positive) - 1) // 2]
    return [min(w, cap * reference) for w in clean]


def stale_members(rounds: Sequence[int], max_lag: int) -> list[bool]:
    """True for members whose round counter lags the group's median by more than `max_lag` (0 disables)."""
    if max_lag <= 0 or not rounds:
        return [False] * len(rounds)
    median = statistics.median_low(rounds)
    return [median - r > max_lag for r in rounds]


def check_average(avg: torch.Tensor, own: torch.Tensor, norm_bound: float) -> str:
    """Judge an averaged slice returned by its owner against this member's own part of that slice.

    An honest average is finite and no longer than the longest accepted part, which is within `norm_bound`
    of the median; allow `norm_bound`² times our own norm so that an honest member with a small update is
    not refused. Returns '' or the reason.
    """
    if not bool(torch.isfinite(avg).all()):
        return NONFINITE
    own_norm = _norm(own)
    if norm_bound > 0 and own_norm > 0 and _norm(avg) > norm_bound * norm_bound * own_norm:
        return NORM
    return ""


@dataclass
class GuardBook:
    """Rejections counted by reason, strikes per sender, and the peers banned for the rest of the run.

    Args:
        ban_after: a peer is banned after this many consecutive merges in which a contribution of it was
            rejected (0: never ban). Consecutive, because an honest peer's part is now and then an outlier on
            one slice (measured: 2 of 150 slice judgements in a clean bench run) while a broken or hostile
            peer is bad every time.
        tag: this peer's short id, for log lines.
    """

    ban_after: int = 3
    tag: str = ""
    rejected: Counter = field(default_factory=Counter)
    trust: dict[str, float] = field(default_factory=dict)
    """Per sender: the moving average of its parts' cosines to this peer's outer momentum (`observe`)."""
    strikes: Counter = field(default_factory=Counter)
    banned: set[str] = field(default_factory=set)
    _struck: set[tuple[str, str]] = field(default_factory=set)

    def reject(self, sender: str, reason: str, merge_id: str, detail: str = "", strike: bool = True) -> None:
        """Count one rejected contribution of `sender` in merge `merge_id`; one strike per sender per merge
        (none if `strike` is False: our own part, which we cannot ban)."""
        self.rejected[reason] += 1
        logger.warning("[%s] rejected a contribution of %s in merge %s: %s %s", self.tag, sender[-8:],
                       merge_id, reason, detail)
        if not strike or reason == BANNED or (sender, merge_id) in self._struck:
            return
        self._struck.add((sender, merge_id))
        self.strikes[sender] += 1
        if self.ban_after > 0 and self.strikes[sender] >= self.ban_after and sender not in self.banned:
            self.banned.add(sender)
            logger.warning("[%s] banned %s for the rest of the run after %d bad merges", self.tag, sender[-8:],
                           self.strikes[sender])

    def accept(self, sender: str, merge_id: str) -> None:
        """`sender`'s part was accepted in merge `merge_id`: unless it was rejected elsewhere in that merge, its
        run of strikes ends."""
        if (sender, merge_id) not in self._struck:
            self.strikes[sender] = 0

    def observe(self, sender: str, cosine: float, decay: float) -> float:
        """Fold one part's cosine to this peer's momentum into `sender`'s trust score (`moving_trust`); returns
        the new score."""
        self.trust[sender] = moving_trust(self.trust.get(sender), cosine, decay)
        return self.trust[sender]

    def remember(self, trust: object) -> None:
        """Take back trust scores saved in this peer's checkpoint (`trust` as it was), so that a restarted peer
        does not judge every member as a stranger again; entries that are not (peer id, score in [-1, 1]) are
        skipped."""
        if isinstance(trust, dict):
            self.trust.update({p: float(t) for p, t in trust.items()
                               if isinstance(p, str) and finite_number(t) and -1 <= t <= 1})

    def report(self) -> dict:
        """What metrics and summaries show."""
        return {"rejected": sum(self.rejected.values()), "rejected_by_reason": dict(self.rejected),
                "banned": sorted(self.banned)}
