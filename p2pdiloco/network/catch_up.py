"""Where most members of a merge group hold one global model, the others fetch it instead of averaging.

An agreement of (θg, momentum) where more than half the members offered one digest (`Group.majority`) returns
that model: the robust rule's answer where a majority agrees exactly is theirs (robust.py). Averaging sent every
member's state out and back to find it, twice where the members hold no common anchor, and adds int8 rounding
to it, so that afterwards no member holds its old model any more. At 32 peers agreements are most of a peer's
merge bytes, and many of them are in groups with such a majority (docs/benchmarks.md, Scale).

Here the members outside the majority (fetchers) each fetch that model, bit for bit, from one member holding it
(holders are dealt to fetchers round-robin in group order), and check it against the majority's digest before
using it: a holder cannot hand over another model. Where it does not match (proof that its holder lied: an honest
one serves the model whose digest it offered; a strike in the fetcher's guard book) or the holder does not serve
it, the fetcher's merge fails and it merges alone. It does not ask another holder: those whose own fetchers are
served have ended their merges by then, and where the holder died the Δ exchange fails anyway. The holders
send only that, at most 8 bytes a parameter to each fetcher dealt to them, and keep their own model bit for bit:
their digest and their anchors stay valid for the next groups.

The model travels as its exact difference from a base both hold (algorithm/exact_delta.py: bit patterns
subtracted, byte planes deflated; lossless, so the digest check is unchanged): the fetcher names its anchors, newest
first, and the holder takes the first of them it holds too (most often the group's model one merge back, which a
member that merged alone once still holds), else zeros: about 3 bytes a value against fp32's 4 for states a few
outer steps apart, 3.5 from zeros. Where that would not be smaller than fp32, or the fetcher named no anchors (a
peer of the version before, which reads only fp32), it goes as fp32. A payload that does not decode, or a base the
fetcher did not offer, is refused and struck as a model other than the majority's.

A holder waits, within the merge timeout, until the fetchers dealt to it are served, so that the bytes it sends
count in its merge; a fetcher that never asks (it was told another notice, or died) costs it that wait, not its
merge: the holder's own model is the group's either way.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from p2pdiloco.algorithm.codecs import CodecError
from p2pdiloco.algorithm.exact_delta import decode_exact_delta, encode_exact_delta, encoded_bound
from p2pdiloco.algorithm.guards import FORGED, GuardBook
from p2pdiloco.algorithm.outer import state_digest, weight_shares
from p2pdiloco.network.admission import Request
from p2pdiloco.network.group import Group, check_terms
from p2pdiloco.network.peer_tag import short_id
from p2pdiloco.network.rpc import MergeFailed, Rpc
from p2pdiloco.network.session import MergeSession

logger = logging.getLogger(__name__)

TAG = "s"
"""Bytes of a catch-up count as the agreement's (`MergeStats.state_bytes_sent`)."""
MAX_ANCHORS = 32
"""Most anchor digests a fetcher's request may name (`merge.state_anchors` is at most 32); a holder reads no more."""


@dataclass
class _Served:
    """What a holder serves to the fetchers of one group."""

    state: asyncio.Future
    """Resolves to this holder's (θg, momentum), flat fp32, once its merge reached the agreement."""
    served: set[int] = field(default_factory=set)
    """Fetchers (member indices) that received it."""
    asked: set[int] = field(default_factory=set)
    """Fetchers that asked for it: each is served once."""
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    anchors: dict[str, torch.Tensor] = field(default_factory=dict)
    """This holder's anchors, by digest (`Contribution.anchors`): the bases it can encode the model against."""
    encoded: dict[str, bytes] = field(default_factory=dict)
    """The model encoded against each base asked for so far ('' : zeros), kept for the next fetcher."""


def holders_of(group: Group) -> list[int]:
    """Member indices holding the majority's model, in group order ([] without a majority)."""
    return [j for j, d in enumerate(group.digests) if d == group.majority] if group.majority else []


def dealt_holder(group: Group, fetcher: int) -> int:
    """The holder that serves member `fetcher`: fetchers and holders paired round-robin, in group order. Only
    holders others can dial serve where there is one (`Group.slice_owners`): a fetcher opens the stream."""
    holders = holders_of(group)
    serving = [j for j in holders if j in group.slice_owners] or holders
    fetchers = [j for j in range(len(group.members)) if j not in holders]
    return serving[fetchers.index(fetcher) % len(serving)]


class CatchUp:
    """The members of a group outside its majority fetch the majority's global model (see the module docstring).

    Args:
        rpc: requests to the other members (op 'catchup').
        find_session: (group id, sender, header) -> its merge session, once it is open (see `Sessions.find`).
        merge_timeout_s: bound on one fetch, and on a holder's wait for its fetchers.
        book: where a holder that served a model other than the one it claimed is struck.
    """

    def __init__(self, rpc: Rpc, find_session: Callable[..., Awaitable[MergeSession]], merge_timeout_s: float,
                 book: GuardBook):
        self.rpc, self.find_session, self.merge_timeout_s, self.book = rpc, find_session, merge_timeout_s, book

    async def agree(self, session: MergeSession, state: torch.Tensor,
                    anchors: dict[str, torch.Tensor] | None = None) -> tuple[torch.Tensor, list[float]]:
        """The group's (θg, momentum), which the majority holds: this peer's own `state` if it holds it, else fetched.

        Args:
            session: this peer's merge.
            state: this peer's (θg, momentum), flat fp32.
            anchors: states this peer holds, by digest, newest first (`Contribution.anchors`): the bases the model
                may travel against.

        Returns:
            (the majority's state, this peer's share of it for each of the group's slices: a holder's weight share
            among the holders, 0 for a fetcher).

        Raises:
            MergeFailed: a fetcher whose holder did not serve the majority's model.
        """
        group, me = session.group, session.me
        holders = holders_of(group)
        anchors = anchors or {}
        if me not in holders:
            return await self._fetch(session, anchors), [0.0] * len(group.members)
        served = self._served(session)
        served.anchors = anchors
        if not served.state.done():
            served.state.set_result(state.detach().float().contiguous().cpu())
        mine = [j for j in range(len(group.members)) if j not in holders and dealt_holder(group, j) == me]
        deadline = time.monotonic() + 0.8 * self.merge_timeout_s  # inside the merge's own timeout on this phase
        while not set(mine) <= served.served and (left := deadline - time.monotonic()) > 0:
            served.changed.clear()
            try:
                await asyncio.wait_for(served.changed.wait(), left)
            except TimeoutError:
                break
        shares = weight_shares([group.state_weights[j] for j in holders])
        return state, [shares[holders.index(me)]] * len(group.members)

    async def _fetch(self, session: MergeSession, anchors: dict[str, torch.Tensor]) -> torch.Tensor:
        group, me = session.group, session.me
        n = group.lengths["s"]
        j = dealt_holder(group, me)
        holder = short_id(group.members[j])
        header = {"group_id": group.group_id, "index": me, "terms": group.terms, "anchors": list(anchors)[:MAX_ANCHORS]}
        reply, payload = await asyncio.wait_for(
            self.rpc.call(group.members[j], "catchup", header, max_reply=4 * n, phase=session.counter(TAG)),
            self.merge_timeout_s)
        if not reply.get("ok"):
            raise MergeFailed(f"holder {holder} did not serve the majority's model: {reply.get('error')}")
        state = await self._decode(group, j, reply.get("base"), payload, anchors)
        if state_digest(state[: n // 2], state[n // 2:]) != group.majority:
            self.book.reject(group.members[j], FORGED, group.group_id, "(catch-up)")
            raise MergeFailed(f"holder {holder} served a model other than the majority's")
        return state

    async def _decode(self, group: Group, j: int, base: object, payload: bytes,
                      anchors: dict[str, torch.Tensor]) -> torch.Tensor:
        """The state holder `j` served: fp32 where it named no base, else its exact difference from that base
        (decoded off the network thread: at 100M parameters it inflates 800 MB)."""
        n = group.lengths["s"]
        if base is None:
            if len(payload) != 4 * n:
                raise MergeFailed(f"holder {short_id(group.members[j])} served {len(payload)} bytes, not {4 * n}")
            return torch.from_numpy(np.frombuffer(payload, dtype=np.float32).copy())
        held = anchors.get(base) if isinstance(base, str) and base else None
        try:
            if base != "" and (held is None or held.numel() != n):
                raise CodecError(f"a base this peer did not offer: {str(base)[:40]}")
            return await asyncio.to_thread(decode_exact_delta, payload, torch.zeros(n) if held is None else held.float())
        except CodecError as e:  # only a holder that lied sends what does not decode against a base offered
            self.book.reject(group.members[j], FORGED, group.group_id, "(catch-up)")
            raise MergeFailed(f"holder {short_id(group.members[j])} served a model other than the majority's: {e}") from None

    def _served(self, session: MergeSession) -> _Served:
        if session.served is None:
            session.served = _Served(asyncio.get_running_loop().create_future())
        return session.served

    # ---- the handler: a fetcher asks this holder for the majority's model ----

    async def on_state(self, request: Request, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Serve this peer's global model to a member of its group outside the majority (the stream is closed
        after, see `Rpc.start`): only for a group this peer is in, whose notice the requester acts on too, to the
        member it names, once, and only where this peer is the holder dealt to it (so a member cannot make every
        holder send it the model, nor one holder send it twice)."""
        sender, header, data, phase = request.sender, request.header, b"", None
        try:
            gid, index = header.get("group_id"), header.get("index")
            if not isinstance(gid, str) or not isinstance(index, int):
                raise MergeFailed("malformed request")
            session = await self.find_session(gid, sender, header)
            group = session.group
            if not 0 <= index < len(group.members) or group.members[index] != sender:
                raise MergeFailed("sender is not that member of the group")
            check_terms(group, header)
            if not group.majority or index in holders_of(group) or dealt_holder(group, index) != session.me:
                raise MergeFailed("this peer does not serve that member the majority's model")
            phase = session.counter(TAG)  # the reply is the agreement's bytes
            served = self._served(session)
            if index in served.asked:
                raise MergeFailed("that member asked already")
            served.asked.add(index)
            state = await asyncio.wait_for(asyncio.shield(served.state), self.merge_timeout_s)
            reply, data = await asyncio.to_thread(_encoded, served, state, header.get("anchors"))  # off the loop
        except (MergeFailed, TimeoutError) as e:
            reply, served = {"ok": False, "error": f"{type(e).__name__}: {e}"}, None
        await self.rpc.reply(reader, writer, "catchup", sender, reply, data, phase)
        if served is not None:
            served.served.add(index)
            served.changed.set()


def _encoded(served: _Served, state: torch.Tensor, offered: object) -> tuple[dict, bytes]:
    """The reply and payload that serve `state` to a fetcher that offered the anchors `offered` (digests, newest
    first): its exact difference from the first of them this holder holds too (else from zeros), where that is
    smaller than fp32; fp32 where it is not, or where the fetcher offered none (it reads fp32 only). Two fetchers
    asking at once for one base may both encode it: the same bytes, kept once."""
    if not isinstance(offered, list):
        return {"ok": True}, state.numpy().tobytes()
    base = next((a for a in offered[:MAX_ANCHORS] if isinstance(a, str) and a in served.anchors
                 and served.anchors[a].numel() == state.numel()), "")
    if base not in served.encoded:
        served.encoded[base] = encode_exact_delta(state, served.anchors[base].float() if base else torch.zeros_like(state))
    data = served.encoded[base]
    if len(data) >= encoded_bound(state.numel()):
        return {"ok": True}, state.numpy().tobytes()
    return {"ok": True, "base": base}, data
