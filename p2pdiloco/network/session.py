"""One merge of one group, as one object: the frozen group its leader announced, what this peer brought to it, the
state of its exchange phases and their byte counters, from the moment the group forms until the merge is over.

`P2PMerger._merge` opens a `MergeSession` as soon as matchmaking returns a group and ends it when the merge is
over; the stream handlers (`AllReduce.on_part`, `SparseExchange.on_part`, `CatchUp.on_state`) find it by group id
in the peer's `Sessions`. Nothing of a merge lives on a long-lived object: two merges of this peer (its own, and
one whose late parts still arrive) never share a slot or a counter.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from p2pdiloco.network.group import OTHER_NOTICE, Group
from p2pdiloco.network.rpc import RPC_TIMEOUT_S, MergeFailed
from p2pdiloco.network.wire import ByteCounter

ENDED_KEPT = 8
"""Groups whose merge is over whose terms this peer keeps, so that a member's late part can still show that their
leader told members different groups."""

if TYPE_CHECKING:
    from p2pdiloco.network.allreduce import _Slot
    from p2pdiloco.network.catch_up import _Served
    from p2pdiloco.network.sparse_exchange import _Gathered


@dataclass
class MergeSession:
    """This peer's part in one merge of one group.

    Args:
        group: the group as its leader announced it (frozen).
        me: this peer's member index in it.
        round: this peer's round whose pseudo-gradient the merge carries (the key of injected faults).
        reference: this peer's outer momentum (flat fp32, the whole vector) as it joined this merge: what its guards
            judge members' pseudo-gradients against (guards.cosines_to); None: no reference.
    """

    group: Group
    me: int
    round: int
    reference: torch.Tensor | None = None
    slots: dict[str, _Slot] = field(default_factory=dict)
    """The sliced all-reduce's slice this peer reduces, per tag (allreduce.py)."""
    gathered: _Gathered | None = None
    """The all-gathered sparse parts of the members (sparse_exchange.py)."""
    served: _Served | None = None
    """What this peer serves, as a holder of the majority's model, to the members that fetch it (catch_up.py)."""
    phase_bytes: dict[str, ByteCounter] = field(default_factory=dict)
    """Bytes of each exchange phase, by tag ('d': Δ; 's', 'a': the agreement): a merge's phases run at once, so the
    peer's own counter alone cannot tell their bytes apart. Every frame of a phase, sent or served, is counted in
    its phase's counter too."""

    def counter(self, tag: str) -> ByteCounter:
        """The byte counter of phase `tag` (made on first use)."""
        return self.phase_bytes.setdefault(tag, ByteCounter())

    def sent(self, *tags: str) -> int:
        """Bytes this peer sent in the phases `tags` (0 for a phase this merge did not have)."""
        return sum(self.phase_bytes[t].sent for t in tags if t in self.phase_bytes)

    def received(self, *tags: str) -> int:
        """Bytes this peer received in the phases `tags` (0 for a phase this merge did not have)."""
        return sum(self.phase_bytes[t].received for t in tags if t in self.phase_bytes)


class Sessions:
    """This peer's open merge sessions, by group id: where the stream handlers find the merge a part belongs to.

    Args:
        expected_group: group id -> the group, once its notice is here; raises MergeFailed for a group this peer
            neither is in nor accepted an invite to, so that strangers cannot make it hold state
            (`Matchmaker.expected_group`).
        forget: group id -> None: the matchmaker refuses parts for that group from now on (`Matchmaker.forget`).
        told_apart: group id -> None: a member of that group acts on other terms than this peer, so their leader
            told members different groups (`Leaders.distrust_leader_of`).
    """

    def __init__(self, expected_group: Callable[[str], Awaitable[Group]], forget: Callable[[str], None],
                 told_apart: Callable[[str], None] = lambda group_id: None):
        self.expected_group, self._forget, self._told_apart = expected_group, forget, told_apart
        self._open: dict[str, asyncio.Future] = {}
        self._ended: OrderedDict[str, Group] = OrderedDict()
        """The groups of the last `ENDED_KEPT` merges this peer ended, by group id."""

    def open(self, session: MergeSession) -> MergeSession:
        """Register `session` (its group just formed): handlers waiting for its parts go on."""
        future = self._future(session.group.group_id)
        if not future.done():
            future.set_result(session)
        return session

    def end(self, group_id: str) -> None:
        """The merge of `group_id` is over: its session is dropped and parts for it are refused from now on (their
        terms are still checked: `find`)."""
        future = self._open.pop(group_id, None)
        if future is not None and future.done() and not future.cancelled() and future.exception() is None:
            self._ended[group_id] = future.result().group
            while len(self._ended) > ENDED_KEPT:
                self._ended.popitem(last=False)
        self._forget(group_id)

    async def find(self, group_id: str, sender: str = "", header: dict | None = None) -> MergeSession:
        """The session of group `group_id`. A part may arrive before this peer's own merge opened it (a member's
        notice and the first parts race): it waits for it, as long as for the group's notice.

        Args:
            group_id: the group.
            sender, header: the member that sent a part or request for it, and its header (the sender's member
                index and the terms it acts on). A member of the group acting on other terms shows that their leader
                told members different groups (`told_apart`), also where this peer's merge of it is over already:
                each member learns it from the first lie, whichever failure ended its own merge first.

        Raises:
            MergeFailed: this peer is not part of that group (any more: also when its merge of it is over).
            TimeoutError: the group's notice, or its session, did not come in time.
        """
        if header is not None and group_id in self._ended and self._other_terms(self._ended[group_id], sender, header):
            raise MergeFailed(f"the sender {OTHER_NOTICE} (its leader told members different groups)")
        await self.expected_group(group_id)  # checked first: a stranger's group id allocates nothing
        future = self._future(group_id)
        try:
            session = await asyncio.wait_for(asyncio.shield(future), RPC_TIMEOUT_S)
        except TimeoutError:
            if not future.done() and self._open.get(group_id) is future:
                del self._open[group_id]  # never opened (its merge gave up first): nothing kept for it
            raise
        if header is not None:
            self._other_terms(session.group, sender, header)
        return session

    def _other_terms(self, group: Group, sender: str, header: dict) -> bool:
        """Whether `sender`, that member of `group` its header names, acts on other terms (then said to `told_apart`).
        A stranger's header proves nothing: only a member's is counted."""
        index = header.get("index")
        if not isinstance(index, int) or not 0 <= index < len(group.members) or group.members[index] != sender:
            return False
        if header.get("terms") == group.terms:
            return False
        self._told_apart(group.group_id)
        return True

    def _future(self, group_id: str) -> asyncio.Future:
        if group_id not in self._open:
            self._open[group_id] = asyncio.get_running_loop().create_future()
        return self._open[group_id]
