"""Averaging sparse pseudo-gradients over a formed merge group: every member sends its encoded part to every other
member (an all-gather), then each member decodes all parts and averages them itself.

Why not the sliced all-reduce of allreduce.py: there an owner averages one slice of everyone's parts and sends the
average back. The average of sparse parts whose positions differ is as dense as their union, and its values are
no longer 2-bit, so sending it back would cost about as much as the parts themselves, or a second top-k of the
average (gTop-k). That halves a member's bytes, and with each member's error feedback keeping its values at the
positions the average dropped it still lost: 1.78 eval loss against 1.55 for the all-gather, and 1.65 for the
all-gather at half the density, the same bytes (4 learners, H = 10, 1000 steps; docs/experiments.md, "gTop-k").
Sending the part itself to each member costs (N − 1) parts a member, bounded by the group size; SparseLoCo (arXiv
2508.15706) all-gathers too.

Members stay bit-identical because every member decodes the same bytes (its own part too: the decoded copy of
what it sent) and runs the same function of them, in group order: the same screening, and the same weighted
mean (algorithm/aggregate.py). The screens' references are ones every member holds alike: the smallest finite
part (two parts), the others' median (three or more) and, for the trust screen (algorithm/trust.py, `trusted`), the
outer momentum, the same on every member whose global state is the same. A member's own ban list is not consulted here (members' lists differ;
banned peers are kept out of groups by matchmaking). A member that does not receive every part within the merge
timeout fails the merge, so nobody applies a partial average.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import torch

from p2pdiloco.algorithm.aggregate import UNGUARDED, aggregate, gathered_policy
from p2pdiloco.algorithm.codecs import Codec, CodecError, NonFiniteError
from p2pdiloco.algorithm.guards import NONFINITE, SHAPE, TRUST, GuardBook
from p2pdiloco.config import GuardConfig
from p2pdiloco.network.admission import Request
from p2pdiloco.network.group import Group, check_terms, part_digest
from p2pdiloco.network.merger import FaultHook
from p2pdiloco.network.peer_tag import short_id
from p2pdiloco.network.rpc import MergeFailed, Rpc
from p2pdiloco.network.session import MergeSession
from p2pdiloco.network.wire import WireError

logger = logging.getLogger(__name__)


def decode_part(codec: Codec, data: bytes, n: int) -> tuple[torch.Tensor, str]:
    """A member's part as (values, '' or why it cannot count): undecodable bytes and a non-finite scale are
    flagged, never raised, so that one bad part leaves the others' average intact."""
    try:
        part = codec.decode(data, n)
    except NonFiniteError:
        return torch.full((n,), float("nan")), NONFINITE
    except CodecError:
        return torch.full((n,), float("nan")), SHAPE
    return part, "" if bool(torch.isfinite(part).all()) else NONFINITE


def reduce_parts(parts: list[torch.Tensor], flags: list[str], weights: list[float],
                 guard: GuardConfig | None,
                 reference: torch.Tensor | None = None,
                 forked: bool = False) -> tuple[torch.Tensor, list[str], list[float]]:
    """The group's average of decoded sparse parts, as every member computes it (`aggregate.aggregate` under
    `aggregate.gathered_policy`: the parts that pass the guards and the trust screen, their weighted mean).

    Args:
        parts: each member's decoded part, in group order.
        flags: '' or why a part could not be decoded.
        weights: each member's weight (tokens of its round).
        guard: the bounds; None: no guards, and any flagged part fails the merge.
        reference: the outer momentum, for the trust screen (`trust.trusted`; off with `guard.trust_decay` < 0).
        forked: members' global states differ (the merge holds an agreement), so their momenta do too.

    Returns:
        (the average, one reason per member ('' if its part counted), each member's share of the average).

    Raises:
        MergeFailed: no part may count.
    """
    if guard is None:
        if any(flags):
            raise MergeFailed(f"undecodable or non-finite parts: {flags}")
        policy = UNGUARDED
    else:
        policy = gathered_policy(guard.norm_bound, guard.min_cosine, guard.trust_decay, forked)
    out = aggregate(parts, weights, flags, reference, policy)
    if out.average is None:
        raise MergeFailed("every part was rejected")
    return out.average, out.reasons, out.shares


def relayer_of(group: Group, member: int) -> int:
    """The member that relays to `member`, whom nobody can dial, the parts of the others nobody can dial: the members
    others can dial (`Group.slice_owners`) in turn, so that no one of them carries every such member's load."""
    owners = group.slice_owners
    undialable = [j for j in range(len(group.members)) if j not in owners]
    return owners[undialable.index(member) % len(owners)]


@dataclass
class _Gathered:
    """The encoded parts of one group's members, as they arrive; `done` resolves once all are here."""

    parts: list[bytes | None]
    done: asyncio.Future
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    def add(self, index: int, data: bytes, digests: list[str] | None = None) -> None:
        """Member `index`'s part, checked against its digest in the notice where it lists them (`digests`).

        Raises:
            MergeFailed: a second part of that member, or one other than the digest the notice lists for it.
        """
        if self.parts[index] is not None:
            raise MergeFailed(f"duplicate part from member {index}")
        if digests is not None and part_digest(data) != digests[index]:
            raise MergeFailed(f"the part of member {index} is not the one its digest in the notice names")
        self.parts[index] = data
        self.changed.set()
        if all(p is not None for p in self.parts) and not self.done.done():
            self.done.set_result(None)

    async def have(self, indices: list[int], timeout_s: float) -> list[bytes]:
        """The parts of `indices`, once all of them are here (TimeoutError after `timeout_s`)."""
        async with asyncio.timeout(timeout_s):
            while any(self.parts[i] is None for i in indices):
                self.changed.clear()
                await self.changed.wait()
        return [self.parts[i] for i in indices]


class SparseExchange:
    """All-gathers sparse parts over formed groups, and serves the parts other members send this peer.

    A member nobody can dial (behind NAT: it is not one of `Group.slice_owners`) opens every stream itself: it sends
    its part to each member others can dial, which answers with its own part, and its relayer (`relayer_of`) answers
    with the parts of the other members nobody can dial too, each checked against the digest the notice lists for
    it (`Group.part_digests`), so a relayer cannot change them. Members others can dial send to each other.

    Args:
        rpc: requests to the other members (op 'sparse').
        find_session: (group id, sender, header) -> its merge session, once it is open (see `Sessions.find`).
        codec: the sparse codec (`encoded_size` bounds a part's bytes).
        guard: bounds on received parts (None: no guards).
        book: where rejected members are counted.
        merge_timeout_s: bound on receiving one part, and on waiting for all of them.
        faults: test hook; stage 'serve_part' fires on each part received, keyed by the session's round.
    """

    def __init__(self, rpc: Rpc, find_session: Callable[..., Awaitable[MergeSession]], codec: Codec,
                 guard: GuardConfig | None, book: GuardBook, merge_timeout_s: float = 30.0,
                 faults: FaultHook | None = None):
        self.rpc, self.find_session, self.codec, self.guard, self.book = rpc, find_session, codec, guard, book
        self.merge_timeout_s, self.faults = merge_timeout_s, faults

    async def average(self, session: MergeSession, vector: torch.Tensor,
                      data: bytes | None = None) -> tuple[torch.Tensor, torch.Tensor, list[float]]:
        """Average `vector` (a pseudo-gradient) over the session's group; `data`: its encoding, if already made.

        Returns:
            (the average, as every member computes it; `vector` as the others decoded it, zero where this
            member's part was left out, for error feedback; each member's share of the average).
        """
        group, me = session.group, session.me
        n = group.lengths["d"]
        vector = vector.detach().float().contiguous().cpu()
        if vector.numel() != n:
            raise MergeFailed(f"vector of {vector.numel()} values, group expects {n}")
        data = self.codec.encode(vector) if data is None else data
        phase = session.counter("d")
        gathered = self._gathered(session)
        gathered.add(me, data, group.part_digests)
        owners = group.slice_owners
        header = {"group_id": group.group_id, "index": me, "codec": self.codec.name, "terms": group.terms}
        undialable = me not in owners
        max_reply = self.codec.encoded_size(n) * (len(group.members) - len(owners)) if undialable else 0

        async def send(j: int) -> None:
            reply, payload = await self.rpc.call(group.members[j], "sparse", header, data, max_reply, phase)
            if not reply.get("ok"):
                raise MergeFailed(f"member {short_id(group.members[j])} refused our part: {reply.get('error')}")
            if undialable:
                self._take_relayed(group, j, gathered, reply, payload)

        # a member others can dial sends only to the others who can be dialed: the rest send to it, and it answers
        await asyncio.gather(*(send(j) for j in owners if j != me))
        await asyncio.wait_for(asyncio.shield(gathered.done), self.merge_timeout_s)
        decoded = [decode_part(self.codec, p, n) for p in gathered.parts]
        parts, flags = [d[0] for d in decoded], [d[1] for d in decoded]
        average, reasons, shares = reduce_parts(parts, flags, list(group.weights_for("d")), self.guard, session.reference,
                                                forked=group.need_state)
        for i, reason in enumerate(reasons):
            if reason:
                # no strike for trust: an honest member's part can point away from the momentum in one merge
                self.book.reject(group.members[i], reason, group.group_id, "(sparse part)",
                                 strike=i != me and reason != TRUST)
            else:
                self.book.accept(group.members[i], group.group_id)
        sent = parts[me] if not reasons[me] else torch.zeros(n)
        return average, sent, shares

    @staticmethod
    def _take_relayed(group: Group, j: int, gathered: _Gathered, reply: dict, payload: bytes) -> None:
        """The parts member `j` answered a member nobody can dial with: its own, and as its relayer the other
        such members'. Each must be the one the notice's digest names (a relayer cannot change another's part)."""
        listed = reply.get("parts")
        if not isinstance(listed, list) or group.part_digests is None:
            raise MergeFailed(f"member {short_id(group.members[j])} answered without parts, or the notice lists no digests")
        offset = 0
        for entry in listed:
            if not (isinstance(entry, list) and len(entry) == 2 and all(isinstance(x, int) for x in entry)
                    and 0 <= entry[0] < len(group.members) and entry[1] >= 0):
                raise MergeFailed(f"member {short_id(group.members[j])} answered a malformed list of parts")
            index, size = entry
            if gathered.parts[index] is None:
                gathered.add(index, payload[offset:offset + size], group.part_digests)
            offset += size
        if offset != len(payload):
            raise MergeFailed(f"member {short_id(group.members[j])} answered {len(payload)} bytes, its list says {offset}")

    def _gathered(self, session: MergeSession) -> _Gathered:
        if session.gathered is None:
            session.gathered = _Gathered([None] * len(session.group.members), asyncio.get_running_loop().create_future())
        return session.gathered

    async def on_part(self, request: Request, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Another member's encoded part: read only once the header names a group and member this peer expects a
        part from, and only up to the codec's bound for the group's vector length. A member nobody can dial gets
        this peer's own part in the reply, and from its relayer the other such members' parts too."""
        sender, header, phase = request.sender, request.header, None
        reply, payload = {"ok": False}, b""
        try:
            gid, index = header.get("group_id"), header.get("index")
            if not isinstance(gid, str) or not isinstance(index, int):
                raise MergeFailed("malformed part header")
            if header.get("codec") != self.codec.name:
                raise MergeFailed(f"part encoded with {header.get('codec')!r}, this peer merges with {self.codec.name!r}")
            session = await self.find_session(gid, sender, header)
            group = session.group
            if not 0 <= index < len(group.members) or group.members[index] != sender:
                raise MergeFailed("sender is not that member of the group")
            check_terms(group, header)
            phase = session.counter("d")
            gathered = self._gathered(session)
            if gathered.parts[index] is not None:
                raise MergeFailed(f"duplicate part from member {index}")
            data = await self.rpc.receive_payload(reader, self.codec.encoded_size(group.lengths["d"]),
                                                  self.merge_timeout_s, exact=False, phase=phase)
            if self.faults is not None:
                await self.faults.fire("serve_part", session.round, short_id(self.rpc.peer_id))
            gathered.add(index, data, group.part_digests)
            reply = {"ok": True}
            if index not in group.slice_owners:  # it cannot be dialed: it gets what it needs from this answer
                indices = self._answer_for(group, session.me, index)
                parts = await gathered.have(indices, self.merge_timeout_s)
                reply["parts"] = [[i, len(p)] for i, p in zip(indices, parts, strict=True)]
                payload = b"".join(parts)
        except (MergeFailed, TimeoutError, WireError) as e:
            reply, payload = {"ok": False, "error": f"{type(e).__name__}: {e}"}, b""
        await self.rpc.reply(reader, writer, "sparse", sender, reply, payload, phase=phase)

    @staticmethod
    def _answer_for(group: Group, me: int, member: int) -> list[int]:
        """The parts this peer answers `member` (nobody can dial it) with: its own, and as its relayer those of the
        other members nobody can dial."""
        if relayer_of(group, member) != me:
            return [me]
        owners = group.slice_owners
        return [me] + [j for j in range(len(group.members)) if j not in owners and j != member]
