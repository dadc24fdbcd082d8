"""Who in a peer's merge groups can be dialed: this peer (the dial-back check's verdict, network/reachability.py)
and its mates (what each said in its `ready` and invite reply).

Every stream of a merge is opened by a member towards the leader or a slice owner, or by the leader towards a member
whose `ready` opened a connection to it. So a peer that others cannot dial (behind NAT) never leads and owns no
slice; it says so (`dialable: false`) and opens every stream itself. What a mate says of itself only takes duties
away from it: a mate that says it cannot be dialed is never followed and given no slice; one that claims it can but
cannot is a leader that never invites, passed over as any silent leader is (matchmaking.py).
"""

from __future__ import annotations

import asyncio
import logging

from p2pdiloco.network.peer_tag import PeerLog

logger = logging.getLogger(__name__)

class Dialability:
    """This peer's and its mates' dialability, as the matchmaker uses it.

    Args:
        me: this peer's id.
    """

    def __init__(self, me: str):
        self.me = me
        self.log = PeerLog(logger, me)
        self.own = True
        """Whether other peers can open connections to this one (the check's verdict; with no check, yes)."""
        self.known = asyncio.Event()
        """Set once `own` holds the check's first verdict, or when no check is expected."""
        self.known.set()
        self.undialable: set[str] = set()
        """Mates that said others cannot dial them."""
        self._warned = False

    def expect_verdict(self) -> None:
        """A dial-back check is under way: until its verdict this peer takes part as one nobody can dial (`dialable`).
        Its searches need not wait for the verdict (a dial into NAT takes 3 s to time out, longer than a short
        round): a peer that others can in fact dial loses nothing in a group but the chance to lead it."""
        self.known.clear()

    def set(self, dialable: bool) -> None:
        """The check's verdict (call on the matchmaker's loop)."""
        self.own = dialable
        self.known.set()

    @property
    def dialable(self) -> bool:
        """Whether this peer acts as one others can dial: the check said so, or no check is expected."""
        return self.own and self.known.is_set()

    def can_lead(self, peer: str) -> bool:
        """A leader dials every member: only a peer others can dial leads (it said so, or it is this peer)."""
        return self.dialable if peer == self.me else peer not in self.undialable

    def says(self, fields: dict) -> dict:
        """`fields` (a `ready` header or an invite reply) with this peer's word that nobody can dial it, if so (or
        not yet known)."""
        return fields if self.dialable else {**fields, "dialable": False}

    def heard(self, peer: str, header: dict) -> None:
        """A mate's `ready` header: whether it said others cannot dial it."""
        if header.get("dialable") is False:
            self.undialable.add(peer)
        else:
            self.undialable.discard(peer)

    def member_dialable(self, peer: str, reply: dict) -> bool:
        """Whether an invited mate can own a slice: it did not say otherwise, now or in its `ready`."""
        return reply.get("dialable") is not False and peer not in self.undialable

    def nobody_leads(self, ready_mates: int, unreachable_mates: int) -> None:
        """Once: this peer merges alone because neither it nor any ready mate can be dialed and the mates it could
        not tell it was looking are out of its reach, so nobody can lead. Not said while its own verdict is still
        to come, nor where no mate was ready and none out of reach (they were simply not ready in its window)."""
        if not self._warned and self.known.is_set() and (ready_mates or unreachable_mates):
            self._warned = True
            self.log.warning("merging alone: nobody can dial this peer nor any of its %d ready mates (%d more mates "
                             "out of its reach), so none of them can lead a group; a peer others can dial must join "
                             "the swarm (docs/operations.md, Behind a home router)", ready_mates, unreachable_mates)
