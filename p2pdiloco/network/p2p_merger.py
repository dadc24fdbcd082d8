"""Merging pseudo-gradients with whichever peers are ready, over hivemind's libp2p daemon.

One merge, seen from one peer:

1. **Ready.** The peer writes a `ready` record (with its matchmaking deadline) to the DHT.
2. **Group.** The peer with the smallest id among those ready is the leader. It invites the others as soon
   as every live peer is ready, or at its deadline with whoever is. Each peer accepts at most one invite
   per merge; the leader then sends the final member list, the members' weights and whether their global
   models disagree (digests differ) to every member. A peer that is not invited in time merges alone.
3. **Exchange.** A reduce-scatter then all-gather, as in a butterfly all-reduce: member j owns slice j of
   the vector, receives that slice from every member, and only when it holds all of them sends back
   the weighted average. A member applies the result only if it received *every* averaged slice, so a
   member that dies mid-merge makes the merge fail, and never leaves anyone a partial average (the silent
   failure mode of hivemind's all-reduce with `next_chunk_timeout`, see DESIGN.md). Every member that
   succeeds holds the same bits, because each slice is averaged once, by its owner.
4. **Agreement.** If the members' global models differ (a member merged alone or failed a merge), the
   group also averages (θg, momentum), weighted by the tokens each member's θg has absorbed; a fresh
   peer, with none, adopts the swarm's model.

We use libp2p streams directly instead of hivemind's `DecentralizedAverager` because that averager applies
averages as per-member deltas (so members end up one rounding error apart), swallows codec failures and
can apply partial averages without a signal; here every byte sent is counted and every failure is seen.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import secrets
import signal
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

import hivemind
import torch
from hivemind.p2p import PeerID
from hivemind.utils.timed_storage import get_dht_time

from p2pdiloco.algorithm.codecs import Codec, CodecError, ErrorFeedback, NonFiniteError, get_codec, warm_up
from p2pdiloco.algorithm.guards import (
    BANNED,
    NONFINITE,
    SHAPE,
    STALE,
    GuardBook,
    check_average,
    screen_parts,
    stale_members,
)
from p2pdiloco.algorithm.outer import weighted_average
from p2pdiloco.algorithm.robust import aggregate
from p2pdiloco.config import GuardConfig, SwarmConfig
from p2pdiloco.network.merger import Contribution, MergeResult, alone_result
from p2pdiloco.network.swarm import (
    BackgroundLoop,
    live_records,
    peers_key,
    read_subkeys,
    ready_key,
    write_subkey,
)
from p2pdiloco.network.swarm_key import SwarmAuth
from p2pdiloco.network.wire import ByteCounter, WireError, await_requester_close, recv_msg, send_msg

logger = logging.getLogger(__name__)

POLL_S = 0.25
"""How often a peer looking for a group re-reads the ready records."""
RPC_TIMEOUT_S = 5.0
"""Bound on one small request (invite, group notice)."""


class MergeFailed(Exception):
    """A group merge that must not be applied."""


def slice_bounds(length: int, parts: int) -> list[tuple[int, int]]:
    """Split range(length) into `parts` contiguous near-equal slices, the same on every member."""
    base, extra = divmod(length, parts)
    bounds, start = [], 0
    for i in range(parts):
        end = start + base + (1 if i < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


@dataclass
class _Slot:
    """The slice of one vector that this peer reduces for its group.

    `result` resolves to (averaged slice as every member will decode it, its encoded bytes): the owner keeps
    the decoded copy, not its exact average, so that all members hold the same bits.
    """

    weights: list[float]
    parts: list[torch.Tensor | None]
    result: asyncio.Future
    codec: Codec
    """How the average travels back to the members (and how they decode it)."""
    reduce: Callable[[list, list, dict], torch.Tensor] = lambda parts, weights, flags: weighted_average(parts, weights)
    """(parts, weights, flags) -> the averaged slice; flags: {member index: reason} decided on arrival."""
    flags: dict[int, str] = field(default_factory=dict)

    def add(self, index: int, part: torch.Tensor, flag: str = "") -> None:
        if self.parts[index] is not None:
            raise MergeFailed(f"duplicate part from member {index}")
        self.parts[index] = part
        if flag:
            self.flags[index] = flag
        if all(p is not None for p in self.parts) and not self.result.done():
            try:
                average = self.reduce(self.parts, self.weights, self.flags)
            except MergeFailed as e:
                self.result.set_exception(e)
                return
            data = self.codec.encode(average)
            self.result.set_result((self.codec.decode(data, average.numel()), data))


@dataclass
class _Group:
    group_id: str
    members: list[str]
    weights: list[float]
    state_weights: list[float]
    need_state: bool
    lengths: dict[str, int]
    """Vector length per tag: 'd' for the pseudo-gradient, 's' for (θg, momentum)."""
    final: bool = False
    """A member is finishing its run (see `MergeResult.final`)."""
    slots: dict[str, _Slot] = field(default_factory=dict)

    def slot(self, tag: str, codec: Codec, reduce: Callable[[list, list, dict], torch.Tensor]) -> _Slot:
        if tag not in self.slots:
            weights = self.weights if tag == "d" else self.state_weights
            self.slots[tag] = _Slot(list(weights), [None] * len(self.members), asyncio.get_running_loop().create_future(),
                                    codec, reduce)
        return self.slots[tag]


@dataclass
class _Search:
    """This peer's current search for a group."""

    contribution: Contribution
    deadline: float
    leading: bool = False
    accepted_gid: str = ""
    leader: str = ""
    invited: asyncio.Event = field(default_factory=asyncio.Event)
    group: asyncio.Future | None = None


class P2PMerger:
    """Merges contributions with other peers of the run over the DHT's p2p daemon.

    Args:
        dht: this peer's running DHT.
        cfg: swarm settings (run id, merge window and timeout).
        loop: the background loop that runs all network work.
        n_params: length of the flat parameter vector (the same on every peer of the swarm).
        auth: the swarm key's request authenticator (None: a public swarm).
        guard: checks on received contributions and the aggregation rule (None: defaults).
        fingerprint: digest of the run config; invites from leaders with another one are declined.
    """

    def __init__(self, dht: hivemind.DHT, cfg: SwarmConfig, loop: BackgroundLoop, n_params: int,
                 auth: SwarmAuth | None = None, guard: GuardConfig | None = None, fingerprint: str = ""):
        self.dht, self.cfg, self._loop, self.n_params = dht, cfg, loop, n_params
        self.peer_id = dht.peer_id.to_base58()
        self.auth = auth or SwarmAuth(None, cfg.run_id)
        self.guard = guard or GuardConfig()
        self.fingerprint = fingerprint
        self.book = GuardBook(self.guard.ban_after if self.guard.enabled else 0, self.peer_id[-6:])
        self.counter = ByteCounter()
        self.codec = get_codec(cfg.codec)
        """Codec of pseudo-gradient slices and their averages; (θg, momentum) always travel as fp32, because
        quantizing the model itself would have no error feedback to undo it."""
        self.feedback = ErrorFeedback(cfg.error_feedback and self.codec.lossy)
        # in this thread, now: bitsandbytes takes seconds to import, and the first merge once paid for it on
        # the network thread and timed out. (A background import raced the main thread's own first imports
        # of torch._dynamo and failed with a circular-import error.)
        warm_up(self.codec)
        self._search: _Search | None = None
        self._groups: dict[str, asyncio.Future] = {}
        self._p2p = None
        self._closed = False
        self._ready_expiration = 0.0
        self._last_submit = time.monotonic()
        self._round_ema: float | None = None
        self._alone_streak = 0
        self._round = -1
        self._tasks: set[asyncio.Task] = set()
        self.faults: dict[tuple[str, int], str] = {}
        """Test hook: {(stage, round): action}; see `_inject`."""
        self._loop.run(self._setup(), timeout=30)

    async def _inject(self, stage: str, round_: int) -> None:
        """Deterministic fault injection for tests, keyed by (stage, round).

        Stages: 'exchange' (before this peer sends its slices), 'serve_part' (inside the reducer, on the
        first slice received from another member). Actions: 'stall' freezes this peer's side of the merge
        (as SIGSTOP would) until the merge is abandoned; 'kill' SIGKILLs this process on the spot.
        """
        action = self.faults.get((stage, round_))
        if action:
            logger.warning("[%s] injected fault: %s at %s of round %d", self.peer_id[-6:], action, stage, round_)
        if action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif action == "stall":
            await asyncio.sleep(3600)

    def _proto(self, op: str) -> str:
        return f"p2pdiloco.{self.cfg.run_id}.{op}"

    async def _setup(self) -> None:
        self._p2p = await self.dht.replicate_p2p()
        await self._p2p.add_binary_stream_handler(self._proto("invite"), self._on_invite)
        await self._p2p.add_binary_stream_handler(self._proto("group"), self._on_group)
        await self._p2p.add_binary_stream_handler(self._proto("part"), self._on_part)

    # ---- the interface the learner sees ----

    def submit(self, contribution: Contribution) -> Future[MergeResult]:
        return self._loop.submit(self._merge(contribution))

    def close(self) -> None:
        self._closed = True

    # ---- one merge ----

    async def _merge(self, c: Contribution) -> MergeResult:
        t0, sent0, recv0 = time.monotonic(), self.counter.sent, self.counter.received
        rejected0 = sum(self.book.rejected.values())
        self._round = c.round

        def finish(result: MergeResult) -> MergeResult:
            self._alone_streak = self._alone_streak + 1 if result.alone else 0
            result.rejected = sum(self.book.rejected.values()) - rejected0
            result.bytes_sent = self.counter.sent - sent0
            result.bytes_received = self.counter.received - recv0
            result.duration_s = time.monotonic() - t0
            return result

        group = None
        try:
            group = await self._find_group(c)
            if group is None:
                return finish(alone_result(self.peer_id, c))
            me = group.members.index(self.peer_id)
            await self._inject("exchange", c.round)
            timeout = self.cfg.merge_timeout_s  # per exchange phase: Δ, then (θg, m) if they disagree
            target = self.feedback.compensate(c.pseudo_grad)
            avg, sent = await asyncio.wait_for(self._allreduce(group, me, "d", target), timeout)
            state = None
            if group.need_state:
                state, _ = await asyncio.wait_for(
                    self._allreduce(group, me, "s", torch.cat([c.global_params, c.momentum])), timeout
                )
            self.feedback.commit(target, sent)  # only now: a failed merge sent nothing that counts
            return finish(
                MergeResult(
                    group=list(group.members), pseudo_grad=avg, total_weight=float(sum(group.weights)),
                    global_state=state, group_id=group.group_id,
                    state_weight=max(group.state_weights) if state is not None else 0.0, final=group.final,
                )
            )
        except (MergeFailed, WireError, TimeoutError, ConnectionError, OSError) as e:
            reason = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
            logger.warning("[%s] merge of round %d failed, merging alone: %s", self.peer_id[-6:], c.round, reason)
            return finish(alone_result(self.peer_id, c, failure=reason))
        except Exception as e:  # the future must never raise into the learner: a bug here costs one merge
            logger.exception("[%s] unexpected error in merge", self.peer_id[-6:])
            return finish(alone_result(self.peer_id, c, failure=f"{type(e).__name__}: {e}"))
        finally:
            if group is not None:
                self._groups.pop(group.group_id, None)

    async def _find_group(self, c: Contribution) -> _Group | None:
        window = self._window(c.round_s)
        if c.final:  # the last merge of this peer's run: worth the whole window to leave with everyone live
            window = max(window, self.cfg.merge_window_s)
        search = _Search(contribution=c, deadline=get_dht_time() + window)
        self._search = search
        me = self.peer_id
        silent: set[str] = set()
        try:
            await self._write_ready({"looking": True, "deadline": search.deadline}, ttl=window + 5)
            while not self._closed:
                if search.accepted_gid:
                    return await self._await_group(search)
                records = live_records(await read_subkeys(self.dht, peers_key(self.cfg.run_id)))
                records = {p: r for p, r in records.items() if p not in self.book.banned}  # not ours to wait for
                live = len(records)
                ready = {
                    p: r for p, r in (await read_subkeys(self.dht, ready_key(self.cfg.run_id))).items()
                    if r.get("looking") and p in records and p not in silent
                }  # a crashed peer's stale ready record must not make it everyone's leader
                ready[me] = {"deadline": search.deadline}
                now = get_dht_time()
                leader = min(ready)
                if search.accepted_gid:
                    return await self._await_group(search)
                if leader == me:
                    if len(ready) > 1 and (len(ready) >= live or now >= search.deadline):
                        return await self._lead(search, sorted(p for p in ready if p != me))
                    if now >= search.deadline or live <= 1:
                        return None
                else:
                    leader_deadline = float(ready[leader].get("deadline", search.deadline))
                    if now >= search.deadline + window:
                        return None
                    if now >= max(search.deadline, leader_deadline) + RPC_TIMEOUT_S:
                        silent.add(leader)  # it never invited us: look past it (the next one may lead)
                        continue
                try:
                    await asyncio.wait_for(search.invited.wait(), POLL_S)
                except TimeoutError:
                    pass
            return None
        finally:
            self._search = None
            # withdraw the ready record in the background: the exchange should not wait for the DHT
            task = asyncio.create_task(self._write_ready({"looking": False}, ttl=window + 5))
            self._tasks.add(task)  # keep a reference until it is done, or it may be collected mid-flight
            task.add_done_callback(self._tasks.discard)

    async def _write_ready(self, value: dict, ttl: float) -> None:
        # each version of our ready record must expire later than the last, or the DHT keeps the old one
        self._ready_expiration = max(get_dht_time() + ttl, self._ready_expiration + 1e-3)
        await write_subkey(self.dht, ready_key(self.cfg.run_id), self.peer_id, value, self._ready_expiration)

    def _window(self, round_s: float) -> float:
        """How long to wait for others to become ready.

        Sync mode waits up to merge_window_s, for everyone. Decoupled mode waits a fraction of this peer's
        recent round time (an EMA of the rounds' wall times as the learner reports them, else of the time
        between submits), in the spirit of Decoupled DiLoCo's grace window: long enough that peers finishing
        their round at about the same time meet, short enough that nobody's merges are held up by a slow or
        vanished peer. No constant to retune per model or link.
        """
        now = time.monotonic()
        interval = round_s if round_s > 0 else now - self._last_submit
        self._last_submit = now
        self._round_ema = interval if self._round_ema is None else 0.5 * self._round_ema + 0.5 * interval
        if self.cfg.sync:
            return self.cfg.merge_window_s
        # Peers whose rounds drifted apart by more than the window would never meet again: after each
        # merge alone the window doubles (up to merge_window_s) until a group forms, then it resets.
        base = max(self.cfg.min_window_s, self.cfg.window_fraction * self._round_ema)
        return min(self.cfg.merge_window_s, base * 2 ** min(self._alone_streak, 8))

    async def _lead(self, search: _Search, candidates: list[str]) -> _Group | None:
        search.leading = True  # from here on, invites from others are declined
        gid = secrets.token_hex(8)
        c = search.contribution
        candidates = [p for p in candidates if p not in self.book.banned]
        replies = await asyncio.gather(*(self._rpc(p, "invite", {"group_id": gid, "fp": self.fingerprint})
                                         for p in candidates))
        members, weights, state_weights, digests = [self.peer_id], [c.weight], [c.state_weight], [c.state_digest]
        rounds, finals = [c.round], [c.final]
        for peer, reply in zip(candidates, replies, strict=True):
            if reply and reply.get("accept") is True:
                try:
                    w, sw, d = float(reply["weight"]), float(reply["state_weight"]), str(reply["digest"])
                    r = int(reply.get("round", c.round))
                except (KeyError, TypeError, ValueError):
                    continue
                if w >= 0 and sw >= 0 and math.isfinite(w) and math.isfinite(sw):
                    members.append(peer)
                    weights.append(w)
                    state_weights.append(sw)
                    digests.append(d)
                    rounds.append(r)
                    finals.append(reply.get("final") is True)
        if self.guard.enabled:  # members far behind the group contribute stale updates: leave them out
            stale = stale_members(rounds, self.guard.max_round_lag)
            for i in reversed(range(1, len(members))):
                if stale[i]:
                    self.book.reject(members[i], STALE, gid, f"round {rounds[i]}", strike=False)
                    for column in (members, weights, state_weights, digests, finals):
                        del column[i]
        if len(members) == 1:
            return None
        final = any(finals)
        group = _Group(gid, members, weights, state_weights, len(set(digests)) > 1, self._lengths(), final)
        self._group_future(gid).set_result(group)
        notice = {"group_id": gid, "members": members, "weights": weights, "state_weights": state_weights,
                  "need_state": group.need_state, "final": final}
        await asyncio.gather(*(self._rpc(p, "group", notice) for p in members[1:]))
        logger.info("[%s] leading merge group %s of %d peers", self.peer_id[-6:], gid, len(members))
        return group

    async def _await_group(self, search: _Search) -> _Group | None:
        try:
            return await asyncio.wait_for(asyncio.shield(self._group_future(search.accepted_gid)), RPC_TIMEOUT_S)
        except TimeoutError:
            logger.info("[%s] leader %s never sent the group; merging alone", self.peer_id[-6:], search.leader[-6:])
            self._groups.pop(search.accepted_gid, None)
            return None

    def _lengths(self) -> dict[str, int]:
        return {"d": self.n_params, "s": 2 * self.n_params}

    def _group_future(self, gid: str) -> asyncio.Future:
        if gid not in self._groups:
            self._groups[gid] = asyncio.get_running_loop().create_future()
        return self._groups[gid]

    def _codec_for(self, tag: str) -> Codec:
        return self.codec if tag == "d" else Codec()

    async def _allreduce(self, group: _Group, me: int, tag: str, vector: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Average `vector` over the group.

        Returns:
            (the average, as every member holds it; `vector` as the others received it: each slice sent
            through the codec, this peer's own slice exact), the second for error feedback.
        """
        vector = vector.detach().float().contiguous().cpu()
        if vector.numel() != group.lengths[tag]:
            raise MergeFailed(f"vector of {vector.numel()} values, group expects {group.lengths[tag]}")
        codec = self._codec_for(tag)
        bounds = slice_bounds(vector.numel(), len(group.members))
        slot = self._slot(group, tag, me)
        lo, hi = bounds[me]
        slot.add(me, vector[lo:hi].clone())
        sent = [vector[a:b] for a, b in bounds]

        async def exchange(j: int) -> torch.Tensor:
            if j == me:
                averaged, _ = await asyncio.shield(slot.result)
                return averaged
            lo, hi = bounds[j]
            data = codec.encode(vector[lo:hi])
            try:
                sent[j] = codec.decode(data, hi - lo)
            except NonFiniteError:  # our own Δ is not finite: send it anyway, the owner's guards will say so
                sent[j] = torch.full((hi - lo,), float("nan"))
            header = {"group_id": group.group_id, "tag": tag, "index": me, "codec": codec.name}
            reply, payload = await self._call(group.members[j], "part", header, data, codec.encoded_size(hi - lo))
            if not reply.get("ok"):
                raise MergeFailed(f"member {group.members[j][-6:]} could not reduce its slice: {reply.get('error')}")
            try:
                averaged = codec.decode(payload, hi - lo)
            except CodecError as e:
                raise MergeFailed(f"member {group.members[j][-6:]} returned an undecodable slice: {e}") from None
            if not torch.isfinite(averaged).all():
                raise MergeFailed(f"member {group.members[j][-6:]} returned non-finite values")
            if self.guard.enabled:  # the owner of a slice could return anything: never apply garbage
                bad = check_average(averaged, vector[lo:hi], self.guard.norm_bound)
                if bad:
                    self.book.reject(group.members[j], bad, group.group_id, "in its averaged slice")
                    raise MergeFailed(f"member {group.members[j][-6:]} returned a bad average ({bad})")
            return averaged

        parts = await asyncio.gather(*(exchange(j) for j in range(len(group.members))))
        return torch.cat(parts), torch.cat(sent)

    def _slot(self, group: _Group, tag: str, me: int) -> _Slot:
        return group.slot(tag, self._codec_for(tag),
                          lambda parts, weights, flags: self._reduce_slice(group, tag, me, parts, weights, flags))

    def _reduce_slice(self, group: _Group, tag: str, me: int, parts: list[torch.Tensor], weights: list[float],
                      flags: dict[int, str]) -> torch.Tensor:
        """This peer's slice of the group average: screen every member's part, then combine those accepted.

        Runs once per slice, on its owner, so whatever it decides every member receives the same bits.
        """
        g = self.guard
        if not g.enabled:
            return weighted_average(parts, weights)
        reasons = screen_parts(parts, me, g.norm_bound, g.min_cosine)
        reasons = [flags.get(i) or r for i, r in enumerate(reasons)]
        for i, reason in enumerate(reasons):
            if reason:
                self.book.reject(group.members[i], reason, group.group_id, f"(slice {tag})", strike=i != me)
        keep = [i for i, r in enumerate(reasons) if not r]
        for i in keep:
            self.book.accept(group.members[i], group.group_id)
        if not keep:
            raise MergeFailed("every contribution to this slice was rejected")
        kept, kept_w = [parts[i] for i in keep], [weights[i] for i in keep]
        if tag == "s":  # global models are averaged by tokens absorbed, so that a fresh peer adopts the swarm's
            return weighted_average(kept, kept_w)
        return aggregate(g.aggregate, kept, kept_w, g.robust_min_group, g.trim_fraction)

    # ---- requests ----

    async def _call(self, peer: str, op: str, header: dict, payload: bytes = b"", max_reply: int = 0) -> tuple[dict, bytes]:
        _, reader, writer = await self._p2p.call_binary_stream_handler(PeerID.from_base58(peer), self._proto(op))
        try:
            await send_msg(writer, {**header, "auth": self.auth.tag(op, self.peer_id, peer)}, payload, self.counter)
            reply, data = await recv_msg(reader, max_reply, self.counter)
        finally:
            writer.close()
        if not self.auth.verify(op + ":reply", peer, self.peer_id, reply.get("auth")):
            raise MergeFailed(f"{op} reply from {peer[-6:]} without the swarm key")
        return reply, data

    async def _reply(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, op: str, requester: str,
                     header: dict, payload: bytes = b"") -> None:
        """Send a handler's reply and keep the stream open until the requester has read it (see wire.py)."""
        await send_msg(writer, {**header, "auth": self.auth.tag(op + ":reply", self.peer_id, requester)}, payload,
                       self.counter)
        await await_requester_close(reader)

    def _authorized(self, op: str, requester: str, header: dict) -> bool:
        if self.auth.verify(op, requester, self.peer_id, header.get("auth")):
            return True
        logger.warning("[%s] refused a %s request from %s: no valid swarm key", self.peer_id[-6:], op, requester[-8:])
        return False

    async def _rpc(self, peer: str, op: str, header: dict) -> dict | None:
        """A small request with a short timeout; None if the peer did not answer."""
        try:
            reply, _ = await asyncio.wait_for(self._call(peer, op, header), RPC_TIMEOUT_S)
            return reply
        except Exception as e:  # an unreachable or dead peer is normal in a swarm
            logger.debug("[%s] %s to %s failed: %r", self.peer_id[-6:], op, peer[-6:], e)
            return None

    # ---- handlers: what other peers ask of us ----

    async def _on_invite(self, info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            header, _ = await asyncio.wait_for(recv_msg(reader, 0, self.counter), RPC_TIMEOUT_S)
            search, gid, leader = self._search, header.get("group_id"), info.peer_id.to_base58()
            reply = {"accept": False}
            if not self._authorized("invite", leader, header):
                return
            if leader in self.book.banned:
                reply["error"] = "banned"
            elif header.get("fp", "") != self.fingerprint:
                reply["error"] = "config fingerprint differs"
            elif search is not None and not search.leading and not search.accepted_gid and isinstance(gid, str) and gid:
                search.accepted_gid, search.leader = gid, leader
                search.invited.set()
                c = search.contribution
                reply = {"accept": True, "weight": c.weight, "state_weight": c.state_weight, "digest": c.state_digest,
                         "round": c.round, "final": c.final}
            await self._reply(reader, writer, "invite", leader, reply)
        except Exception as e:
            logger.debug("[%s] bad invite: %r", self.peer_id[-6:], e)
        finally:
            writer.close()

    async def _on_group(self, info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            header, _ = await asyncio.wait_for(recv_msg(reader, 0, self.counter), RPC_TIMEOUT_S)
            gid = header.get("group_id")
            search = self._search
            if not self._authorized("group", info.peer_id.to_base58(), header):
                return
            ok = (
                search is not None and gid == search.accepted_gid and info.peer_id.to_base58() == search.leader
                and self._valid_notice(header)
            )
            if ok:
                group = _Group(
                    gid, [str(m) for m in header["members"]], [float(w) for w in header["weights"]],
                    [float(w) for w in header["state_weights"]], bool(header["need_state"]), self._lengths(),
                    header.get("final") is True,
                )
                fut = self._group_future(gid)
                if not fut.done():
                    fut.set_result(group)
            await self._reply(reader, writer, "group", info.peer_id.to_base58(), {"ok": ok})
        except Exception as e:
            logger.debug("[%s] bad group notice: %r", self.peer_id[-6:], e)
        finally:
            writer.close()

    def _valid_notice(self, h: dict) -> bool:
        members, weights, sw = h.get("members"), h.get("weights"), h.get("state_weights")
        return (
            isinstance(members, list) and isinstance(weights, list) and isinstance(sw, list)
            and 2 <= len(members) == len(weights) == len(sw) and all(isinstance(m, str) for m in members)
            and len(set(members)) == len(members) and self.peer_id in members
            and all(isinstance(w, int | float) and not isinstance(w, bool) and math.isfinite(w) and w >= 0
                    for w in weights + sw)
            and isinstance(h.get("need_state"), bool)
        )

    async def _on_part(self, info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            max_part = 2 * self.n_params * 4
            header, payload = await asyncio.wait_for(recv_msg(reader, max_part, self.counter), self.cfg.merge_timeout_s)
            sender = info.peer_id.to_base58()
            if not self._authorized("part", sender, header):
                return
            try:
                data = await self._reduce_part(sender, header, payload)
                await self._reply(reader, writer, "part", sender, {"ok": True}, data)
            except (MergeFailed, TimeoutError) as e:
                await self._reply(reader, writer, "part", sender, {"ok": False, "error": f"{type(e).__name__}: {e}"})
        except Exception as e:
            logger.debug("[%s] part exchange failed: %r", self.peer_id[-6:], e)
        finally:
            writer.close()

    async def _reduce_part(self, sender: str, header: dict, payload: bytes) -> bytes:
        """Add a member's slice to the slot this peer reduces; return the encoded average once all arrived."""
        gid, tag, index = header.get("group_id"), header.get("tag"), header.get("index")
        if not isinstance(gid, str) or tag not in ("d", "s") or not isinstance(index, int):
            raise MergeFailed("malformed part header")
        codec = self._codec_for(tag)
        if header.get("codec", "none") != codec.name:
            raise MergeFailed(f"part encoded with {header.get('codec')!r}, this peer merges with {codec.name!r}")
        search = self._search
        if gid not in self._groups and (search is None or search.accepted_gid != gid):
            raise MergeFailed("unknown group")  # checked first so that strangers cannot make us hold state
        self._group_future(gid)  # our own group notice may still be on its way
        group: _Group = await asyncio.wait_for(asyncio.shield(self._groups[gid]), RPC_TIMEOUT_S)
        if not 0 <= index < len(group.members) or group.members[index] != sender:
            raise MergeFailed("sender is not that member of the group")
        me = group.members.index(self.peer_id)
        lo, hi = slice_bounds(group.lengths[tag], len(group.members))[me]
        flag = BANNED if sender in self.book.banned else ""
        try:
            part = codec.decode(payload, hi - lo)
        except CodecError as e:
            if not self.guard.enabled:
                raise MergeFailed(f"bad part from {sender[-6:]}: {e}") from None
            # with guards, a malformed part is left out of the average instead of failing everyone's merge
            part = torch.full((hi - lo,), float("nan"))
            flag = flag or (NONFINITE if isinstance(e, NonFiniteError) else SHAPE)
        if not self.guard.enabled and not torch.isfinite(part).all():
            raise MergeFailed(f"non-finite values from {sender[-6:]}")
        await self._inject("serve_part", self._round)
        slot = self._slot(group, tag, me)
        slot.add(index, part, flag)
        _, data = await asyncio.wait_for(asyncio.shield(slot.result), self.cfg.merge_timeout_s)
        return data
