"""One group's combination of its members' parts: which parts count, how much, and their average.

The same function serves both ways a group averages (DESIGN.md, step 5): the owner of a slice combining every
member's part of that slice (the sliced all-reduce, network/slice_guard.py), and each member combining all
members' whole parts (the all-gather of sparse codecs, network/sparse_exchange.py). A `Policy` says which: the
screens' judge, the trust rule (algorithm/trust.py says why there are two), and the combining rule.

Pure: no I/O, no logging, inputs left as they are. What lives across merges (members' trust scores, bans) is kept
by the caller and passed in (`history`, ban flags); the scores after this merge come back in `Aggregated.trust`.
Every member that computes it from the same bits gets the same bits.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from p2pdiloco.algorithm import robust
from p2pdiloco.algorithm.guards import FAR, TRUST, screen_parts
from p2pdiloco.algorithm.outer import weight_shares
from p2pdiloco.algorithm.trust import trust_by_history, trusted

HISTORY, MOMENTUM = "history", "momentum"
"""The trust rules (`Policy.trust`): a slice owner's moving average per member, or this merge's cosines alone."""


@dataclass(frozen=True)
class Policy:
    """How a group's parts are screened and combined.

    Args:
        rule: the combining rule (`robust.aggregate`; from `min_group` parts on for the robust ones).
        screens: apply `guards.screen_parts`; False: only the flags leave parts out (no guards).
        norm_bound: leave out parts longer than this many times the reference norm (`guards.screen_parts`); 0: off.
        min_cosine: leave out parts pointing away from the others' median (`guards.screen_parts`); -1: off.
        judge: index of the judging member, a slice's owner: the screens' reference where two parts are finite,
            and a part the history rule always counts fully; None: the smallest finite part judges (all-gathered
            parts, which every member judges alike).
        trust: '' (no trust screen), HISTORY (`trust.trust_by_history`) or MOMENTUM (`trust.trusted`).
        trust_decay: the history rule's moving-average decay.
        forked: members' global states differ (the merge holds an agreement), so their momenta do too (MOMENTUM).
        state: the parts are global models or their differences: far ones are left out under the robust rules
            (`robust.far_from_majority`), and fresh ones (weight 0) count nothing where most claim tokens.
        tie: parts are differences from an anchor every member holds: its zero breaks an even split.
        min_group: parts from which the robust rules apply.
        trim: trimmed_mean's share trimmed at each end.
    """

    rule: str = "mean"
    screens: bool = True
    norm_bound: float = 0.0
    min_cosine: float = -1.0
    judge: int | None = None
    trust: str = ""
    trust_decay: float = -1.0
    forked: bool = False
    state: bool = False
    tie: bool = False
    min_group: int = 3
    trim: float = 0.2


@dataclass(frozen=True)
class Aggregated:
    """What `aggregate` decided.

    Args:
        average: the combined parts; None where no part may count.
        shares: each member's weight among the parts combined (0 if left out). A robust rule weighs parts its own
            way (CenteredClip returns a majority's bits exactly, leaving a lone differing part nothing), which the
            share does not see.
        reasons: '' for each part that counted, else why not (a flag passed in, a screen, TRUST, FAR).
        trust: each member's trust score after this merge (HISTORY; else the history passed in).
        cosines: each part's cosine to the reference (HISTORY; else None each).
        factors: how much each part's weight counted (HISTORY; else 1 each, 0 for parts left out).
    """

    average: torch.Tensor | None
    shares: list[float]
    reasons: list[str]
    trust: list[float | None]
    cosines: list[float | None]
    factors: list[float]


def screen(parts: Sequence[torch.Tensor], flags: Sequence[str], policy: Policy) -> list[str]:
    """`flags` (why a part cannot count: banned, undecodable), then `guards.screen_parts` against the judge.

    All-gathered parts have no owner: the smallest finite part (by the flags) judges, a reference every member
    computes alike; with three or more finite parts `screen_parts` uses their median and no judge."""
    if not policy.screens:
        return list(flags)
    judge = policy.judge
    if judge is None:
        finite = [i for i, f in enumerate(flags) if not f]
        judge = min(finite, key=lambda i: float(parts[i].norm())) if finite else 0
    reasons = screen_parts(parts, judge, policy.norm_bound, policy.min_cosine)
    return [f or r for f, r in zip(flags, reasons, strict=True)]


def aggregate(parts: Sequence[torch.Tensor], weights: Sequence[float], flags: Sequence[str],
              reference: torch.Tensor | None, policy: Policy,
              history: Sequence[float | None] | None = None) -> Aggregated:
    """Screen the members' parts, weigh them by trust, and combine those that count by `policy.rule`.

    Args:
        parts: each member's fp32 part, in group order.
        weights: each member's weight (tokens), in group order.
        flags: '' or why a member's part must not count, decided before (banned, undecodable, non-finite).
        reference: the outer momentum the trust rule judges by (the owner's slice of it, or the whole vector);
            None: no trust screen.
        policy: how to screen and combine.
        history: each member's trust score before this merge (HISTORY only; None: none for anyone).

    Returns:
        The decisions (`Aggregated`); `average` is None where every part was left out.
    """
    n = len(parts)
    reasons = screen(parts, flags, policy)
    factors, trust = [1.0] * n, list(history) if history is not None else [None] * n
    cosines: list[float | None] = [None] * n
    if policy.trust == HISTORY and reference is not None:
        factors, trust, cosines = trust_by_history(parts, reasons, reference, trust, policy.trust_decay,
                                                   policy.judge or 0)
        # no strike for a low score: an honest member with unusual data can sit low for a while
        reasons = [r or (TRUST if f <= 0 else "") for r, f in zip(reasons, factors, strict=True)]
    elif policy.trust == MOMENTUM:
        reasons = trusted(list(parts), reasons, reference, policy.forked)
    keep = [i for i, r in enumerate(reasons) if not r]
    if policy.state and policy.rule in robust.ROBUST and len(keep) >= max(policy.min_group, 3):
        # a global model far from the majority's is left out, not clipped: clipped, it still pulls the agreement
        # its way at every merge (robust.far_from_majority). An honest member that merged alone for long can be
        # as far
        far = robust.far_from_majority([parts[i] for i in keep])
        reasons = [FAR if i in keep and far[keep.index(i)] else r for i, r in enumerate(reasons)]
        keep = [i for i, r in enumerate(reasons) if not r]
    factors = [0.0 if r else f for r, f in zip(reasons, factors, strict=True)]
    if not keep:
        return Aggregated(None, [0.0] * n, reasons, trust, cosines, factors)
    counted = [w * f for w, f in zip(weights, factors, strict=True)]
    if policy.state and 2 * sum(counted[i] > 0 for i in keep) > len(keep):
        # a fresh peer's θg (no tokens absorbed) counts for nothing, but only where the members that claim tokens
        # are a majority: at a run's start every honest member is fresh, and one member claiming tokens would
        # otherwise decide the swarm's model alone
        keep = [i for i in keep if counted[i] > 0]
    shares = weight_shares(counted, [i in keep for i in range(n)])
    # global models too are combined by the robust rule: where most members agree and one differs (it merged
    # alone), CenteredClip's median start and zero radius return the majority's bits exactly, and a member
    # offering a model far off (a hostile −θg) moves the result by at most the clipping radius
    tie = torch.zeros_like(parts[keep[0]], dtype=torch.float32) if policy.tie else None
    average = robust.aggregate(policy.rule, [parts[i] for i in keep], [counted[i] for i in keep], policy.min_group,
                               policy.trim, tie)
    return Aggregated(average, shares, reasons, trust, cosines, factors)


PSEUDO_GRAD, STATE, ANCHORED = "d", "s", "a"
"""What a slice holds (the all-reduce's tags): members' Δ, their (θg, momentum), or its differences from an anchor."""


def slice_policy(tag: str, owner: int, rule: str, norm_bound: float, min_cosine: float, trust_decay: float,
                 min_group: int, trim: float) -> Policy:
    """How the owner of a slice of vector `tag` combines every member's part of it.

    Only pseudo-gradients are judged by trust (a negative `trust_decay`: not at all). Differences from an anchor
    are judged by the robust rule and each member's `outer.state_within_reach` only: a member whose model is the
    anchor sends zeros, and any norm or direction reference would be arbitrary.

    Args:
        tag: PSEUDO_GRAD, STATE or ANCHORED.
        owner: the owner's index in the group.
        rule, norm_bound, min_cosine, trust_decay, min_group, trim: as in `Policy`.
    """
    anchored = tag == ANCHORED
    return Policy(rule=rule, norm_bound=0.0 if anchored else norm_bound, min_cosine=-1.0 if anchored else min_cosine,
                  judge=owner, trust=HISTORY if tag == PSEUDO_GRAD and trust_decay >= 0 else "",
                  trust_decay=trust_decay, state=tag != PSEUDO_GRAD, tie=anchored, min_group=min_group, trim=trim)


def gathered_policy(norm_bound: float, min_cosine: float, trust_decay: float, forked: bool) -> Policy:
    """How every member combines all-gathered sparse parts: screened alike on every member, trusted by this merge's
    cosines to the momentum (a negative `trust_decay`: not at all), then their weighted mean. Robust
    coordinate-wise rules do not fit sparse parts: where most members kept no value a coordinate's median is 0,
    and it would drop nearly every value sent; SparseLoCo takes the mean too."""
    return Policy(norm_bound=norm_bound, min_cosine=min_cosine, trust=MOMENTUM if trust_decay >= 0 else "",
                  trust_decay=trust_decay, forked=forked)


UNGUARDED = Policy(screens=False)
"""No guards: every part counts (the caller fails a merge with any flagged part)."""
