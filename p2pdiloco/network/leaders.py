"""Who leads a group of ready mates: an order nobody knows before the epoch's nonces are revealed, and leaders
that never invite, or tell members different groups, passed over.

Groups are dealt by `census.leader_rank`, a public hash that an id can be ground to rank first in. Who leads is
drawn instead from secrets the mates committed to in the census before the epoch (census.py, "Commitments"):
a mate's ready word reveals its nonce for the epoch, checked against its commitment, and the ready mates that
revealed one are ordered by `census.lead_rank` over the XOR of every nonce the mates revealed. An id committed to
its nonce before it could see the others', so it cannot choose to rank first; its one choice left is to reveal
nothing, and then it does not lead. Mates without a checked nonce (a peer in its first epoch, a commitment read
too late) are invited, and lead only where no mate with one can.

Mates that saw different sets of reveals (a ready word still on its way) may draw different leaders for a while:
an invite from either is accepted, as at epoch edges, so that costs at most a smaller group. At an epoch's turn
every mate has its own nonce for the new epoch at once and the others' one ready word later: each would rank itself
first and lead, and leaders decline each other's invites. So for `REVEAL_WAIT_S` into an epoch a ready mate that
committed to a nonce for it, and whose ready word for it has not come yet, is followed first (`order`): its reveal
is on its way, and the mates draw one order once it is here. A leader that never
invites is passed over for the rest of the epoch (its place in the order stays the same all epoch), and for
`SILENT_ROUNDS` searches at least (one that ended a search without inviting, for those searches: see `follow`); one that told its members different groups is too, and its invites are
declined as long (`distrust`).
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from collections.abc import Callable

from p2pdiloco.network.census import COMMIT_BYTES, Census, commitment, lead_rank
from p2pdiloco.network.peer_tag import short_id
from p2pdiloco.network.search import Search

logger = logging.getLogger(__name__)

INVITE_SLACK_S = 0.25
"""A ready word that reached a leader this long before its deadline or earlier should have had an invite: a leader
looks at its mates' words at least this often (matchmaking's `POLL_S`)."""
REVEAL_WAIT_S = 2.0
"""How long into an epoch (from this peer's first look at it) a ready mate whose reveal for the epoch is still on its
way is waited for before this peer leads: its ready word follows its clock's turn by one request."""
SILENT_ROUNDS = 3
"""A leader that never invited is passed over for this many of this peer's searches, or to the end of the epoch
it was silent in if that is longer."""


class Leaders:
    """The order in which ready mates lead, from their revealed nonces, and the leaders passed over.

    Args:
        run_id: the swarm's run id.
        census: this peer's census: its own nonces and the commitments it counts for others.
        shunned: whether a mate may not lead here (this peer refuses its streams: `StreamGate.refusing`).
    """

    def __init__(self, run_id: str, census: Census, shunned: Callable[[str], bool] = lambda peer: False):
        self.run_id, self.census, self.shunned = run_id, census, shunned
        self._nonces: dict[str, dict[int, bytes]] = {}
        """Mates' revealed nonces, not yet checked: peer id -> epoch -> nonce, for the two latest epochs each
        revealed for (a search still in an epoch hears the next one's nonce from a mate whose clock turned first)."""
        self._heard_in: dict[str, int] = {}
        """The epoch of each mate's last ready word."""
        self._began = (-1, 0.0)
        """(epoch, when this peer first drew an order in it: monotonic)."""
        self._passed: dict[str, tuple[int, int]] = {}
        """Leaders that never invited us: peer id -> (searches left in which they are not followed, epoch)."""
        self._slipped: dict[str, int] = {}
        """Leaders that ended a search without inviting this peer (`follow`): peer id -> the epoch it last happened."""
        self._distrusted: dict[str, tuple[int, int]] = {}
        """Leaders that told this peer's group different groups: the same, and their invites are declined."""
        self._joined: tuple[str, str, int] = ("", "", 0)
        """(group id, leader, epoch) of the last group this peer joined as a member."""
        self.told_apart: deque[str] = deque(maxlen=8)
        """Groups of this peer whose members were told different groups: a part for one is refused saying so, and its
        sender distrusts their leader too (the merge of this peer, told apart first, is over already)."""

    def reveal(self, epoch: int) -> dict[str, bytes]:
        """The ready word's fields that reveal this peer's nonce for `epoch` (none in its first epoch)."""
        nonce = self.census.reveal(epoch)
        return {} if nonce is None else {"nonce": nonce}

    def heard(self, peer: str, header: dict) -> None:
        """A mate's ready word: keep the nonce it reveals for its epoch (checked when the order is drawn)."""
        epoch, nonce = header.get("epoch"), header.get("nonce")
        if isinstance(epoch, int):
            self._heard_in[peer] = max(epoch, self._heard_in.get(peer, epoch))
        if isinstance(epoch, int) and isinstance(nonce, bytes) and len(nonce) == COMMIT_BYTES:
            kept = self._nonces.setdefault(peer, {})
            kept[epoch] = nonce
            for old in sorted(kept)[:-2]:
                del kept[old]

    def nonce(self, peer: str, epoch: int) -> bytes | None:
        """`peer`'s nonce for `epoch` if it revealed one that matches the commitment this peer counts for it."""
        if peer == self.census.peer_id:
            return self.census.nonce(epoch) if self.census.commit(peer, epoch) is not None else None
        revealed, committed = self._nonces.get(peer, {}).get(epoch), self.census.commit(peer, epoch)
        if revealed is None or committed is None:
            return None
        return revealed if commitment(revealed) == committed else None

    def order(self, mates: list[str], ready: set[str], epoch: int) -> list[str]:
        """The ready `mates` (in dealt order) in the order they lead in `epoch`: those with a checked nonce by
        `lead_rank` over the XOR of the checked nonces of all `mates`, ready now or not, then the others in dealt
        order; shunned mates lead nowhere (their nonces still count). For `REVEAL_WAIT_S` into the epoch, ready
        mates whose reveal is on its way (`_awaited`) come first.

        The mix takes every mate's nonce heard this epoch, not only the ready ones': mates see each other start and
        stop looking at different times, so a mix over the ready mates alone would draw a different leader in each
        view and split a group whose members are all ready (a mate between two of its searches is enough). Over
        every reveal, the mix changes only when a mate reveals for the first time in the epoch: mates that heard the
        same reveals agree on the order all epoch, and a leader passed over keeps its place in it."""
        self._nonces = {p: kept for p, kept in self._nonces.items() if max(kept) >= epoch - 1}
        nonces = {p: n for p in mates if (n := self.nonce(p, epoch)) is not None}
        mix = bytes(COMMIT_BYTES)
        for n in nonces.values():
            mix = bytes(a ^ b for a, b in zip(mix, n, strict=True))
        first = sorted((p for p in nonces if p in ready), key=lambda p: lead_rank(self.run_id, p, epoch, mix))
        rest = [p for p in mates if p in ready and p not in nonces]
        awaited = self._awaited(rest, epoch)
        return [p for p in awaited + first + [p for p in rest if p not in awaited] if not self.shunned(p)]

    def _awaited(self, unchecked: list[str], epoch: int) -> list[str]:
        """The mates of `unchecked` (ready, no checked nonce for `epoch`) whose reveal is on its way: they committed to
        a nonce for `epoch` and their last ready word was for an earlier one. None after `REVEAL_WAIT_S` into the
        epoch: a mate that never says it is looking in the new epoch delays nobody longer, and leads last."""
        if self._began[0] != epoch:
            self._began = (epoch, time.monotonic())
            self._heard_in = {p: e for p, e in self._heard_in.items() if e >= epoch - 1}
        if time.monotonic() - self._began[1] >= REVEAL_WAIT_S:
            return []
        return [p for p in unchecked if p != self.census.peer_id and self._heard_in.get(p, epoch) < epoch
                and self.census.commit(p, epoch) is not None]

    def new_search(self, epoch: int) -> set[str]:
        """A search in `epoch` starts: the leaders it passes over for their count of searches (one of which it uses
        up)."""
        counted = {p for p, (n, _) in self._passed.items() if n > 0}
        self._passed = {p: (n - 1, e) for p, (n, e) in self._passed.items() if n > 1 or e >= epoch}
        self._distrusted = {p: (n - 1, e) for p, (n, e) in self._distrusted.items() if n > 1 or e >= epoch}
        self._slipped = {p: e for p, e in self._slipped.items() if e >= epoch}
        return counted

    def passed_over(self, peer: str, counted: set[str], epoch: int) -> bool:
        """Whether a search in `epoch` that began with `counted` (`new_search`) does not follow `peer`."""
        return peer in counted or self._passed.get(peer, (0, None))[1] == epoch

    def pass_over(self, peer: str, epoch: int) -> None:
        """`peer` was followed in `epoch` and never invited: not followed again this epoch, nor in the next
        `SILENT_ROUNDS` searches."""
        logger.debug("[%s] passing over %s this epoch (%d)", short_id(self.census.peer_id), short_id(peer), epoch)
        self._passed[peer] = (SILENT_ROUNDS, epoch)

    def distrust(self, peer: str, epoch: int) -> None:
        """`peer` led a group of this peer in `epoch` whose members it told different groups (their merge failed):
        passed over as a silent leader is, and its invites declined for as long, so that it costs its group one
        merge, not one a search. A member that sent a part under forged terms makes its group distrust an honest
        leader the same way: that leader's invites are declined a while, and another mate leads."""
        self.pass_over(peer, epoch)
        self._distrusted[peer] = (SILENT_ROUNDS, epoch)

    def joined(self, group_id: str, leader: str, epoch: int) -> None:
        """This peer joined `leader`'s group `group_id` in `epoch`, as a member."""
        self._joined = (group_id, leader, epoch)

    def distrust_leader_of(self, group_id: str) -> None:
        """The merge of `group_id` failed because its members were told different groups: if another peer led it,
        that leader is distrusted (`distrust`)."""
        gid, leader, epoch = self._joined
        if gid == group_id and leader and gid not in self.told_apart:
            self.told_apart.append(gid)
            self.distrust(leader, epoch)
            logger.warning("[%s] leader %s told members of group %s different groups: not followed for a while",
                           short_id(self.census.peer_id), short_id(leader), group_id)

    def follow(self, search: Search, followed: str, leader: str | None, ready: set[str],
               deadlines: dict[str, float], silent: set[str]) -> str:
        """The mate a search waits for an invite from now: `leader`, unless None (this peer leads, or nobody can).

        Args:
            search: the search.
            followed: the mate it waited for at its last poll ('' if none). If that mate ended its search without
                inviting this peer (it stopped looking, or its next search's word came) although this peer's ready
                word reached it before its deadline (an honest leader invites every mate ready by then), it is not
                followed for the rest of this search (added to `silent`) nor in the next `SILENT_ROUNDS` searches;
                not for the rest of the epoch, as a leader that outlived its deadline without inviting is
                (`pass_over`): an invite lost on a loaded link must not make this peer lead beside an honest leader,
                splitting their mates, all epoch. The second time in an epoch, it is passed over to the epoch's end.
                Its next search's word is looked at too, not only its stop: the two travel as separate requests, so
                mates saw one or the other first, and those that saw the stop passed it over while the others
                followed it on; each then passed over the other's leader. One whose group formed before this peer
                was ready is not at fault, and is followed still.
            leader: the mate first in the order that this search may follow.
            ready: the mates ready now.
            deadlines: the deadlines the ready mates announced (DHT time).
            silent: mates this search no longer follows.
        """
        ended = followed not in ready if followed != leader else deadlines.get(followed) != search.followed_deadline
        if (followed and followed not in silent and ended
                and search.acked.get(followed, math.inf) < search.followed_deadline - INVITE_SLACK_S):
            silent.add(followed)
            again = self._slipped.get(followed) == search.epoch
            self._slipped[followed] = search.epoch
            self._passed[followed] = (SILENT_ROUNDS, search.epoch if again else self._passed.get(followed, (0, -1))[1])
            logger.debug("[%s] %s ended a search without inviting: passed over%s", short_id(self.census.peer_id),
                         short_id(followed), " this epoch" if again else "")
        if leader is None:
            return ""
        if leader != followed:
            logger.debug("[%s] following %s (epoch %d)", short_id(self.census.peer_id), short_id(leader), search.epoch)
        search.followed_deadline = deadlines.get(leader, 0.0)
        return leader

    def distrusted(self, peer: str, epoch: int) -> bool:
        """Whether `peer`'s invites are declined in a search in `epoch` (`distrust`)."""
        n, e = self._distrusted.get(peer, (0, None))
        return n > 0 or e == epoch
