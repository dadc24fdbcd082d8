"""A merge group as its leader announced it, and the checks a member makes of that announcement (the notice).

The leader writes one notice for the whole group. A member acts on it only if it is well formed, carries this
member's own claims unchanged (weights, global-model digest, an anchor it holds), and says the members' global
models differ (`need_state`) exactly when the digests it lists do (`valid_notice`, `own_claims_kept`).

A leader could still tell each member a different group: other weights, other members, `need_state` false to one
and true to another. So every part of the merge carries the digest of the notice its sender acts on
(`Group.terms`), and a part sent under other terms is refused (`check_terms`): such a merge fails for the members
told different things, who merge alone, instead of averaging under terms they never agreed on.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from dataclasses import dataclass, field
from functools import cached_property

from p2pdiloco.algorithm.guards import bounded_weights
from p2pdiloco.network.merger import Contribution
from p2pdiloco.network.rpc import MergeFailed
from p2pdiloco.util.numbers import finite_number


@dataclass(frozen=True)
class Group:
    """A formed merge group, as its leader announced it (frozen: what a merge does with it is its session's,
    session.py)."""

    group_id: str
    members: list[str]
    """Peer ids in group order; member j owns one slice of every vector averaged (allreduce.owned_slice)."""
    weights: list[float]
    """Each member's weight in the average of Δ (tokens of its round)."""
    state_weights: list[float]
    """Each member's weight in the average of (θg, momentum) (tokens its θg has absorbed)."""
    need_state: bool
    """The members' global models differ: (θg, momentum) is averaged too."""
    lengths: dict[str, int]
    """Vector length per tag: 'd' for the pseudo-gradient, 's' for (θg, momentum)."""
    final: bool = False
    """A member is finishing its run (see `Merged.final`)."""
    anchor: str = ""
    """A state all hold (`Contribution.anchors`): differences from it travel int8 (tag 'a'); '': fp32 (tag 's')."""
    digests: list[str] = field(default_factory=list)
    """Each member's global-model digest as it offered it; `need_state` is whether they differ."""
    owners: list[int] | None = None
    """Indices of the members that own slices: those others can dial (network/reachability.py), since every member
    opens a stream to each owner and a member nobody can dial could not receive its slice's parts. The leader is
    always one. None: every member (a group whose members all said they can be dialed)."""
    part_digests: list[str] | None = None
    """Each member's encoded sparse part's digest (`part_digest`), as it offered it: a part relayed to a member
    nobody can dial by another member is checked against it (sparse_exchange.py). None: not given (sliced codecs)."""

    def __post_init__(self) -> None:
        # claims, as every member counts them: the same function of the same notice on every member
        object.__setattr__(self, "weights", bounded_weights(self.weights))
        object.__setattr__(self, "state_weights", bounded_weights(self.state_weights))

    @cached_property
    def terms(self) -> str:
        """Digest of everything the members must agree on to merge together: the same on every member that acts on
        the same notice, different on a member told another group."""
        terms = [self.group_id, self.members, self.weights, self.state_weights, self.need_state, self.final,
                 self.anchor, self.digests]
        if self.owners is not None:
            terms.append(self.owners)
        if self.part_digests is not None:
            terms.append(self.part_digests)
        return hashlib.blake2b(json.dumps(terms).encode(), digest_size=16).hexdigest()

    @cached_property
    def majority(self) -> str:
        """The global-model digest more than half the members offered, where their models differ ('' if none, or if
        they do not differ): the agreement is then that model, and the others fetch it (catch_up.py).

        Counted as the robust rule counts models (slice_guard.SliceGuard.reduce): members whose θg absorbed no
        tokens (fresh peers) are left out where those that did are a majority, so that two fresh peers do not
        outvote a trained one on it; a majority that agrees exactly is the rule's answer, whatever the weights."""
        if not self.need_state or not self.digests:
            return ""
        voters = [d for d, w in zip(self.digests, self.state_weights, strict=True) if w > 0]
        if 2 * len(voters) <= len(self.digests):
            voters = list(self.digests)
        digest, count = Counter(voters).most_common(1)[0]
        return digest if 2 * count > len(voters) else ""

    @property
    def slice_owners(self) -> list[int]:
        """Indices of the members that own slices, in group order."""
        return list(range(len(self.members))) if self.owners is None else list(self.owners)

    def agreed_state_weight(self) -> float:
        """What the group's agreed θg stands for, in tokens: the lower median of the members' (capped) claims, so
        that no member's claim, however large, inflates every member's counter."""
        claims = sorted(self.state_weights)
        return claims[(len(claims) - 1) // 2] if claims else 0.0

    def weights_for(self, tag: str) -> list[float]:  # 'd': Δ; 's', 'a': (θg, momentum)
        return self.weights if tag == "d" else self.state_weights


def group_of_notice(h: dict, lengths: dict[str, int]) -> Group:
    """The group a notice announces (the leader's own, and a member's once `valid_notice` holds)."""
    return Group(str(h["group_id"]), [str(m) for m in h["members"]], [float(w) for w in h["weights"]],
                 [float(w) for w in h["state_weights"]], bool(h["need_state"]), dict(lengths), h.get("final") is True,
                 str(h.get("anchor", "")), digests=[str(d) for d in h["digests"]], owners=h.get("owners"),
                 part_digests=h.get("parts"))


def part_digest(data: bytes) -> str:
    """The digest of a member's encoded part, as its invite reply and the group notice carry it."""
    return hashlib.blake2b(data, digest_size=16).hexdigest()


OTHER_NOTICE = "acts on another notice of this group"
"""In the failure of a merge whose members were told different groups: its leader is not followed for a while."""


def check_terms(group: Group, header: dict) -> None:
    """A part's header names the terms of the group its sender acts on: they must be this peer's.

    Raises:
        MergeFailed: the sender was told another group.
    """
    if header.get("terms") != group.terms:
        raise MergeFailed(f"the sender {OTHER_NOTICE} (its leader told members different groups)")


def valid_notice(h: dict, me: str, group_size: int) -> bool:
    """A notice well formed enough to act on: bounded (but for a run's last merges), finite non-negative claims,
    unique members including this peer, one digest per member, and `need_state` as the digests say."""
    members, weights, sw, digests = h.get("members"), h.get("weights"), h.get("state_weights"), h.get("digests")
    return (
        isinstance(members, list) and isinstance(weights, list) and isinstance(sw, list) and isinstance(digests, list)
        and 2 <= len(members) == len(weights) == len(sw) == len(digests)
        and (len(members) <= group_size or h.get("closing") is True)
        and all(isinstance(m, str) for m in members + digests)
        and len(set(members)) == len(members) and me in members
        and all(finite_number(w) and w >= 0 for w in weights + sw)
        and h.get("need_state") is (len(set(digests)) > 1)
        and valid_owners(h.get("owners"), len(members))
        and (h.get("parts") is None or (isinstance(h["parts"], list) and len(h["parts"]) == len(members)
                                        and all(isinstance(p, str) for p in h["parts"])))
    )


def valid_owners(owners: object, n_members: int) -> bool:
    """A notice's `owners`: absent (every member owns a slice), or unique member indices in group order that
    include the leader (index 0)."""
    return owners is None or (
        isinstance(owners, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in owners)
        and owners == sorted(set(owners)) and owners[:1] == [0] and owners[-1] < n_members)


def own_claims_kept(h: dict, me: str, c: Contribution, dialable: bool = True, part: str = "") -> bool:
    """The leader wrote down this peer's weights and digest as this peer offered them (it could raise or zero the
    weights, or make the group skip or force an agreement), names an anchor this peer holds, or none, makes
    this peer own a slice only if others can dial it (`dialable`: what it told the leader), and lists the digest
    of its sparse part as it offered it (`part`; '' where it offered none)."""
    i = h["members"].index(me)
    return (float(h["weights"][i]) == float(c.weight) and float(h["state_weights"][i]) == float(c.state_weight)
            and h["digests"][i] == c.state_digest and h.get("anchor", "") in ("", *c.anchors)
            and (dialable or i not in (h.get("owners") or range(len(h["members"]))))
            and (not part or h.get("parts") is None or h["parts"][i] == part))
