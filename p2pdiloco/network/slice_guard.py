"""The guards of guards.py applied inside the all-reduce: the owner of a slice screens every member's part and
combines those it accepts robustly; a member checks each average returned to it. Rejections are counted in
this peer's `GuardBook`, by member id.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from p2pdiloco.algorithm.codecs import CodecError, NonFiniteError
from p2pdiloco.algorithm.guards import (
    BANNED,
    FAR,
    NONFINITE,
    SHAPE,
    TRUST,
    GuardBook,
    check_average,
    cosines_to,
    screen_parts,
    trust_factors,
)
from p2pdiloco.algorithm.outer import weight_shares
from p2pdiloco.algorithm.robust import ROBUST, aggregate, far_from_majority
from p2pdiloco.config import GuardConfig
from p2pdiloco.network.allreduce import group_slice
from p2pdiloco.network.group import Group
from p2pdiloco.network.rpc import MergeFailed

logger = logging.getLogger(__name__)


class SliceGuard:
    """A `SliceReducer` (see allreduce.py) with guards on.

    Args:
        guard: the bounds and the aggregation rule.
        book: where rejections and strikes are counted; banned members' parts are left out.
    """

    def __init__(self, guard: GuardConfig, book: GuardBook):
        self.guard, self.book = guard, book

    def admit(self, group: Group, sender: str, decode: Callable[[], torch.Tensor], n: int) -> tuple[torch.Tensor, str]:
        flag = BANNED if sender in self.book.banned else ""
        try:
            part = decode()
        except CodecError as e:
            # a malformed part is left out of the average instead of failing everyone's merge
            part = torch.full((n,), float("nan"))
            flag = flag or (NONFINITE if isinstance(e, NonFiniteError) else SHAPE)
        return part, flag

    def reduce(self, group: Group, tag: str, me: int, parts: list[torch.Tensor], weights: list[float],
               flags: dict[int, str], reference: torch.Tensor | None = None) -> tuple[torch.Tensor, list[float]]:
        """This peer's slice of the group average: screen every member's part, then combine those accepted;
        `reference`: this peer's outer momentum, the whole vector, which trust judges the parts against.

        Runs once per slice, on its owner, so whatever it decides every member receives the same bits. Each
        member's share is its weight among the parts combined (0 if left out); a robust rule weighs parts its
        own way (CenteredClip returns a majority's bits exactly, leaving a lone differing part nothing), which
        the share does not see.
        """
        g = self.guard
        # differences from an anchor ('a') are judged by CenteredClip and each member's `state_within_reach` only:
        # a member whose model is the anchor sends zeros, and any norm or direction reference would be arbitrary
        reasons = screen_parts(parts, me, g.norm_bound, g.min_cosine) if tag != "a" else screen_parts(parts, me, 0, -1)
        reasons = [flags.get(i) or r for i, r in enumerate(reasons)]
        factors = self._trust(group, tag, me, parts, reasons, reference)
        for i, reason in enumerate(reasons):
            if reason:
                self.book.reject(group.members[i], reason, group.group_id, f"(slice {tag})", strike=i != me)
        for i, f in enumerate(factors):
            if not reasons[i] and f <= 0:
                # no strike: an honest member with unusual data can sit low for a while, and a ban is for ever
                reasons[i] = TRUST
                self.book.reject(group.members[i], TRUST, group.group_id, f"(slice {tag})", strike=False)
        keep = [i for i, r in enumerate(reasons) if not r]
        if tag != "d" and g.aggregate in ROBUST and len(keep) >= max(g.robust_min_group, 3):
            # a global model far from the majority's is left out, not clipped: clipped, it still pulls the
            # agreement its way at every merge (robust.far_from_majority). No strike: an honest member that merged
            # alone for long can be as far
            for i, far in zip(keep, far_from_majority([parts[i] for i in keep]), strict=True):
                if far:
                    reasons[i] = FAR
                    self.book.reject(group.members[i], FAR, group.group_id, f"(slice {tag})", strike=False)
            keep = [i for i, r in enumerate(reasons) if not r]
        for i in keep:
            self.book.accept(group.members[i], group.group_id)
        if not keep:
            raise MergeFailed("every contribution to this slice was rejected")
        weights = [w * f for w, f in zip(weights, factors, strict=True)]
        if tag != "d" and 2 * sum(weights[i] > 0 for i in keep) > len(keep):
            # a fresh peer's θg (no tokens absorbed) counts for nothing, but only where the members that claim
            # tokens are a majority: at a run's start every honest member is fresh, and one member claiming
            # tokens would otherwise decide the swarm's model alone (measured: a 5-peer swarm with 2 such members
            # started from −θ0 and ended 16 % worse)
            keep = [i for i in keep if weights[i] > 0]
        kept, kept_w = [parts[i] for i in keep], [weights[i] for i in keep]
        shares = weight_shares(weights, [i in keep for i in range(len(parts))])
        # global models too are combined by the robust rule: where most members agree and one differs (it merged
        # alone), CenteredClip's median start and zero radius return the majority's bits exactly, and a member
        # offering a model far off (a hostile −θg) moves the result by at most the clipping radius
        # differences from the anchor: its own (zero) breaks a tie between two halves of the group
        tie = torch.zeros_like(kept[0], dtype=torch.float32) if tag == "a" else None
        return aggregate(g.aggregate, kept, kept_w, g.robust_min_group, g.trim_fraction, tie), shares

    def _trust(self, group: Group, tag: str, me: int, parts: list[torch.Tensor], reasons: list[str],
               reference: torch.Tensor | None) -> list[float]:
        """How much each member's pseudo-gradient part counts (1 for the agreement phase, or without a reference):
        its trust, the moving average of its parts' cosines to this peer's outer momentum (guards.trust_factors).

        The reference is this peer's own slice of its momentum, which no member of this merge chose; a screen
        against the parts' own median fails once 2 of 5 parts are sign-flipped (docs/security.md). Judged by the
        owner alone, so every member still receives the same bits. The owner's own part always counts fully: an
        honest owner has no reason to doubt it and a hostile one decides its slice anyway; judged, a young momentum
        left an honest owner's own part out (3 of 6 trust rejections of one README run, rounds 2–4).
        """
        n = len(parts)
        if tag != "d" or self.guard.trust_decay < 0 or reference is None:
            return [1.0] * n
        lo, hi = group_slice(group, "d", me)
        cosines = cosines_to(parts, reference[lo:hi])
        if all(c is None for c in cosines):
            return [1.0] * n  # no momentum yet (the run's first merge): nothing to judge by
        trust: list[float | None] = []
        for i, c in enumerate(cosines):
            member = group.members[i]
            if reasons[i]:
                trust.append(None)
            elif c is None:
                trust.append(self.book.trust.get(member))
            else:
                trust.append(self.book.observe(member, c, self.guard.trust_decay))
        it = iter(trust_factors([t for i, t in enumerate(trust) if not reasons[i]], hi - lo))
        factors = [0.0 if reasons[i] else next(it) for i in range(n)]
        if not reasons[me]:
            factors[me] = 1.0  # its score still counts in the median: in a pair, it is the vote that judges the other
        logger.debug("[%s] merge %s: cosine to momentum, trust, factor: %s", self.book.tag, group.group_id, ", ".join(
            f"{m[-6:]} {c if c is None else round(c, 3)} {t if t is None else round(t, 3)} {f:.2f}"
            for m, c, t, f in zip(group.members, cosines, trust, factors, strict=True)))
        return factors

    def accept(self, group: Group, owner: int, averaged: torch.Tensor, mine: torch.Tensor) -> None:
        bad = check_average(averaged, mine, self.guard.norm_bound)
        if bad:
            self.book.reject(group.members[owner], bad, group.group_id, "in its averaged slice")
            raise MergeFailed(f"member {group.members[owner][-6:]} returned a bad average ({bad})")
