"""Merging pseudo-gradients with whichever peers are ready, over hivemind's libp2p daemon.

One merge, seen from one peer:

1. **Ready, group.** Matchmaking through the DHT forms a group of the peers ready now, or gives up and this
   peer merges alone (matchmaking.py).
2. **Exchange.** The group averages the pseudo-gradients in a sliced all-reduce; a member that dies
   mid-merge makes the merge fail for everyone, never leaves anyone a partial average, and every member
   that succeeds holds the same bits (allreduce.py). Each slice's owner applies the guards (slice_guard.py).
3. **Agreement.** If the members' global models differ (a member merged alone or failed a merge), the
   members outside a majority that holds one model fetch it (catch_up.py); without such a majority the group
   averages (θg, momentum), weighted by the tokens each member's θg has absorbed. A fresh peer, with none,
   adopts the swarm's model.

Requests between peers are authenticated with the swarm key and every byte is counted (rpc.py).

We use libp2p streams directly instead of hivemind's `DecentralizedAverager` because that averager applies
averages as per-member deltas (so members end up one rounding error apart), swallows codec failures and
can apply partial averages without a signal; here every byte sent is counted and every failure is seen.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TypeVar

import hivemind
import torch
from hivemind.p2p.p2p_daemon_bindings.utils import P2PDaemonError

from p2pdiloco.algorithm.codecs import DeflatedCodec, LinearInt8Codec, get_codec
from p2pdiloco.algorithm.feedback import rejected_as_dropped
from p2pdiloco.algorithm.guards import GuardBook
from p2pdiloco.config import Config, GuardConfig
from p2pdiloco.network.admission import Request, StreamGate
from p2pdiloco.network.allreduce import AllReduce, PlainReducer, by_values, slice_bounds
from p2pdiloco.network.catch_up import CatchUp
from p2pdiloco.network.census import Census
from p2pdiloco.network.group import OTHER_NOTICE, part_digest
from p2pdiloco.network.matchmaking import Matchmaker
from p2pdiloco.network.merger import Alone, Contribution, FaultHook, Merged, MergeOutcome, MergeStats
from p2pdiloco.network.peer_tag import PeerLog, short_id
from p2pdiloco.network.phase import Phase
from p2pdiloco.network.rpc import MergeFailed, Rpc
from p2pdiloco.network.session import MergeSession, Sessions
from p2pdiloco.network.slice_guard import SliceGuard
from p2pdiloco.network.sparse_exchange import SparseExchange
from p2pdiloco.network.swarm import BackgroundLoop
from p2pdiloco.network.swarm_key import SwarmAuth
from p2pdiloco.network.wire import ByteCounter, WireError

__all__ = ["MergeFailed", "P2PMerger"]

STATE_CODEC = LinearInt8Codec()
"""How members' states travel when they hold no common anchor (tag 's', the first of two exchanges): linear int8."""
STATE_DIFF_CODEC = DeflatedCodec(name="int8-linear+deflate", inner=LinearInt8Codec())
"""How members' differences from an anchor travel: linear int8, deflated (after sparse updates mostly zero)."""

logger = logging.getLogger(__name__)
T = TypeVar("T")


class P2PMerger:
    """Merges contributions with other peers of the run over the DHT's p2p daemon (a `Merger`).

    Args:
        dht: this peer's running DHT.
        cfg: the run's config; the merger reads its swarm's run id, rounds, merge and codec settings.
        loop: the background loop that runs all network work.
        n_params: length of the flat parameter vector (the same on every peer of the swarm).
        auth: the swarm key's request authenticator (None: a public swarm).
        guard: checks on received contributions and the aggregation rule (None: defaults).
        fingerprint: digest of the run config; invites from leaders with another one are declined.
        faults: test hook: faults to inject at stages 'exchange' and 'serve_part' (None: none).
        census_secret: the key of this peer's census nonces, the same across its restarts (`Census`); None: drawn.
    """

    def __init__(self, dht: hivemind.DHT, cfg: Config, loop: BackgroundLoop, n_params: int,
                 auth: SwarmAuth | None = None, guard: GuardConfig | None = None, fingerprint: str = "",
                 faults: FaultHook | None = None, census_secret: bytes | None = None):
        self.dht, self.cfg, self._loop, self.n_params = dht, cfg, loop, n_params
        self.peer_id = dht.peer_id.to_base58()
        self.log = PeerLog(logger, self.peer_id)
        self.auth = auth or SwarmAuth(None, cfg.swarm.run_id)
        self.guard = guard or GuardConfig()
        self.fingerprint = fingerprint
        self.faults = faults
        self.book = GuardBook(self.guard.ban_after if self.guard.enabled else 0, short_id(self.peer_id))
        self.counter = ByteCounter()
        """Bytes this peer sent and received on the merge protocols (the peer's traffic report reads it)."""
        self.codec = get_codec(cfg.codec.name, cfg.codec.sparse_keep)
        """Codec of pseudo-gradient slices and their averages. (θg, momentum) travel as int8 differences from a
        state all members hold (tag 'a'): quantizing the model itself would have no error feedback to undo it, a
        difference of a few outer steps loses ~1/254 of itself (deflated: after sparse updates most of it is zero).
        Where the members hold no common anchor, the int8 average of their states themselves (tag 's') is made
        one first (`_agree`)."""
        self.rpc = Rpc(dht, cfg.swarm.run_id, self.auth, self.counter)
        self.matchmaker = Matchmaker(dht, cfg, self.rpc, self.book, self.guard, fingerprint,
                                     {"d": n_params, "s": 2 * n_params, "a": 2 * n_params}, census_secret)
        self.sessions = Sessions(self.matchmaker.expected_group, self.matchmaker.forget,
                                 self.matchmaker.leaders.distrust_leader_of)
        """This peer's merges in progress, by group id: where the stream handlers find theirs (session.py)."""
        self.allreduce = AllReduce(
            self.rpc, self.sessions.find, {"d": self.codec, "s": STATE_CODEC, "a": STATE_DIFF_CODEC},
            SliceGuard(self.guard, self.book) if self.guard.enabled else PlainReducer(),
            merge_timeout_s=cfg.merge.merge_timeout_s, faults=faults,
        )
        self.sparse = SparseExchange(self.rpc, self.sessions.find, self.codec,
                                     self.guard if self.guard.enabled else None, self.book, cfg.merge.merge_timeout_s, faults)
        """Pseudo-gradients of a sparse codec are all-gathered instead (sparse_exchange.py)."""
        self.catch_up = CatchUp(self.rpc, self.sessions.find, cfg.merge.merge_timeout_s, self.book)
        """Where a majority of a group holds one global model, the others fetch it instead of averaging."""
        self.phase = Phase()
        """When mates said they are looking: where their round ends lie against this peer's (phase.py)."""
        self._round_shift = 0.0
        """What the last merge measured of `phase` for the learner's round clock (`take_round_shift`)."""
        self._loop.run(self.rpc.start({"ready": self._on_ready, "invite": self.matchmaker.on_invite,
                                       "group": self.matchmaker.on_group, "part": self.allreduce.on_part,
                                       "sparse": self.sparse.on_part, "catchup": self.catch_up.on_state}), timeout=30)
        self._loop.submit(self.matchmaker.census.keep_registered(lambda: self.matchmaker.closed))

    # ---- the interface the learner sees ----

    def submit(self, contribution: Contribution) -> Future[MergeOutcome]:
        self._round_shift = 0.0
        return self._loop.submit(self._merge(contribution))

    def take_round_shift(self) -> float:
        shift, self._round_shift = self._round_shift, 0.0
        return shift

    # ---- what the peer's other parts need of it ----

    @property
    def gate(self) -> StreamGate:
        """The bounds on incoming streams: share them with the peer's other servers (state sync, reachability)."""
        return self.rpc.gate

    @property
    def census(self) -> Census:
        """The census of group mates that matchmaking reads (start-up hands it the count it saw, `Census.expect`)."""
        return self.matchmaker.census

    def trust_table(self) -> dict[str, float]:
        """What this peer's guards learned of the others (their trust scores), for its checkpoints."""
        return dict(self.book.trust)

    def remember_trust(self, table: object) -> None:
        """Take back a checkpoint's `trust_table` (anything malformed in it is ignored, `GuardBook.remember`)."""
        self.book.remember(table)

    def guard_report(self) -> dict:
        """What this peer's guards rejected and banned, for its summary."""
        return self.book.report()

    def expect_dialable_verdict(self) -> None:
        """A dial-back check of this peer is under way (call before the first `submit`): until `set_dialable`, this
        peer takes part in groups as one nobody can dial (never leads, owns no slice), so that a peer behind NAT
        does not lead a merge before it knows, and none waits for the check."""
        self.matchmaker.dial.expect_verdict()

    def set_dialable(self, dialable: bool) -> None:
        """Whether other peers can open connections to this one (the dial-back check's verdict; call on the merger's
        loop): one they cannot never leads a group and owns no slice of one; it opens every stream itself
        (matchmaking.py)."""
        self.matchmaker.dial.set(dialable)

    def stop_looking(self) -> None:
        self.matchmaker.close()

    def close(self) -> None:
        """Stop looking for groups, and stop serving (`Rpc.close`: the p2p client's socket file goes with it)."""
        self.matchmaker.close()
        if not self._loop.loop.is_running():
            return  # its loop was closed first: nothing can run the shutdown, and the socket file stays
        try:
            self._loop.run(self.rpc.close(), timeout=5)
        except Exception as e:  # shutting down: log, never raise
            self.log.debug("closing the p2p client: %r", e)

    async def _on_ready(self, request: Request, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if request.header.get("looking") is True:  # when its round ended, as this peer's clock saw it
            self.phase.heard(request.sender)
        await self.matchmaker.on_ready(request, reader, writer)

    # ---- one merge ----

    async def _merge(self, c: Contribution) -> MergeOutcome:
        start = _Start(time.monotonic(), self.counter.sent, self.counter.received, sum(self.book.rejected.values()))
        session = group = None
        try:
            target = c.pseudo_grad if c.compensated is None else c.compensated
            # a gathered codec's part is coded before the search: the notice lists every part's digest, against
            # which a part relayed to a member nobody can dial is checked (sparse_exchange.py)
            data = None if self.codec.sliced else self.codec.encode(target.detach().float().contiguous().cpu())
            group = await self.matchmaker.find_group(c, part_digest(data) if data is not None else "")
            start.matched = time.monotonic()
            if group is None:
                return self._finish(start, c, Alone())
            session = self.sessions.open(MergeSession(group, group.members.index(self.peer_id), c.round, c.momentum))
            if self.faults is not None:
                await self.faults.fire("exchange", c.round, short_id(self.peer_id))
            timeout = self.cfg.merge.merge_timeout_s  # per exchange phase: Δ, and (θg, m) if they disagree
            exchange = (self.allreduce.average(session, "d", target) if self.codec.sliced
                        else self.sparse.average(session, target, data))
            # the agreement needs nothing from the Δ exchange, so both run at once: a merge that needs one takes
            # as long as its longer phase, not their sum (two exchanges of its own without a common anchor)
            if group.need_state:
                limit = timeout * (1 if group.anchor or group.majority else 2)
                agreement = start.timed("agreed", asyncio.wait_for(self._agree(session, c), limit))
            else:
                agreement = _nothing()
            (avg, sent, shares), (state, state_shares) = await _together(
                start.timed("exchanged", asyncio.wait_for(exchange, timeout)), agreement)
            if not self.codec.sliced:
                shares = [shares[session.me]] * len(group.members)  # one part, counted whole or not at all
            stats = MergeStats(
                group=list(group.members), group_id=group.group_id,
                own_kept=by_values([float(s > 0) for s in shares], group.lengths["d"]),
                state_share=by_values(state_shares, group.lengths["s"]) if state is not None else 0.0,
                pseudo_grad_bytes_sent=session.sent("d"), pseudo_grad_bytes_received=session.received("d"),
                state_bytes_sent=session.sent("s", "a"), state_bytes_received=session.received("s", "a"),
                state_anchored=state is not None and not group.majority and group.anchor in c.anchors,
                state_caught_up=state is not None and bool(group.majority))
            # what error feedback counts as sent: only a merge that succeeded sent anything that counts. A failed
            # merge falls back to merging alone with the uncompensated Δ, so the residual is neither applied there
            # nor lost: it goes out once, with the next merge. In a slice the group left out, this round's Δ is
            # dropped and the residual carried into it is kept (feedback.rejected_as_dropped)
            sent = rejected_as_dropped(sent, c.pseudo_grad, shares, slice_bounds(sent.numel(), len(shares)))
            return self._finish(start, c, Merged(
                average=avg, weight=float(sum(group.weights)), agreed_state=state,
                state_weight=group.agreed_state_weight() if state is not None else 0.0, final=group.final,
                sent=sent, stats=stats))
        except (MergeFailed, WireError, TimeoutError, ConnectionError, OSError, P2PDaemonError) as e:
            # a mate that left, froze or cannot be dialed (P2PDaemonError: the daemon's dial failed) is normal
            reason = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
            self.log.warning("merge of round %d failed, merging alone: %s", c.round, reason)
            if group is not None and OTHER_NOTICE in reason:
                self.matchmaker.leaders.distrust_leader_of(group.group_id)
            return self._finish(start, c, Alone(reason))
        except Exception as e:  # the future must never raise into the learner: a bug here costs one merge
            self.log.exception("unexpected error in merge")
            return self._finish(start, c, Alone(f"{type(e).__name__}: {e}"))
        finally:
            if session is not None:
                self.sessions.end(session.group.group_id)

    def _finish(self, start: _Start, c: Contribution, outcome: MergeOutcome) -> MergeOutcome:
        """`outcome` with what the merge cost, counted from `start`, in its stats."""
        alone = isinstance(outcome, Alone)
        self.matchmaker.record(alone=alone)
        # rounds of a fixed step count drift apart (timed rounds end on a swarm-wide cadence, sync rounds wait);
        # taken now, when mates whose rounds ended with this peer's have said so too
        if not (self.cfg.rounds.sync or self.cfg.rounds.round_seconds > 0):
            self._round_shift = self.phase.shift_s(c.round_s, start.t0)
        stats = outcome.stats
        if alone:
            stats.group = [self.peer_id]
            stats.alone_cause = "" if outcome.reason else self.matchmaker.alone_cause
        stats.rejected = sum(self.book.rejected.values()) - start.rejected
        stats.bytes_sent = self.counter.sent - start.sent
        stats.bytes_received = self.counter.received - start.received
        stats.duration_s = time.monotonic() - start.t0
        stats.match_s = stats.duration_s if start.matched is None else start.matched - start.t0
        steps = {**self.matchmaker.marks, **start.marks}  # a search that never began left the last one's
        stats.marks = {k: round(t - start.t0, 4) for k, t in sorted(steps.items(), key=lambda kv: kv[1]) if t >= start.t0}
        return outcome

    async def _agree(self, session: MergeSession, c: Contribution) -> tuple[torch.Tensor, list[float]]:
        """The group's (θg, momentum): where more than half the members hold one model, that model, which the others
        fetch (catch_up.py); else, from a state all members hold, the average of their int8-coded differences from
        it (every member adds the same decoded bits to the same anchor).

        That state is the newest anchor every member named. Without one (members of groups that went apart
        several merges ago: 371 of 460 agreements in `bench scale` at 32 peers), the members first average their
        states themselves, int8-coded (tag 's', with the guards and robust rule of an agreement), and that average,
        the same bits on every member, is the anchor of a second exchange, of θg only: it takes back what the
        first one's coding lost of the model, up to ~1/254 of the members' distance from it. The momentum is the
        first exchange's average as it is: its int8 error, 1/254 of a block's largest value, is ~1/250 of an outer
        step's momentum term, where the model's is tens of outer steps. Its half of the second exchange is zeros
        (deflated to a few hundred bytes) but for one block. 3 int8 values a parameter in all where two full
        exchanges took 4 and fp32 8. A peer of the version before, which sent its momentum's difference there too,
        still ends on the group's bits: owners average, and members add the same decoded average to one anchor.
        """
        group = session.group
        state = torch.cat([c.global_params, c.momentum])
        if group.majority:  # most members hold one model: it is the answer, and only the others need it
            return await self.catch_up.agree(session, state, c.anchors)
        anchor = c.anchors.get(group.anchor) if group.anchor else None
        if anchor is not None:
            avg, _, shares = await self.allreduce.average(session, "a", state - anchor)
            return anchor + avg, shares
        first, _, _ = await self.allreduce.average(session, "s", state)
        n = c.global_params.numel()
        diff = state - first
        # the momentum stays the first exchange's average, but for the one int8 block of it (blocks run from each
        # slice's start) that may also hold the model's last values, and so the model's scale
        diff[n + LinearInt8Codec.BLOCK:] = 0.0
        avg, _, shares = await self.allreduce.average(session, "a", diff)
        return first + avg, shares


@dataclass
class _Start:
    """When a merge started and this peer's counters then: what the merge cost is counted from them."""

    t0: float
    sent: int
    received: int
    rejected: int
    matched: float | None = None
    """When matchmaking returned (monotonic), a group or none."""
    marks: dict[str, float] = field(default_factory=dict)
    """When (monotonic) the exchange and the agreement ended (`MergeStats.marks`)."""

    async def timed(self, step: str, phase: Awaitable[T]) -> T:
        """`phase`'s result, with when it ended marked as `step` (only if it succeeded)."""
        result = await phase
        self.marks[step] = time.monotonic()
        return result


async def _nothing() -> tuple[None, list[float]]:
    return None, []


async def _together(exchange, agreement):
    """Run a merge's Δ exchange and its agreement at once and return both results.

    If the exchange fails, the agreement is cancelled (and awaited) before the error is raised, so that nothing
    goes on sending for a merge already given up. If the agreement fails (this member refused the state a holder
    served, or could not fetch it), the exchange still runs to its end, bounded by its own timeout: this member
    owns a slice of the others' Δ, and its refusal of a state must not cost them their merge. Then the agreement's
    error is raised and this member merges alone."""
    tasks = [asyncio.ensure_future(exchange), asyncio.ensure_future(agreement)]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        ex, ag = tasks
        if not ex.done() and ag.done() and not ag.cancelled() and ag.exception() is not None:
            await asyncio.gather(ex, return_exceptions=True)  # the slice owed to the group
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
