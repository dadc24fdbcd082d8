"""Forming a merge group with whichever of this epoch's group mates are ready now.

1. **Mates.** Every epoch (`merge.epoch_s`) the peers in the epoch's census (census.py: one DHT record per
   peer) are dealt into groups of at most `merge.group_size` by the hash of their ids with the epoch
   (`my_group`, `leader_rank`): groups change every epoch.
2. **Ready.** A peer looking for a group tells its mates so, peer to peer, with its deadline and the nonce it
   committed to for the epoch; nothing is polled from the DHT, so a peer's DHT work does not grow with the swarm.
3. **Group.** The first ready mate in the order drawn from their nonces leads (leaders.py): it invites the ready
   mates as soon as every reachable mate is ready, or at its deadline with whoever is. Each peer accepts at most one invite per
   merge; the leader then sends the final member list, the members' weights, whether their global models
   disagree (digests differ) and the newest state all of them hold (`Group.anchor`) to every member. A peer not
   invited in time merges alone; a leader that never invites is passed over for a while.

Nothing a peer claims is taken as is: weights are capped by the group's median (`bounded_weights`), a member
checks that the notice carries its own claims unchanged (and an anchor it holds), and a deadline further off
than any honest window is not believed. How long a peer looks is its *window* (see `search.Window`).
"""

from __future__ import annotations

import asyncio
import logging
import math
import secrets

import hivemind
from hivemind.utils.timed_storage import get_dht_time

from p2pdiloco.algorithm.guards import STALE, GuardBook, stale_members
from p2pdiloco.config import PROTOCOL_VERSION, Config, GuardConfig, protocol_fields, protocol_of
from p2pdiloco.network.admission import Request
from p2pdiloco.network.census import Census, epoch_of, my_group
from p2pdiloco.network.dialable import Dialability
from p2pdiloco.network.group import OTHER_NOTICE, Group, group_of_notice, own_claims_kept, valid_notice
from p2pdiloco.network.leaders import Leaders
from p2pdiloco.network.merger import Contribution
from p2pdiloco.network.peer_tag import PeerLog, short_id
from p2pdiloco.network.rpc import RPC_TIMEOUT_S, MergeFailed, Rpc
from p2pdiloco.network.search import DECLINES, OTHER_PROTOCOLS, Search, Window, decline_reason, leader_refusal
from p2pdiloco.util.numbers import finite_number

logger = logging.getLogger(__name__)

POLL_S = 0.25
"""How often a search looks at its deadlines when no mate's word or invite wakes it."""

EPOCH_ROUNDS = 10
"""Fewer of this peer's rounds in an epoch (`merge.epoch_s`), where groups do not span the census, is warned of."""


class Matchmaker:
    """Finds this peer a merge group, leads one, or answers another leader's invite.

    Args:
        dht: this peer's running DHT.
        cfg: the run's config; matchmaking reads its swarm's run id, its sync mode and its merge settings.
        rpc: requests to other peers (invites, group notices).
        book: banned peers are neither invited nor followed; stale members are recorded there.
        guard: guard settings (whether stale members are left out, and how far behind is stale).
        fingerprint: digest of the run config; invites from leaders with another one are declined.
        lengths: vector length per tag, the same on every peer (see `Group.lengths`).
        census_secret: the key of this peer's census nonces (`Census`); None: drawn at start.
    """

    def __init__(self, dht: hivemind.DHT, cfg: Config, rpc: Rpc, book: GuardBook, guard: GuardConfig,
                 fingerprint: str, lengths: dict[str, int], census_secret: bytes | None = None):
        self.dht, self.cfg, self.rpc, self.book, self.guard = dht, cfg, rpc, book, guard
        self.fingerprint, self.lengths, self.peer_id = fingerprint, lengths, rpc.peer_id
        self.log = PeerLog(logger, self.peer_id)
        self._search: Search | None = None
        self._groups: dict[str, asyncio.Future] = {}
        self._closed = self._warned_epochs = False
        self.window = Window(cfg)
        """How long this peer's searches wait for mates, from what its last rounds and merges took."""
        self._other_protocol: set[str] = set()  # leaders of another protocol version, declined and said so once
        self._tasks: set[asyncio.Task] = set()
        self.census = Census(dht, cfg.swarm.run_id, self.peer_id, cfg.merge.epoch_s, census_secret)
        self.leaders = Leaders(cfg.swarm.run_id, self.census, rpc.gate.refusing)
        self._ready: dict[str, float] = {}
        """Mates that told us they are looking for a group: peer id -> until when (DHT time)."""
        self._closers: set[str] = set()
        """Mates whose word that they are looking said it is for one of their last merges (`Contribution.closing`)."""
        self._liars: set[str] = set()  # announced a deadline no honest window reaches: never counted as live
        self._changed = asyncio.Event()  # a mate's readiness changed or an invite came: the search looks again
        self.dial = Dialability(self.peer_id)
        """Who can be dialed: only a peer others can dial leads or owns a slice (dialable.py)."""
        self.alone_cause = ""
        """Why the last search ended without a group, one word of `ALONE_CAUSES` ('' when it found one)."""
        self.marks: dict[str, float] = {}
        """When (monotonic) the last search passed each of its steps, for a merge's timeline (`MergeStats.marks`):
        `census` (its epoch's census read), `ready` (a leader: its mates ready or its deadline; a member: the
        invite it accepted came), `invited` (a leader: the invites answered), `grouped` (the group known: a
        leader's notices sent, a member's notice received)."""

    def close(self) -> None:
        """Stop looking: a search in progress ends alone."""
        self._closed = True

    @property
    def closed(self) -> bool:
        return self._closed

    def record(self, alone: bool) -> None:
        """The outcome of this peer's last merge, for the window of its next searches (`Window.record`)."""
        self.window.record(alone, self.marks)

    def forget(self, group_id: str) -> None:
        """The merge of `group_id` is over: parts for it are refused from now on."""
        self._groups.pop(group_id, None)

    async def expected_group(self, group_id: str) -> Group:
        """The group `group_id`, once its notice is here.

        Raises:
            MergeFailed: this peer neither is in that group nor accepted an invite to it.
            TimeoutError: the leader's notice did not come in time.
        """
        search = self._search
        if group_id in self.leaders.told_apart:
            raise MergeFailed(f"a member {OTHER_NOTICE} (its leader told members different groups)")
        if group_id not in self._groups and (search is None or search.accepted_gid != group_id):
            raise MergeFailed("unknown group")  # checked first so that strangers cannot make us hold state
        self._group_future(group_id)  # our own group notice may still be on its way
        return await asyncio.wait_for(asyncio.shield(self._groups[group_id]), RPC_TIMEOUT_S)

    async def find_group(self, c: Contribution, part: str = "") -> Group | None:
        """A group to merge `c` with, or None: merge alone. `part`: the digest of its encoded sparse part, which the
        group's notice lists for every member (a gathered codec's parts may be relayed, sparse_exchange.py)."""
        window = self.window.length(c.round_s)
        self._warn_short_epochs()
        if closing := c.last_merges():  # about its last merge (own counters): worth the whole window
            window = max(window, self.cfg.merge.merge_window_s)
        now = get_dht_time()
        search = Search(contribution=c, deadline=now + window, epoch=epoch_of(now, self.cfg.merge.epoch_s), part=part)
        self._search, self.marks, self.alone_cause = search, search.marks, ""
        me = self.peer_id
        passed_over = self.leaders.new_search(search.epoch)  # never invited us lately: not followed, still invited
        silent: set[str] = set()
        followed = ""  # the leader this peer waited for at the last poll
        try:
            await self.census.register(search.epoch)
            while not self._closed:
                epoch = epoch_of(get_dht_time(), self.cfg.merge.epoch_s)
                if epoch != search.epoch:  # groups redealt: so is this search (in
                    search.epoch, followed = epoch, ""  # its first order it could wait for a mate's invite while
                    search.earlier, search.told = search.earlier | search.told, set()  # that mate, in the new
                    await self.census.register(epoch)  # order, waited for its invite); mates hear this epoch's nonce
                census = [p for p in await self.census.members(search.epoch) if p not in self.book.banned]
                search.mark("census")
                if search.accepted_gid:  # checked after the awaits: an invite accepted during them is a group
                    return await self._await_group(search)  # its leader counts on (it was once left alone)
                # a run's last merges take every mate they can reach, so that peers finishing together end on one
                # global model (at 16 peers in `bench scale`, a group of 8 a few steps ahead ended on its own)
                size = len(census) + 1 if closing else self.cfg.merge.group_size
                mates = my_group(self.cfg.swarm.run_id, me, census, search.epoch, size)
                self._announce(search, [p for p in mates if p not in search.told and p != me], True)
                now = get_dht_time()
                # a mate past its deadline still waits for an invite a while (see the follower's timeouts below)
                ready = {p for p in mates if p == me or (self._ready.get(p, 0.0) + RPC_TIMEOUT_S >= now
                                                         and p not in silent and p not in search.unreachable)}
                live = sum(p not in search.unreachable and not self._uncounted(p) for p in mates)
                only_closers = self._follows_only_closers(c)
                order = self.leaders.order(mates, ready, search.epoch)
                leader = next((p for p in order if self.dial.can_lead(p) and (p == me or (
                    not self.leaders.passed_over(p, passed_over, search.epoch)
                    and (not only_closers or p in self._closers)))), None)
                followed = self.leaders.follow(search, followed, None if leader == me else leader, ready, self._ready,
                                               silent)
                if leader is None:  # nobody ready can lead (this peer cannot be dialed): wait for one who can
                    if now >= search.deadline:
                        self.dial.nobody_leads(len(ready) - 1, len(search.unreachable & set(mates)))
                        return self._alone("no_leader")
                elif leader == me:
                    if len(ready) > 1 and (len(ready) >= live or now >= search.deadline):
                        search.mark("ready")
                        return await self._lead(search, sorted(p for p in ready if p != me))
                    if now >= search.deadline or (live <= 1 and self.census.settled(search.epoch)):
                        return self._alone("no_mate_ready" if live > 1 else "no_mate")
                else:
                    if now >= search.deadline + window:
                        # it never invited us; whatever deadline it claims, follow others in the next searches
                        self.leaders.pass_over(leader, search.epoch)
                        return self._alone("not_invited")
                    if now >= max(search.deadline, self._ready.get(leader, now)) + RPC_TIMEOUT_S:
                        silent.add(leader)  # it never invited us: look past it (the next one may lead)
                        self.leaders.pass_over(leader, search.epoch)  # and in the next searches too
                        continue
                self._changed.clear()
                try:
                    await asyncio.wait_for(self._changed.wait(), POLL_S)
                except TimeoutError:
                    pass
            return self._alone("closed")
        finally:
            self._search = None
            # in the background: the exchange must not wait
            self._announce(search, sorted(search.told | search.earlier), False)

    def _alone(self, cause: str) -> None:
        """End a search without a group, for `cause` (one of `ALONE_CAUSES`)."""
        self.alone_cause = cause

    def _announce(self, search: Search, peers: list[str], looking: bool) -> None:
        """Tell `peers` (group mates) that this peer is looking for a group until its deadline, or no longer is.
        Sent in the background; a mate that cannot be reached is not waited for in this search."""
        search.told.update(peers)
        header = self.dial.says({"looking": looking, "deadline": search.deadline, "epoch": search.epoch,
                                 "closing": search.contribution.last_merges(), **self.leaders.reveal(search.epoch)})

        async def tell(peer: str) -> None:
            if await self.rpc.request(peer, "ready", header) is None and looking:
                search.unreachable.add(peer)
                self._ready.pop(peer, None)  # what it said before it died (a killed peer never says it stopped)
                self._changed.set()
            elif looking:
                search.acked.setdefault(peer, get_dht_time())

        for peer in peers:
            self._in_background(tell(peer))

    def _in_background(self, coro) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)  # keep a reference until it is done, or it may be collected mid-flight
        task.add_done_callback(self._tasks.discard)

    def _follows_only_closers(self, c: Contribution) -> bool:
        """Whether a search for `c` follows and accepts only leaders about their last merges too, where groups do not
        span the census: another leader's finishing members ended apart from the rest (32 peers in `bench scale`)."""
        return c.last_merges() and self.census.size > self.cfg.merge.group_size

    def _uncounted(self, mate: str) -> bool:
        """A mate no leader here waits for (a flooder not looking made each wait out its window): see `_liars`, `refusing`."""
        return mate in self._liars or self.rpc.gate.refusing(mate)

    def _plausible(self, deadline: object, now: float) -> bool:
        """A deadline an honest peer could have announced: no window is longer than `merge_window_s`, so a
        deadline further off is a claim meant to make mates wait (a hostile `leader`)."""
        return finite_number(deadline) and deadline <= now + self.cfg.merge.merge_window_s + RPC_TIMEOUT_S

    def _warn_short_epochs(self) -> None:
        """Say once if groups are redrawn within a few of this peer's rounds while they do not span the census: each
        redrawing puts members whose global models differ together, and their next merge also agrees on
        (θg, momentum), about 7× the bytes of an int4 Δ exchange (docs/architecture.md, Mates)."""
        if (not self._warned_epochs and self.window.round_ema and self.census.size > self.cfg.merge.group_size
                and self.cfg.merge.epoch_s < EPOCH_ROUNDS * self.window.round_ema):
            self._warned_epochs = True
            self.log.warning("groups are redrawn every %.0f s, %.1f of this peer's rounds: most merges will agree "
                             "on global models too; set merge.epoch_s to %d rounds or more",
                             self.cfg.merge.epoch_s, self.cfg.merge.epoch_s / self.window.round_ema, EPOCH_ROUNDS)

    async def _lead(self, search: Search, candidates: list[str]) -> Group | None:
        search.leading = True  # from here on, invites from others are declined
        gid = secrets.token_hex(8)
        c = search.contribution
        candidates = [p for p in candidates if p not in self.book.banned and not self.rpc.gate.refusing(p)]
        invite = {"group_id": gid, "fp": self.fingerprint, "closing": c.last_merges(), **protocol_fields()}
        replies = await asyncio.gather(*(self.rpc.request(p, "invite", invite) for p in candidates))
        search.mark("invited")
        members, weights, state_weights, digests = [self.peer_id], [c.weight], [c.state_weight], [c.state_digest]
        rounds, finals, anchors, dialable, parts = [c.round], [c.final], [list(c.anchors)], [True], [search.part]
        declines: list[str] = []
        for peer, reply in zip(candidates, replies, strict=True):
            if not reply:
                declines.append("unreachable")
            elif reply.get("accept") is not True:
                declines.append(why if (why := reply.get("why")) in DECLINES else "other")
            else:
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
                    anchors.append(reply["anchors"] if isinstance(reply.get("anchors"), list) else [])
                    dialable.append(self.dial.member_dialable(peer, reply))
                    parts.append(reply["part"] if isinstance(reply.get("part"), str) else "")
        if self.guard.enabled:  # members far behind the group contribute stale updates: leave them out
            stale = stale_members(rounds, self.guard.max_round_lag)
            for i in reversed(range(1, len(members))):
                if stale[i]:
                    self.book.reject(members[i], STALE, gid, f"round {rounds[i]}", strike=False)
                    for column in (members, weights, state_weights, digests, finals, anchors, dialable, parts):
                        del column[i]
                    declines.append("stale")
        if len(members) == 1:  # every invite declined: why, for `bench scale`'s account of merges alone
            return self._alone("declined:" + "+".join(sorted(set(declines))))
        final = any(finals)
        need_state = len(set(digests)) > 1  # the newest state all hold, if any, is what they send differences from
        anchor = next((a for a in anchors[0] if need_state and all(a in held for held in anchors[1:])), "")
        notice = {"group_id": gid, "members": members, "weights": weights, "state_weights": state_weights,
                  "need_state": need_state, "final": final, "anchor": anchor, "closing": c.last_merges(),
                  "digests": digests}
        if not all(dialable):
            notice["owners"] = [i for i, d in enumerate(dialable) if d]
        if all(parts):
            notice["parts"] = parts
        group = group_of_notice(notice, self.lengths)
        self._group_future(gid).set_result(group)
        # sent, not waited for: the leader's exchange starts now, and its parts reach their owners before the
        # members' own (a member that refuses the notice fails the exchange whether or not the leader waited)
        for p in members[1:]:
            self._in_background(self.rpc.request(p, "group", notice))
        search.mark("grouped")
        self.log.info("leading merge group %s of %d peers", gid, len(members))
        return group

    async def _await_group(self, search: Search) -> Group | None:
        try:
            group = await asyncio.wait_for(asyncio.shield(self._group_future(search.accepted_gid)), RPC_TIMEOUT_S)
            self.leaders.joined(search.accepted_gid, search.leader, search.epoch)
            return group
        except TimeoutError:
            self.log.info("leader %s never sent the group; merging alone", short_id(search.leader))
            self._groups.pop(search.accepted_gid, None)
            return self._alone("no_notice")

    def _group_future(self, gid: str) -> asyncio.Future:
        if gid not in self._groups:
            self._groups[gid] = asyncio.get_running_loop().create_future()
        return self._groups[gid]

    # ---- handlers: what other peers' leaders ask of us ----

    async def on_invite(self, request: Request, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Another leader's invite (its tag already checked; the stream is closed after, see `Rpc.start`)."""
        await self.rpc.receive_payload(reader, 0)  # an invite carries none
        header, leader = request.header, request.sender
        search, gid = self._search, header.get("group_id")
        reply = {"accept": False, "why": decline_reason(search)}
        if refusal := leader_refusal(leader in self.book.banned, self.rpc.gate.refusing(leader),
                                     search is not None and self.leaders.distrusted(leader, search.epoch)):
            reply["why"], reply["error"] = refusal
        elif (theirs := protocol_of(header)) != PROTOCOL_VERSION:
            reply["error"], reply["why"] = f"wire protocol {theirs} differs from this peer's {PROTOCOL_VERSION}", "protocol"
            if leader not in self._other_protocol and len(self._other_protocol) < OTHER_PROTOCOLS:  # once each
                self._other_protocol.add(leader)
                self.log.warning("declined the invites of %s: it speaks wire protocol %s, this peer %d",
                                 short_id(leader), theirs, PROTOCOL_VERSION)
        elif header.get("fp", "") != self.fingerprint:
            reply["error"], reply["why"] = "config fingerprint differs", "config"
        elif search is not None and self._follows_only_closers(search.contribution) and header.get("closing") is not True:
            reply["error"], reply["why"] = "about its last merges, it follows only a leader that is too", "closing"
        elif search is not None and not search.leading and not search.accepted_gid and isinstance(gid, str) and gid:
            search.accepted_gid, search.leader = gid, leader
            search.mark("ready")
            self._changed.set()
            c = search.contribution
            reply = self.dial.says({"accept": True, "weight": c.weight, "state_weight": c.state_weight,
                                    "digest": c.state_digest, "round": c.round, "final": c.final,
                                    "anchors": list(c.anchors), **({"part": search.part} if search.part else {})})
        await self.rpc.reply(reader, writer, "invite", leader, reply)

    async def on_ready(self, request: Request, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """A mate's word that it is looking for a group until its deadline, or no longer is (its tag already
        checked). A deadline further off than any honest window is not believed (`_plausible`)."""
        await self.rpc.receive_payload(reader, 0)  # it carries none
        header, peer = request.header, request.sender
        now = get_dht_time()
        self._ready = {p: d for p, d in self._ready.items() if d + RPC_TIMEOUT_S >= now and (p != peer or Search.overtaken(header, d))}
        self._closers = {p for p in self._closers if p in self._ready}
        if header.get("looking") is True and self._plausible(header.get("deadline"), now):
            self._ready[peer] = float(header["deadline"])
            if header.get("closing") is True:
                self._closers.add(peer)
        elif header.get("looking") is True:  # meant to be waited for: never waited for again
            self._liars.add(peer)
        if isinstance(header.get("epoch"), int):
            self.census.saw(peer, header["epoch"])
            self.leaders.heard(peer, header)
        self.dial.heard(peer, header)
        if self._search is not None:  # it reached this peer: streams to it ride its connection, whoever opens them
            self._search.unreachable.discard(peer)
        self._changed.set()
        await self.rpc.reply(reader, writer, "ready", peer, {"ok": True})

    async def on_group(self, request: Request, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """The leader's group notice (its tag already checked; the stream is closed after, see `Rpc.start`)."""
        await self.rpc.receive_payload(reader, 0)  # a notice carries none
        header = request.header
        gid = header.get("group_id")
        search = self._search
        ok = (
            search is not None and gid == search.accepted_gid and request.sender == search.leader
            and valid_notice(header, self.peer_id, self.cfg.merge.group_size)
            and own_claims_kept(header, self.peer_id, search.contribution, self.dial.dialable, search.part)
        )
        if ok:
            fut = self._group_future(gid)
            if not fut.done():
                fut.set_result(group_of_notice(header, self.lengths))
                search.mark("grouped")
        elif search is not None and gid == search.accepted_gid and request.sender == search.leader:
            self.leaders.distrust(search.leader, search.epoch)  # its own notice, signed by its stream: no doubt
        await self.rpc.reply(reader, writer, "group", request.sender, {"ok": ok})
