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
mean. The screens' references are ones every member holds alike: the smallest finite part (two parts), the
others' median (three or more) and, for the trust screen (`trusted`), the outer momentum, the same on every member
whose global state is the same. A member's own ban list is not consulted here (members' lists differ;
banned peers are kept out of groups by matchmaking). A member that does not receive every part within the merge
timeout fails the merge, so nobody applies a partial average.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import torch

from p2pdiloco.algorithm.codecs import Codec, CodecError, NonFiniteError
from p2pdiloco.algorithm.guards import NONFINITE, SHAPE, TRUST, GuardBook, cosines_to, screen_parts
from p2pdiloco.algorithm.outer import weight_shares, weighted_average
from p2pdiloco.config import GuardConfig
from p2pdiloco.network.admission import Request
from p2pdiloco.network.group import check_terms
from p2pdiloco.network.merger import FaultHook
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


def screen_shared(parts: list[torch.Tensor], flags: list[str], guard: GuardConfig) -> list[str]:
    """Reasons to leave each part out, the same on every member: decode flags, then `screen_parts` judged from
    the smallest finite part when only two are finite (the reference every member can compute; with three or
    more, `screen_parts` uses the median and no judge)."""
    finite = [i for i, f in enumerate(flags) if not f]
    judge = min(finite, key=lambda i: float(parts[i].norm())) if finite else 0
    reasons = screen_parts(parts, judge, guard.norm_bound, guard.min_cosine)
    return [f or r for f, r in zip(flags, reasons, strict=True)]


TRUST_SHARE = 0.15
"""A part counts only if its cosine to the momentum is above this share of the group's upper-median cosine."""


def trusted(parts: list[torch.Tensor], reasons: list[str], reference: torch.Tensor | None,
            forked: bool = False) -> list[str]:
    """The trust screen for all-gathered parts: `reasons` with TRUST added for each part whose cosine to the outer
    momentum `reference` is at most max(TRUST_SHARE × the upper median of the cosines, 1/√n); without a momentum
    (the run's first merge), for each part that fewer others point with than the group's upper median (`supported`).

    The default codec's screen (slice_guard.SliceGuard._trust) weighs a part by its member's *history* of cosines,
    kept by each slice owner; here every member decides for the whole vector, so the decision must be the same on
    every member, and members' histories differ (they merged in different groups). So it is judged from this merge
    alone, against the momentum, which no member of this merge chose and which every member whose global state is
    the same holds bit for bit: a sign-flipped part points against it and same-norm noise is nearly orthogonal to
    it. The decision is all or nothing, not a weight, so that members whose states differ slightly (a fork, mended
    by this merge's agreement) still take the same decisions and end on one model.

    The first merge matters most: its average becomes the momentum every later merge is judged by. Let in, 2
    sign-flipped parts of 5 turned it so that the next honest parts pointed against it (cosines −0.05 to 0.01 in
    `bench byzantine`, sparseloco), the majority rule below then turned the screen off, and it stayed off.

    An honest part left out loses only this round's Δ (error feedback keeps the residual it carried). If the upper
    median is not positive, a majority points against the momentum: with an honest majority that means the
    momentum is what is wrong, so nothing is left out (as in `guards.trust_factors`). If it is positive but no
    more than 1/√n, the cosine of a random direction, the floor would leave out at least half of the parts (in
    a 3000-step run, every part at times: the merge failed for all): there only parts that point against the
    momentum are left out. In a merge whose members' global states differ (`forked`: an agreement is part of
    it) their momenta differ, so their decisions could too, and a fork would last (in a 3000-step `--sync` run,
    members left out different parts in ~180 merges in a row): there the parts are judged by their support
    among themselves (`supported`), which every member computes from the same parts alike.
    """
    if reference is None:
        return list(reasons)
    if forked:
        return supported(parts, reasons)
    cosines = cosines_to(parts, reference)
    scored = sorted(c for c, r in zip(cosines, reasons, strict=True) if c is not None and not r)
    if not scored:
        return supported(parts, reasons)
    median, chance = scored[len(scored) // 2], 1.0 / math.sqrt(max(reference.numel(), 1))
    if median <= 0:
        return list(reasons)
    # where the momentum tells parts apart no better than chance, only the sign of their cosine is kept from it
    floor = max(TRUST_SHARE * median, chance) if median > chance else 0.0
    logger.debug("sparse parts' cosines to the momentum: %s (floor %.4f)",
                 ", ".join("-" if c is None else f"{c:.3f}" for c in cosines), floor)
    return [r or (TRUST if c is not None and c <= floor else "") for c, r in zip(cosines, reasons, strict=True)]


def supported(parts: list[torch.Tensor], reasons: list[str]) -> list[str]:
    """`reasons` with TRUST added for each part that fewer other parts have a positive cosine with than the upper
    median of that count, from 3 parts on: the trust screen's rule where there is no momentum to judge by.

    Honest members' first pseudo-gradients point alike (pairwise cosines of their sparse parts were positive in
    the runs of `bench byzantine`), so with h honest and f flipped parts an honest one has h − 1 + 0 supporters
    and a flipped one f − 1: while honest parts are a majority, the upper median is an honest count."""
    idx = [i for i, r in enumerate(reasons) if not r]
    if len(idx) < 3:
        return list(reasons)
    unit = {i: parts[i].float() / max(float(torch.linalg.vector_norm(parts[i].float())), 1e-30) for i in idx}
    support = {i: sum(float(torch.dot(unit[i], unit[j])) > 0 for j in idx if j != i) for i in idx}
    bar = sorted(support.values())[len(idx) // 2]
    logger.debug("sparse parts' supporters (no momentum yet): %s", support)
    return [r or (TRUST if support[i] < bar else "") for i, r in enumerate(reasons)]


def reduce_parts(parts: list[torch.Tensor], flags: list[str], weights: list[float],
                 guard: GuardConfig | None,
                 reference: torch.Tensor | None = None,
                 forked: bool = False) -> tuple[torch.Tensor, list[str], list[float]]:
    """The group's average of decoded sparse parts, as every member computes it.

    Robust coordinate-wise rules (centered_clip, trimmed_mean) do not fit sparse parts: where most members kept
    no value a coordinate's median is 0, and it would drop nearly every value sent; the weighted mean of the
    parts that pass the guards is used, as in SparseLoCo.

    Args:
        parts: each member's decoded part, in group order.
        flags: '' or why a part could not be decoded.
        weights: each member's weight (tokens of its round).
        guard: the bounds; None: no guards, and any flagged part fails the merge.
        reference: the outer momentum, for the trust screen (`trusted`; off with `guard.trust_decay` < 0).
        forked: members' global states differ (the merge holds an agreement), so their momenta do too.

    Returns:
        (the average, one reason per member ('' if its part counted), each member's share of the average).

    Raises:
        MergeFailed: no part may count.
    """
    if guard is None:
        if any(flags):
            raise MergeFailed(f"undecodable or non-finite parts: {flags}")
        reasons = list(flags)
    else:
        reasons = screen_shared(parts, flags, guard)
        if guard.trust_decay >= 0:
            reasons = trusted(parts, reasons, reference, forked)
    kept = [not r for r in reasons]
    if not any(kept):
        raise MergeFailed("every part was rejected")
    average = weighted_average([p for p, k in zip(parts, kept, strict=True) if k],
                               [w for w, k in zip(weights, kept, strict=True) if k])
    return average, reasons, weight_shares(weights, kept)


@dataclass
class _Gathered:
    """The encoded parts of one group's members, as they arrive; `done` resolves once all are here."""

    parts: list[bytes | None]
    done: asyncio.Future

    def add(self, index: int, data: bytes) -> None:
        if self.parts[index] is not None:
            raise MergeFailed(f"duplicate part from member {index}")
        self.parts[index] = data
        if all(p is not None for p in self.parts) and not self.done.done():
            self.done.set_result(None)


class SparseExchange:
    """All-gathers sparse parts over formed groups, and serves the parts other members send this peer.

    Args:
        rpc: requests to the other members (op 'sparse').
        find_session: group id -> its merge session, once it is open (see `Sessions.find`).
        codec: the sparse codec (`encoded_size` bounds a part's bytes).
        guard: bounds on received parts (None: no guards).
        book: where rejected members are counted.
        merge_timeout_s: bound on receiving one part, and on waiting for all of them.
        faults: test hook; stage 'serve_part' fires on each part received, keyed by the session's round.
    """

    def __init__(self, rpc: Rpc, find_session: Callable[[str], Awaitable[MergeSession]], codec: Codec,
                 guard: GuardConfig | None, book: GuardBook, merge_timeout_s: float = 30.0,
                 faults: FaultHook | None = None):
        self.rpc, self.find_session, self.codec, self.guard, self.book = rpc, find_session, codec, guard, book
        self.merge_timeout_s, self.faults = merge_timeout_s, faults

    async def average(self, session: MergeSession,
                      vector: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, list[float]]:
        """Average `vector` (a pseudo-gradient) over the session's group.

        Returns:
            (the average, as every member computes it; `vector` as the others decoded it, zero where this
            member's part was left out, for error feedback; each member's share of the average).
        """
        group, me = session.group, session.me
        n = group.lengths["d"]
        vector = vector.detach().float().contiguous().cpu()
        if vector.numel() != n:
            raise MergeFailed(f"vector of {vector.numel()} values, group expects {n}")
        data = self.codec.encode(vector)
        phase = session.counter("d")
        gathered = self._gathered(session)
        gathered.add(me, data)
        header = {"group_id": group.group_id, "index": me, "codec": self.codec.name, "terms": group.terms}

        async def send(j: int) -> None:
            reply, _ = await self.rpc.call(group.members[j], "sparse", header, data, 0, phase)
            if not reply.get("ok"):
                raise MergeFailed(f"member {group.members[j][-6:]} refused our part: {reply.get('error')}")

        await asyncio.gather(*(send(j) for j in range(len(group.members)) if j != me))
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

    def _gathered(self, session: MergeSession) -> _Gathered:
        if session.gathered is None:
            session.gathered = _Gathered([None] * len(session.group.members), asyncio.get_running_loop().create_future())
        return session.gathered

    async def on_part(self, request: Request, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Another member's encoded part: read only once the header names a group and member this peer expects a
        part from, and only up to the codec's bound for the group's vector length."""
        sender, header, phase = request.sender, request.header, None
        try:
            gid, index = header.get("group_id"), header.get("index")
            if not isinstance(gid, str) or not isinstance(index, int):
                raise MergeFailed("malformed part header")
            if header.get("codec") != self.codec.name:
                raise MergeFailed(f"part encoded with {header.get('codec')!r}, this peer merges with {self.codec.name!r}")
            session = await self.find_session(gid)
            group = session.group
            if not 0 <= index < len(group.members) or group.members[index] != sender:
                raise MergeFailed("sender is not that member of the group")
            check_terms(group, header)
            phase = session.counter("d")
            gathered = self._gathered(session)
            if gathered.parts[index] is not None:
                raise MergeFailed(f"duplicate part from member {index}")
            payload = await self.rpc.receive_payload(reader, self.codec.encoded_size(group.lengths["d"]),
                                                     self.merge_timeout_s, exact=False, phase=phase)
            if self.faults is not None:
                await self.faults.fire("serve_part", session.round, self.rpc.peer_id[-6:])
            gathered.add(index, payload)
            reply = {"ok": True}
        except (MergeFailed, TimeoutError, WireError) as e:
            reply = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        await self.rpc.reply(reader, writer, "sparse", sender, reply, phase=phase)
