"""Averaging one vector over a formed merge group: a reduce-scatter then all-gather over p2p streams.

As in a butterfly all-reduce, each member owns one slice of the vector (which one changes from merge to merge:
`owned_slice`), receives that slice from every member, and only when it holds all of them sends back the average. A member uses the result only if it received *every*
averaged slice, so a member that dies mid-merge makes the merge fail, and never leaves anyone a partial
average (the silent failure mode of hivemind's all-reduce with `next_chunk_timeout`, see DESIGN.md). Every
member that succeeds holds the same bits, because each slice is averaged once, by its owner, and the owner
keeps the decoded copy of what it sends.

What an owner does with the parts it receives (screen them, combine them robustly) and what a member accepts
back is a `SliceReducer`'s business, given to the all-reduce; `PlainReducer` is the unguarded mean. With each
averaged slice the owner tells the member its share of that average (0 if its part was left out): a member
cannot see from the averaged bits whether its own part counted, and goodput must know (bench/goodput.py).
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from p2pdiloco.algorithm.codecs import Codec, CodecError, NonFiniteError, as_held
from p2pdiloco.algorithm.outer import weight_shares, weighted_average
from p2pdiloco.network.admission import Request
from p2pdiloco.network.group import Group, check_terms
from p2pdiloco.network.merger import FaultHook
from p2pdiloco.network.peer_tag import short_id
from p2pdiloco.network.rpc import RPC_TIMEOUT_S, MergeFailed, Rpc
from p2pdiloco.network.session import MergeSession
from p2pdiloco.network.wire import WireError
from p2pdiloco.util.numbers import finite_number

logger = logging.getLogger(__name__)


def slice_bounds(length: int, parts: int) -> list[tuple[int, int]]:
    """The wire layout of a vector averaged by `parts` members: [start, end) of each member's slice.

    Exactly `torch.tensor_split`'s sections (the first `length % parts` one value longer), which is how
    `AllReduce` cuts the vector; every member must cut alike. Computed on the meta device: no memory.
    """
    sizes = [s.numel() for s in torch.tensor_split(torch.empty(length, device="meta"), parts)]
    return [(end - size, end) for size, end in zip(sizes, itertools.accumulate(sizes), strict=True)]


def owned_slice(group_id: str, member: int, parts: int) -> int:
    """Which slice member `member` of a group of `parts` members owns: slice (member + r) mod parts, with r drawn
    from the group id, so that the same members own different slices from merge to merge.

    An owner judges its slice's parts against its own momentum and keeps a trust score per member
    (guards.GuardBook.observe); rotated, that score averages over every part of the vector. An honest peer with
    unusual data can point against the swarm on some slices (measured: the bench's last shard, on 2 of 5 slices,
    for the second half of a run) but not on all of them, as a sign-flipping peer does.
    """
    r = int.from_bytes(hashlib.sha256(group_id.encode()).digest()[:8], "big")
    return (member + r) % parts


def slices_owned(group: Group) -> dict[int, int]:
    """{member index: the slice it owns} for the group's slice owners (`Group.slice_owners`): the vector is cut into
    one slice per owner, and owner number p (in group order) owns slice `owned_slice(group_id, p, owners)`. Where
    every member owns one, member j owns `owned_slice(group_id, j, members)`."""
    owners = group.slice_owners
    return {j: owned_slice(group.group_id, p, len(owners)) for p, j in enumerate(owners)}


def group_slice(group: Group, tag: str, member: int) -> tuple[int, int]:
    """[start, end) of the slice of vector `tag` that member `member` of `group` owns.

    Raises:
        MergeFailed: that member owns no slice.
    """
    owned = slices_owned(group)
    if member not in owned:
        raise MergeFailed(f"member {member} owns no slice of this group")
    return slice_bounds(group.lengths[tag], len(owned))[owned[member]]


def by_values(per_slice: list[float], length: int) -> float:
    """A figure given per slice (a member's share of each slice's average) as its mean over the vector's values:
    slices differ in length by one, and a figure of the whole vector must not count a short slice as long."""
    bounds = slice_bounds(length, len(per_slice))
    return sum(x * (hi - lo) for x, (lo, hi) in zip(per_slice, bounds, strict=True)) / length if length else 0.0


class SliceReducer(Protocol):
    """The policy of an all-reduce: which parts count, how they combine, which averages are accepted."""

    def admit(self, group: Group, sender: str, decode: Callable[[], torch.Tensor], n: int) -> tuple[torch.Tensor, str]:
        """A received part, decoded by `decode()`, as (values of length n, flag: '' or why it must not count).

        Raises:
            MergeFailed: the part fails the whole merge.
        """

    def reduce(self, group: Group, tag: str, me: int, parts: list[torch.Tensor], weights: list[float],
               flags: dict[int, str], reference: torch.Tensor | None = None) -> tuple[torch.Tensor, list[float]]:
        """The owner's average of its slice, and each member's share of it (`weight_shares` of the parts used:
        0 for a part left out); flags: {member index: reason} decided on arrival; reference: this peer's outer
        momentum, the whole vector (`MergeSession.reference`).

        Raises:
            MergeFailed: no average can be given.
        """

    def accept(self, group: Group, owner: int, averaged: torch.Tensor, mine: torch.Tensor) -> None:
        """Check the average member `owner` returned for its slice against this peer's own part `mine`.

        Raises:
            MergeFailed: it must not be applied.
        """


class PlainReducer:
    """No guards: every part counts, the average is the weighted mean, finite parts and averages only."""

    def admit(self, group: Group, sender: str, decode: Callable[[], torch.Tensor], n: int) -> tuple[torch.Tensor, str]:
        try:
            part = decode()
        except CodecError as e:
            raise MergeFailed(f"bad part from {short_id(sender)}: {e}") from None
        if not torch.isfinite(part).all():
            raise MergeFailed(f"non-finite values from {short_id(sender)}")
        return part, ""

    def reduce(self, group: Group, tag: str, me: int, parts: list[torch.Tensor], weights: list[float],
               flags: dict[int, str], reference: torch.Tensor | None = None) -> tuple[torch.Tensor, list[float]]:
        return weighted_average(parts, weights), weight_shares(weights)

    def accept(self, group: Group, owner: int, averaged: torch.Tensor, mine: torch.Tensor) -> None:
        pass


class AverageRefused(MergeFailed):
    """This peer's guards refused the average an owner returned for its slice (`SliceReducer.accept`)."""


@dataclass
class _Slot:
    """The slice of one vector that this peer reduces for its group.

    `result` resolves to (averaged slice as every member will decode it, its encoded bytes, each member's share
    of it, the exact average before the codec): the owner keeps the decoded copy, not its exact average, so that
    all members hold the same bits; the exact one is only for its error feedback (`codecs.as_held`).
    """

    weights: list[float]
    parts: list[torch.Tensor | None]
    result: asyncio.Future
    codec: Codec
    """How the average travels back to the members (and how they decode it)."""
    reduce: Callable[[list, list, dict], tuple[torch.Tensor, list[float]]]
    """(parts, weights, flags) -> (the averaged slice, each member's share of it); flags: {member index: reason}
    decided on arrival."""
    flags: dict[int, str] = field(default_factory=dict)
    claimed: set[int] = field(default_factory=set)
    """Members whose part is being received or is here."""

    def claim(self, index: int) -> None:
        """A stream carrying member `index`'s part arrived: it is the only one read."""
        if index in self.claimed or self.parts[index] is not None:
            raise MergeFailed(f"duplicate part from member {index}")
        self.claimed.add(index)

    def unclaim(self, index: int) -> None:
        """Member `index`'s part did not arrive on the stream that claimed it."""
        if self.parts[index] is None:
            self.claimed.discard(index)

    def add(self, index: int, part: torch.Tensor, flag: str = "") -> None:
        if self.parts[index] is not None:
            raise MergeFailed(f"duplicate part from member {index}")
        self.parts[index] = part
        if flag:
            self.flags[index] = flag
        if all(p is not None for p in self.parts) and not self.result.done():
            try:
                average, shares = self.reduce(self.parts, self.weights, self.flags)
            except MergeFailed as e:
                self.result.set_exception(e)
                return
            data = self.codec.encode(average)
            self.result.set_result((self.codec.decode(data, average.numel()), data, shares, average))


class AllReduce:
    """Averages vectors over formed groups, and serves the slices this peer owns.

    Args:
        rpc: requests to the other members (op 'part').
        find_session: (group id, sender, header) -> its merge session, once it is open (raises MergeFailed for a
            group this peer is not part of, or no longer merges); see `Sessions.find`.
        codecs: how the slices of each tag travel: {'d': pseudo-gradient codec, 's': (θg, momentum) codec}.
        reducer: what an owner does with the parts of its slice, and what a member accepts back.
        merge_timeout_s: bound on receiving one part's payload, and on waiting for a slice's average.
        faults: test hook; stage 'serve_part' fires on each part received from another member, keyed by the
            session's round.
    """

    def __init__(self, rpc: Rpc, find_session: Callable[..., Awaitable[MergeSession]], codecs: dict[str, Codec],
                 reducer: SliceReducer | None = None, merge_timeout_s: float = 30.0, faults: FaultHook | None = None):
        self.rpc, self.find_session, self.codecs = rpc, find_session, codecs
        self.reducer = reducer or PlainReducer()
        self.merge_timeout_s, self.faults = merge_timeout_s, faults

    async def average(self, session: MergeSession, tag: str,
                      vector: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, list[float]]:
        """Average `vector` over the session's group.

        Returns:
            (the average, as every member holds it; `vector` as the group's average took it, for error feedback:
            each slice as the others received it through the codec, and this peer's own slice less the rounding
            of its average on the way back (`codecs.as_held`); this peer's share of each slice's average as its
            owner counted it, 0 where its part was left out).
        """
        group, me = session.group, session.me
        vector = vector.detach().float().contiguous().cpu()
        if vector.numel() != group.lengths[tag]:
            raise MergeFailed(f"vector of {vector.numel()} values, group expects {group.lengths[tag]}")
        codec = self.codecs[tag]
        phase = session.counter(tag)
        n_members = len(group.members)
        owned = slices_owned(group)  # owner j owns slices[owned[j]]
        slices = torch.tensor_split(vector, len(owned))  # the wire layout: see slice_bounds
        if me in owned:
            slot = self._slot(session, tag)
            slot.add(me, self._own_part(tag, slices[owned[me]]))
        sent = list(slices)

        async def exchange(j: int) -> tuple[torch.Tensor, float]:
            if j == me:
                averaged, _, shares, exact = await asyncio.shield(slot.result)
                k = owned[me]
                sent[k] = as_held(slices[k], exact, averaged, shares[me], n_members)
                return averaged, shares[me]
            k = owned[j]
            n = slices[k].numel()
            data = codec.encode(slices[k])
            try:
                sent[k] = codec.decode(data, n)
            except NonFiniteError:  # our own Δ is not finite: send it anyway, the owner's guards will say so
                sent[k] = torch.full((n,), float("nan"))
            header = {"group_id": group.group_id, "tag": tag, "index": me, "codec": codec.name, "terms": group.terms}
            reply, payload = await self.rpc.call(group.members[j], "part", header, data, codec.encoded_size(n), phase)
            if not reply.get("ok"):
                raise MergeFailed(f"member {short_id(group.members[j])} could not reduce its slice: {reply.get('error')}")
            try:
                averaged = codec.decode(payload, n)
            except CodecError as e:
                raise MergeFailed(f"member {short_id(group.members[j])} returned an undecodable slice: {e}") from None
            if not torch.isfinite(averaged).all():
                raise MergeFailed(f"member {short_id(group.members[j])} returned non-finite values")
            try:
                self.reducer.accept(group, j, averaged, slices[k])  # the owner of a slice could return anything
            except MergeFailed as e:
                raise AverageRefused(str(e)) from None
            return averaged, _share(reply.get("share"))

        try:
            results = await asyncio.gather(*(exchange(j) for j in owned))
        except AverageRefused:
            if me in owned:
                await self._serve_out(slot)
            raise
        by_slice = sorted(zip(owned.values(), results, strict=True), key=lambda x: x[0])
        return torch.cat([a for _, (a, _) in by_slice]), torch.cat(sent), [share for _, (_, share) in by_slice]

    async def _serve_out(self, slot: _Slot) -> None:
        """Before this peer gives up a merge because its guards refused one owner's average, let the slice it owns be
        served: its mates may accept that average, and still merge without this peer. Leaving at once made every
        member whose part was still on its way fail too ("unknown group"), and every member waiting on the slice wait
        out the merge timeout. Only for a refusal: any other failure (an owner's error, a broken stream) ends the
        merge at once, as the group is broken for all. Waits at most `RPC_TIMEOUT_S` for the parts still to come."""
        try:
            await asyncio.wait_for(asyncio.shield(slot.result), RPC_TIMEOUT_S)
        except (MergeFailed, TimeoutError):
            pass  # its mates learn of it from their own request

    def _own_part(self, tag: str, part: torch.Tensor) -> torch.Tensor:
        """This peer's part of the slice it owns, as it enters the slice's reduction: exact for a pseudo-gradient
        (nothing is lost on the way to itself), and for a state (θg, momentum, or their differences) through the
        codec like every other member's, so that members holding the same state give the same bits and the robust
        rule returns them exactly (found when the int8 agreement let a hostile member's 1e30 weight pull an
        honest owner's slice 0.13 off the honest model: its own exact part and the others' decoded ones differed,
        so CenteredClip's radius was not 0)."""
        if tag == "d" or not self.codecs[tag].lossy:
            return part.clone()
        codec = self.codecs[tag]
        try:
            return codec.decode(codec.encode(part), part.numel())
        except CodecError:  # not finite: the guards say so
            return part.clone()

    def _slot(self, session: MergeSession, tag: str) -> _Slot:
        if tag not in session.slots:
            group = session.group

            def reduce(parts: list, weights: list, flags: dict) -> torch.Tensor:
                return self.reducer.reduce(group, tag, session.me, parts, weights, flags, session.reference)

            session.slots[tag] = _Slot(list(group.weights_for(tag)), [None] * len(group.members),
                                       asyncio.get_running_loop().create_future(), self.codecs[tag], reduce)
        return session.slots[tag]

    # ---- the handler: another member sends us its part of the slice we own ----

    async def on_part(self, request: Request, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """A member's part of the slice this peer owns (its tag already checked; the stream is closed after, see
        `Rpc.start`). The payload is read only once the header names a group, tag and member this peer expects a
        part from, and only if it has exactly the size of that part."""
        sender, phase = request.sender, None
        try:
            session, tag, index, (lo, hi) = await self._expect_part(sender, request.header)
            phase = session.counter(tag)  # this handler's payload and reply are that phase's bytes
            slot = self._slot(session, tag)
            slot.claim(index)  # one part per member: a second stream for the same part is refused unread
            try:
                codec = self.codecs[tag]
                payload = await self.rpc.receive_payload(reader, codec.encoded_size(hi - lo), self.merge_timeout_s,
                                                         exact=codec.exact_size, phase=phase)
                data, share = await self._reduce_part(session, tag, index, sender, payload)
            except BaseException:
                slot.unclaim(index)
                raise
            reply = {"ok": True, "share": share}
        except (MergeFailed, TimeoutError, WireError) as e:
            reply, data = {"ok": False, "error": f"{type(e).__name__}: {e}"}, b""
        await self.rpc.reply(reader, writer, "part", sender, reply, data, phase)  # a failed send is not answered twice

    async def _expect_part(self, sender: str, header: dict) -> tuple[MergeSession, str, int, tuple[int, int]]:
        """What a part's header announces, checked before its payload is read.

        Returns:
            (the merge session, tag, the sender's member index, [start, end) of this peer's slice).

        Raises:
            MergeFailed: a malformed header, an unknown group, or a sender that is not that member of it.
            TimeoutError: the group's notice did not come in time.
        """
        gid, tag, index = header.get("group_id"), header.get("tag"), header.get("index")
        if not isinstance(gid, str) or not isinstance(tag, str) or tag not in self.codecs or not isinstance(index, int):
            raise MergeFailed("malformed part header")
        codec = self.codecs[tag]
        if not codec.sliced:
            raise MergeFailed(f"{codec.name} parts are all-gathered, not sliced (sparse_exchange.py)")
        if header.get("codec", "none") != codec.name:
            raise MergeFailed(f"part encoded with {header.get('codec')!r}, this peer merges with {codec.name!r}")
        session = await self.find_session(gid, sender, header)
        group = session.group
        if not 0 <= index < len(group.members) or group.members[index] != sender:
            raise MergeFailed("sender is not that member of the group")
        check_terms(group, header)
        return session, tag, index, group_slice(group, tag, session.me)  # raises if this peer owns no slice

    async def _reduce_part(self, session: MergeSession, tag: str, index: int, sender: str,
                           payload: bytes) -> tuple[bytes, float]:
        """Add member `index`'s part of this peer's slice; once all arrived, return the encoded average and that
        member's share of it."""
        codec = self.codecs[tag]
        lo, hi = group_slice(session.group, tag, session.me)
        part, flag = self.reducer.admit(session.group, sender, lambda: codec.decode(payload, hi - lo), hi - lo)
        if self.faults is not None:
            await self.faults.fire("serve_part", session.round, short_id(self.rpc.peer_id))
        slot = self._slot(session, tag)
        slot.add(index, part, flag)
        _, data, shares, _ = await asyncio.wait_for(asyncio.shield(slot.result), self.merge_timeout_s)
        return data, shares[index]


def _share(value: object) -> float:
    """A share an owner reported, in [0, 1]; anything else (a missing or malformed field) counts as left out, since
    only the owner knows and a share nobody vouched for must not count as reached."""
    if finite_number(value):
        return min(max(float(value), 0.0), 1.0)
    return 0.0
