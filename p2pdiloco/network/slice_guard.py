"""The guards applied inside the all-reduce: the owner of a slice combines every member's part of it
(algorithm/aggregate.py decides which count and how); a member checks each average returned to it. Rejections and
trust scores are kept in this peer's `GuardBook`, by member id.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from p2pdiloco.algorithm.aggregate import aggregate, slice_policy
from p2pdiloco.algorithm.codecs import CodecError, NonFiniteError
from p2pdiloco.algorithm.guards import BANNED, FAR, NONFINITE, SHAPE, TRUST, GuardBook, check_average
from p2pdiloco.config import GuardConfig
from p2pdiloco.network.allreduce import group_slice
from p2pdiloco.network.group import Group
from p2pdiloco.network.peer_tag import short_id
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
        """This peer's slice of the group average (`aggregate.aggregate` under `aggregate.slice_policy`), with its
        decisions counted in the book: strikes for screened parts, trust scores updated, accepts. `reference`: this
        peer's outer momentum, the whole vector, which trust judges the parts against.

        Runs once per slice, on its owner, so whatever it decides every member receives the same bits. Each
        member's share is its weight among the parts combined (0 if left out). The trust reference is this peer's
        own slice of its momentum, which no member of this merge chose; judged by the owner alone, so every member
        still receives the same bits.
        """
        g = self.guard
        policy = slice_policy(tag, me, g.aggregate, g.norm_bound, g.min_cosine, g.trust_decay, g.robust_min_group,
                              g.trim_fraction)
        if policy.trust and reference is not None:
            lo, hi = group_slice(group, "d", me)
            reference = reference[lo:hi]
        else:
            reference = None
        history = [self.book.trust.get(m) for m in group.members]
        out = aggregate(parts, weights, [flags.get(i, "") for i in range(len(parts))], reference, policy,
                        history)
        if reference is not None and any(c is not None for c in out.cosines):
            for member, t in zip(group.members, out.trust, strict=True):
                if t is not None:
                    self.book.trust[member] = t
            logger.debug("[%s] merge %s: cosine to momentum, trust, factor: %s", self.book.tag, group.group_id,
                         ", ".join(f"{short_id(m)} {c if c is None else round(c, 3)} {t if t is None else round(t, 3)} "
                                   f"{f:.2f}" for m, c, t, f in zip(group.members, out.cosines, out.trust,
                                                                    out.factors, strict=True)))
        for i, reason in enumerate(out.reasons):
            if reason:
                # no strike for trust or distance: an honest member can sit low for a while, or have merged alone
                # for long, and a ban is for ever
                self.book.reject(group.members[i], reason, group.group_id, f"(slice {tag})",
                                 strike=i != me and reason not in (TRUST, FAR))
            else:
                self.book.accept(group.members[i], group.group_id)
        if out.average is None:
            raise MergeFailed("every contribution to this slice was rejected")
        return out.average, out.shares

    def accept(self, group: Group, owner: int, averaged: torch.Tensor, mine: torch.Tensor) -> None:
        bad = check_average(averaged, mine, self.guard.norm_bound)
        if bad:
            self.book.reject(group.members[owner], bad, group.group_id, "in its averaged slice")
            raise MergeFailed(f"member {short_id(group.members[owner])} returned a bad average ({bad})")
