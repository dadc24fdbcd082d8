"""Key holders that abuse what a peer serves, with real p2p daemons on loopback (docs/security.md, "Per-sender
limits"): a pinner that re-asks for the state every 0.1 s and never reads it must not keep an honest joiner
from the state, and a flood of valid requests from one key holder must not take the places honest mates need.
"""

from __future__ import annotations

import asyncio
import time

import pytest
import torch
from hivemind.p2p import P2P, PeerID
from hivemind.utils.timed_storage import get_dht_time

from p2pdiloco.algorithm.outer import state_digest
from p2pdiloco.config import GuardConfig
from p2pdiloco.network.admission import MAX_PER_SENDER, SENDER_BURST, SENDER_RATE, StreamGate
from p2pdiloco.network.census import epoch_of, registered_now
from p2pdiloco.network.merger import Contribution
from p2pdiloco.network.p2p_merger import P2PMerger
from p2pdiloco.network.state_slots import (
    BACKOFF_S,
    DOWNLOAD_EVERY_S,
    DOWNLOADS_BURST,
    MAX_BACKOFF_S,
    MAX_WAITING,
    StateSlots,
)
from p2pdiloco.network.state_sync import GlobalState, StateBusy, StateSync
from p2pdiloco.network.swarm import start_dht, swarm_auth
from p2pdiloco.network.swarm_key import write_new_key
from p2pdiloco.network.wire import SEND_STALL_S, ByteCounter, send_deadline, send_msg
from tests.conftest import flat, merge_config, running_mergers, wait_for, with_swarm

BIG_STATE = 4_000_000
"""Parameters of the donor's state: 32 MB, more than the daemons and sockets buffer between two peers, so that
a reader that never reads stalls the download."""


class _Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


# ---- the slots alone ----


def test_one_slot_per_sender_and_a_stalled_sender_is_backed_off_longer_each_time():
    clock = _Clock()
    slots = StateSlots(slots=2, clock=clock)
    assert slots.ask("pinner", 10) is None
    refusal = slots.ask("pinner", 10)
    assert refusal is not None and refusal.reason == "one at a time" and 0 < refusal.retry_after_s <= 10
    assert slots.ask("honest", 10) is None  # the second slot is the honest joiner's
    slots.release("honest", stalled=False, completed=True)
    slots.release("pinner", stalled=True)
    refusal = slots.ask("pinner", 10)
    assert refusal.reason == "backed off" and refusal.retry_after_s == BACKOFF_S
    clock.now += BACKOFF_S
    assert slots.ask("pinner", 10) is None
    slots.release("pinner", stalled=True)
    assert slots.ask("pinner", 10).retry_after_s == 2 * BACKOFF_S  # grows with each stall
    for _ in range(10):
        clock.now += MAX_BACKOFF_S
        assert slots.ask("pinner", 10) is None
        slots.release("pinner", stalled=True)
    assert slots.ask("pinner", 10).retry_after_s == MAX_BACKOFF_S  # up to a bound
    clock.now += MAX_BACKOFF_S
    assert slots.ask("pinner", 10) is None
    slots.release("pinner", stalled=False)  # a stream that broke forgets nothing
    assert slots.ask("pinner", 10) is None
    slots.release("pinner", stalled=True)
    assert slots.ask("pinner", 10).retry_after_s == MAX_BACKOFF_S
    clock.now += MAX_BACKOFF_S
    assert slots.ask("pinner", 10) is None
    slots.release("pinner", stalled=False, completed=True)  # a download sent to the end forgets the stalls
    assert slots.ask("pinner", 10) is None
    slots.release("pinner", stalled=True)
    assert slots.ask("pinner", 10).retry_after_s == BACKOFF_S
    assert slots.refused == {"busy": 0, "one at a time": 1, "backed off": 5, "served recently": 0}
    # what a peer's summary says it did as a donor: 2 sent to the end, 14 cut, the broken stream neither
    assert slots.report() == {"served": 2, "cut": 14, "refused": slots.refused}


def test_a_second_state_stream_of_one_sender_is_refused_while_its_first_is_open():
    slots = StateSlots(slots=2, clock=_Clock())
    assert slots.opened("pinner") is None and slots.opened("honest") is None
    refusal = slots.opened("pinner")  # its first is still open (a download, or a reply not yet closed)
    assert refusal is not None and refusal.reason == "one at a time" and refusal.retry_after_s > 0
    slots.closed("pinner")
    assert slots.open == {"pinner": 1, "honest": 1}
    slots.closed("pinner")
    assert slots.opened("pinner") is None  # closed: it may ask again
    assert slots.refused["one at a time"] == 1


def test_a_sender_is_served_a_few_downloads_back_to_back_then_one_a_minute():
    clock = _Clock()
    slots = StateSlots(slots=2, clock=clock)
    for _ in range(DOWNLOADS_BURST):
        assert slots.ask("reader", 10) is None  # reads every download to the end, at once
        slots.release("reader", stalled=False, completed=True)
    refusal = slots.ask("reader", 10)
    assert refusal.reason == "served recently" and refusal.retry_after_s == pytest.approx(DOWNLOAD_EVERY_S)
    assert slots.ask("joiner", 10) is None  # others' budgets are their own
    clock.now += DOWNLOAD_EVERY_S / 2
    assert slots.ask("reader", 10).retry_after_s == pytest.approx(DOWNLOAD_EVERY_S / 2)
    clock.now += DOWNLOAD_EVERY_S / 2
    assert slots.ask("reader", 10) is None  # one more a minute
    slots.release("reader", stalled=False, completed=True)
    assert slots.ask("reader", 10).reason == "served recently"
    clock.now += DOWNLOADS_BURST * DOWNLOAD_EVERY_S  # a full budget again, and forgotten
    assert slots.ask("other", 10) is None and "reader" not in slots.downloads
    assert slots.refused["served recently"] == 3


def test_a_freed_slot_goes_to_who_waited_first_and_a_waiter_that_left_loses_its_place():
    clock = _Clock()
    slots = StateSlots(slots=2, clock=clock)
    assert slots.ask("a", 10) is None and slots.ask("b", 10) is None
    honest = slots.ask("honest", 10)
    assert honest.reason == "busy" and 0 < honest.retry_after_s <= 10
    clock.now += 0.1
    assert slots.ask("c", 10).reason == "busy"  # queued behind the honest joiner
    slots.release("a", stalled=True)
    assert slots.ask("c", 10).reason == "busy"  # the freed slot is held for the honest joiner
    assert slots.ask("a", 10).reason == "backed off"
    clock.now += honest.retry_after_s
    assert slots.ask("honest", 10) is None
    assert slots.ask("c", 10).reason == "busy"  # none free; c is first in the queue now
    slots.release("b", stalled=False, completed=True)
    assert slots.ask("d", 10).reason == "busy"  # c's place holds
    clock.now += 60  # c never came back: its place lapsed, and the next asker is served
    assert slots.ask("d", 10) is None
    assert list(slots.waiting) == []


def test_the_queue_is_bounded():
    slots = StateSlots(slots=1, clock=_Clock())
    assert slots.ask("served", 10) is None
    for i in range(MAX_WAITING + 10):
        assert slots.ask(f"w{i}", 10).reason == "busy"
    assert len(slots.waiting) == MAX_WAITING


def test_a_joiner_comes_back_to_a_busy_donor_when_it_says_after_trying_the_others():
    state = GlobalState(torch.ones(4), torch.zeros(4), 1, 1, 1.0)
    digest = state_digest(state.global_params, state.momentum)
    calls: list[str] = []

    async def fetch_from(peer: str, timeout: float, want: str | None = None) -> GlobalState:
        calls.append(peer)
        if peer == "slow":
            raise StateBusy("backed off", 1e9)  # beyond what a pass waits: not asked again
        if calls.count(peer) == 1:
            raise StateBusy("busy", 0.2)
        return state

    sync = object.__new__(StateSync)  # no daemon: only the joiner's loop is under test
    sync.fetch_from = fetch_from
    records = {"a": {"global_digest": digest}, "slow": {"global_digest": digest}, "me": {}}
    got = asyncio.run(sync.fetch(records, "me", timeout=5, passes=1))
    assert got is not None and got[1] == "a" and torch.equal(got[0].global_params, state.global_params)
    assert sorted(calls[:2]) == ["a", "slow"] and calls[2:] == ["a"], calls


# ---- the attack, against a real donor ----


@pytest.fixture
def keyed(tmp_path):
    key = str(write_new_key(tmp_path / "swarm.key"))
    return merge_config(run_id="pin", host="127.0.0.1", swarm_key=key, merge_window_s=8, merge_timeout_s=4)


class _Pinner:
    """A key holder (one peer id) that asks `donor` for its state every `every_s` seconds and never reads a byte
    of any reply: a download it is granted stalls until the donor cuts it."""

    def __init__(self, p2p: P2P, auth, donor_id: str, proto: str, every_s: float = 0.1):
        self.p2p, self.auth, self.donor_id, self.proto, self.every_s = p2p, auth, donor_id, proto, every_s
        self.asked = 0
        self.writers: list[asyncio.StreamWriter] = []
        self.stopped = False

    async def run(self) -> None:
        me = self.p2p.peer_id.to_base58()
        while not self.stopped:
            try:
                _, _, writer = await self.p2p.call_binary_stream_handler(PeerID.from_base58(self.donor_id), self.proto)
                await send_msg(writer, {"auth": self.auth.tag("state", me, self.donor_id)})
                self.writers.append(writer)  # kept open, never read
                self.asked += 1
            except Exception:  # noqa: S110 - a refused or reset stream: ask again, as an attacker would
                pass
            await asyncio.sleep(self.every_s)

    async def close(self) -> None:
        for writer in self.writers:
            writer.close()


def _poll_until_served(net_loop, joiner: StateSync, donor_id: str, limit_s: float) -> tuple[GlobalState, list[str]]:
    """Ask `donor_id` for its state, coming back when each refusal says, until served or `limit_s` passes:
    returns (the state, the reasons of the refusals before it)."""
    refusals: list[str] = []
    deadline = time.monotonic() + limit_s
    while True:
        try:
            return net_loop.run(joiner.fetch_from(donor_id, timeout=30), 40), refusals
        except StateBusy as e:
            refusals.append(e.reason)
            assert time.monotonic() + e.retry_after_s < deadline, f"not served within {limit_s:.0f} s: {refusals}"
            time.sleep(e.retry_after_s)


@pytest.mark.integration
@pytest.mark.parametrize("pinner_ids", [1, 2])
def test_a_joiner_is_served_within_one_slot_s_time_while_a_pinner_re_asks_every_tenth_of_a_second(
        keyed, net_loop, pinner_ids):
    """One pinner id holds at most one slot, so the joiner is served at its first request; two ids take both
    slots, and each stalled download is cut within a slot's time: the freed slot goes to the joiner that waited,
    and the pinner's ids are backed off."""
    donor_dht = start_dht(keyed.swarm)
    joiner_dht, pinner_p2ps, pinners = None, [], []
    try:
        joined = with_swarm(keyed, initial_peers=[str(m) for m in donor_dht.get_visible_maddrs()])
        joiner_dht = start_dht(joined.swarm)
        state = GlobalState(torch.randn(BIG_STATE), torch.randn(BIG_STATE), 7, 70, 700.0)
        donor = StateSync(donor_dht, "pin", BIG_STATE, lambda: state, ByteCounter(), auth=swarm_auth(keyed.swarm))
        joiner = StateSync(joiner_dht, "pin", BIG_STATE, lambda: None, ByteCounter(), auth=swarm_auth(keyed.swarm))
        net_loop.run(donor.start(), 10)
        net_loop.run(joiner.start(), 10)
        donor_id = donor_dht.peer_id.to_base58()
        maddrs = [str(m) for m in donor_dht.get_visible_maddrs()]
        for _ in range(pinner_ids):
            p2p = net_loop.run(P2P.create(initial_peers=maddrs, host_maddrs=["/ip4/127.0.0.1/tcp/0"]), 30)
            pinner_p2ps.append(p2p)
            pinners.append(_Pinner(p2p, joiner.auth, donor_id, donor.proto))
        running = [net_loop.submit(p.run()) for p in pinners]
        # the pinners hold the slots they can get, and have been re-asking for a while
        wait_for(lambda: len(donor.slots.serving) == pinner_ids and all(p.asked >= 10 for p in pinners),
                 timeout=20, what="the pinners holding their slots and re-asking")
        t0 = time.monotonic()
        slot_s = send_deadline(2 * BIG_STATE * 4)  # the longest a download may hold a slot
        got, refusals = _poll_until_served(net_loop, joiner, donor_id, limit_s=slot_s + 10)
        took = time.monotonic() - t0
        assert torch.equal(got.global_params, state.global_params) and torch.equal(got.momentum, state.momentum)
        if pinner_ids == 1:
            # a slot was free at once (the pinner's own stalled download may be cut meanwhile, on a loaded machine)
            assert refusals == [], (refusals, donor.aborted)
        else:
            # it waited in the queue for a stalled download to be cut, and was not overtaken by the pinners
            assert refusals and set(refusals) == {"busy"}, refusals
            assert donor.aborted >= 1 and donor.slots.refused["backed off"] >= 1, (donor.aborted, donor.slots.refused)
        # each pinner asked at least 10 times while it held a slot: refused beyond its one slot
        assert donor.slots.refused["one at a time"] + donor.slots.refused["backed off"] >= 9 * pinner_ids, \
            donor.slots.refused
        assert took < slot_s + 10, took
        print(f"\n{pinner_ids} pinner id(s): joiner served after {took:.1f} s, refusals {refusals}; donor cut "
              f"{donor.aborted}, refused {donor.slots.refused}; stall bound {SEND_STALL_S} s")
        for p in pinners:
            p.stopped = True
        for r in running:
            r.result(10)
    finally:
        for p in pinners:
            p.stopped = True
            net_loop.run(p.close(), 10)
        for p2p in pinner_p2ps:
            net_loop.run(p2p.shutdown(), 10)
        for d in (joiner_dht, donor_dht):
            if d is not None:
                d.shutdown()


SMALL_STATE = 20_000
"""Parameters of a state that fits in the buffers between two peers (160 kB): a reader that never reads does not
stall its download, so the donor's send ends as if it had been read."""


@pytest.mark.integration
def test_a_pinner_re_asking_for_a_state_that_never_stalls_gets_one_download_and_holds_one_place(keyed, net_loop):
    """A download of a small state is sent to the end into the transport's buffers, so no stall backs the pinner
    off. Its later requests, while its first stream waits for it to close, are refused at once: it is sent the
    state once, not ten times a second, and holds one of the donor's places, so that its merge streams still fit
    its per-sender budget and nothing refuses them; a joiner is served at its first request."""
    donor_dht = start_dht(keyed.swarm)
    joiner_dht, p2p, pinner = None, None, None
    try:
        joiner_dht = start_dht(with_swarm(keyed, initial_peers=[str(m) for m in donor_dht.get_visible_maddrs()]).swarm)
        state = GlobalState(torch.randn(SMALL_STATE), torch.randn(SMALL_STATE), 7, 70, 700.0)
        auth = swarm_auth(keyed.swarm)
        donor = StateSync(donor_dht, "pin", SMALL_STATE, lambda: state, ByteCounter(), auth=auth)
        joiner = StateSync(joiner_dht, "pin", SMALL_STATE, lambda: None, ByteCounter(), auth=auth)
        net_loop.run(donor.start(), 10)
        net_loop.run(joiner.start(), 10)
        donor_id = donor_dht.peer_id.to_base58()
        p2p = net_loop.run(P2P.create(initial_peers=[str(m) for m in donor_dht.get_visible_maddrs()],
                                      host_maddrs=["/ip4/127.0.0.1/tcp/0"]), 30)
        pinner = _Pinner(p2p, auth, donor_id, donor.proto)
        running = net_loop.submit(pinner.run())
        pinner_id = p2p.peer_id.to_base58()
        handled = lambda: (donor.slots.served + sum(donor.slots.refused.values())  # noqa: E731
                           + donor.gate.refused_from.get(pinner_id, 0))
        wait_for(lambda: pinner.asked >= 30 and handled() >= 28, timeout=30, what="the pinner asking 30 times")
        assert donor.slots.served == 1 and donor.aborted == 0, (donor.slots.served, donor.aborted)
        assert donor.slots.refused["one at a time"] >= 25, donor.slots.refused
        assert donor.gate.by_sender[pinner_id] <= 2 and pinner_id not in donor.gate.refused_from, \
            (donor.gate.by_sender, donor.gate.refused_from)
        assert not donor.gate.refusing(pinner_id)  # nothing leaves it out of merge groups
        got, refusals = _poll_until_served(net_loop, joiner, donor_id, limit_s=10)
        assert refusals == [] and torch.equal(got.global_params, state.global_params)
        print(f"\npinner asked {pinner.asked} times: served {donor.slots.served}, refused {donor.slots.refused}, "
              f"holds {donor.gate.by_sender[pinner_id]} stream(s) at the donor")
        pinner.stopped = True
        running.result(10)
    finally:
        if pinner is not None:
            pinner.stopped = True
            net_loop.run(pinner.close(), 10)
        if p2p is not None:
            net_loop.run(p2p.shutdown(), 10)
        for d in (joiner_dht, donor_dht):
            if d is not None:
                d.shutdown()


# ---- per-sender budgets on every served request ----


def test_gate_bounds_each_sender_s_streams_and_rate_and_counts_its_refusals():
    clock = _Clock()
    gate = StreamGate(max_streams=100, max_unauthenticated=100, max_per_peer=100, max_per_sender=3,
                      sender_rate=2.0, sender_burst=5.0, clock=clock)
    for _ in range(3):
        assert gate.admit("flooder")
        gate.authenticated("flooder")
    assert not gate.admit("flooder") and gate.admit("honest")  # its places are full; others' are not
    assert gate.refused_by == {"sender streams": 1} and gate.refused_from == {"flooder": 1}
    for _ in range(3):
        gate.release("flooder", authenticated=True)
    for _ in range(2):  # 5 tokens at first: 3 spent above
        assert gate.admit("flooder")
        gate.release("flooder", authenticated=False)
    assert not gate.admit("flooder")  # no token left
    clock.now += 0.5  # 2 a second: one more
    assert gate.admit("flooder") and not gate.admit("flooder")
    assert gate.refused_by == {"sender streams": 1, "sender rate": 2} and gate.refused_from == {"flooder": 3}
    assert gate.peak_open == {"flooder": 3, "honest": 1} and gate.low_tokens["flooder"] < 1


def _part(i: int, n: int, digest: str = "same") -> Contribution:
    v = torch.full((n,), 10.0 + i)
    return Contribution(pseudo_grad=v, weight=1.0, global_params=v, momentum=torch.zeros(n), state_digest=digest,
                        state_weight=1.0)


@pytest.mark.integration
def test_honest_peers_in_a_group_of_eight_stay_far_within_the_per_sender_budgets(bootstrap_dht, net_loop, capsys):
    """Measures what honest mates open at one peer, at most, at once and in a burst: the bounds must leave them
    room (docs/security.md gives the figures)."""
    cfg = merge_config(run_id="budget8", merge_window_s=15, merge_timeout_s=10, codec="none", group_size=8, sync=True)
    with running_mergers(bootstrap_dht, net_loop, 8, cfg, 64, guard=GuardConfig(aggregate="mean")) as mergers:
        wait_for(lambda: len(net_loop.run(registered_now(bootstrap_dht, cfg.swarm.run_id, 5, cfg.merge.epoch_s), 10))
                 >= 8, 30, what="every peer in the census")
        merged = 0
        for r in range(3):  # global models that differ in every round: each merge agrees the state too
            futures = [m.submit(_part(i, 64, digest=f"r{r}p{i}")) for i, m in enumerate(mergers)]
            merged += sum(len(flat(f.result(timeout=90)).group) > 1 for f in futures)
        gates = [m.gate for m in mergers]
        peak = max(n for g in gates for n in g.peak_open.values())
        low = min(t for g in gates for t in g.low_tokens.values())
        refused = sum(g.refused for g in gates)
        with capsys.disabled():
            print(f"\nhonest group of 8, 3 merges ({merged} of 24 in groups): most streams one mate held at once "
                  f"{peak}, fewest tokens left in a mate's bucket {low:.1f} of {SENDER_BURST:.0f}; refused {refused}")
    assert merged >= 16 and refused == 0
    assert peak <= MAX_PER_SENDER // 2, peak
    assert low >= SENDER_BURST / 2, low


class _Flooder:
    """A key holder (one peer id) that sends valid `ready` requests to `victim_id` from `workers` streams at once,
    and either never closes them (`hold`: each holds a place at the victim until its handler gives up waiting for
    the close) or asks again as soon as it is answered."""

    def __init__(self, p2p: P2P, auth, victim_id: str, proto: str, workers: int, hold: bool):
        self.p2p, self.auth, self.victim_id, self.proto, self.workers = p2p, auth, victim_id, proto, workers
        self.hold = hold
        """Keep each answered stream open until the victim lets go (else close it at once and ask again)."""
        self.sent = self.answered = 0
        self.stopped = False

    async def _worker(self) -> None:
        me = self.p2p.peer_id.to_base58()
        while not self.stopped:
            answered = False
            try:
                _, reader, writer = await self.p2p.call_binary_stream_handler(PeerID.from_base58(self.victim_id),
                                                                              self.proto)
                try:
                    await send_msg(writer, {"looking": False, "auth": self.auth.tag("ready", me, self.victim_id)})
                    self.sent += 1
                    answered = bool(await reader.read(1))  # a reply, then held until the victim lets go; or EOF
                    self.answered += answered
                    if self.hold:
                        await reader.read()
                finally:
                    writer.close()
            except Exception:  # noqa: S110 - refused or reset: ask again
                pass
            if not answered:
                await asyncio.sleep(0.5)  # refused: a short pause, as a flooder that wants to stay in

    async def run(self) -> None:
        await asyncio.gather(*(self._worker() for _ in range(self.workers)))


@pytest.mark.integration
@pytest.mark.parametrize(("hold", "workers", "bound", "refusals"),
                         [(True, 300, "sender streams", 600), (False, 12, "sender rate", 100)], ids=["held", "fast"])
def test_a_flood_of_valid_requests_from_one_key_holder_is_refused_beyond_its_budget_and_merges_go_on(
        keyed, net_loop, capsys, hold, workers, bound, refusals):
    """Without the per-sender bounds the flooder's 300 held streams, each held 10 s after its answer, fill all 256
    of the victim's places, and the honest peer's requests to it are closed unread (both peers then merged alone);
    12 streams that ask again as soon as they are answered are served at whatever rate the victim manages."""
    n = 10_000
    victim_dht = start_dht(keyed.swarm)
    honest_dht = flooder_p2p = victim = honest = flooder = running = None
    try:
        victim = P2PMerger(victim_dht, keyed, net_loop, n, auth=swarm_auth(keyed.swarm))
        cfg = with_swarm(keyed, initial_peers=[str(m) for m in victim_dht.get_visible_maddrs()])
        honest_dht = start_dht(cfg.swarm)
        honest = P2PMerger(honest_dht, cfg, net_loop, n, auth=swarm_auth(cfg.swarm))
        for m in (victim, honest):
            net_loop.run(m.matchmaker.census.register(epoch_of(get_dht_time(), keyed.merge.epoch_s)), 10)
        flooder_p2p = net_loop.run(P2P.create(initial_peers=cfg.swarm.initial_peers,
                                              host_maddrs=["/ip4/127.0.0.1/tcp/0"]), 30)
        flooder_id = flooder_p2p.peer_id.to_base58()
        flooder = _Flooder(flooder_p2p, victim.auth, victim.peer_id, victim.rpc.proto("ready"), workers, hold)
        t_flood = time.monotonic()
        running = net_loop.submit(flooder.run())
        gate = victim.gate
        wait_for(lambda: gate.refused_by[bound] >= refusals, timeout=60, what=f"the flooder refused by its {bound} bound")
        t0 = time.monotonic()
        futures = [m.submit(_part(i, n)) for i, m in enumerate((victim, honest))]
        results = [flat(f.result(timeout=60)) for f in futures]
        took = time.monotonic() - t0
        with capsys.disabled():
            print(f"\nflood: {flooder.sent} valid requests sent in {time.monotonic() - t_flood:.1f} s, "
                  f"{flooder.answered} answered; victim gate: peak "
                  f"{gate.peak_open[flooder_id]} held by the flooder, refused {dict(gate.refused_by)}, the honest "
                  f"peer's refused {gate.refused_from[honest.peer_id]}; merge {[r.failure for r in results]} "
                  f"in {took:.1f} s")
        assert all(len(r.group) == 2 and r.failure == "" for r in results), [(r.group, r.failure) for r in results]
        torch.testing.assert_close(results[0].pseudo_grad, torch.full((n,), 10.5))
        assert gate.peak_open[flooder_id] <= MAX_PER_SENDER  # never more than its places
        assert gate.refused_from[honest.peer_id] == 0
        assert gate.refused_by["streams"] == gate.refused_by["unauthenticated"] == 0, gate.refused_by  # room left
        # what it got answered: a burst, then the rate
        assert flooder.answered <= SENDER_BURST + SENDER_RATE * (time.monotonic() - t_flood), flooder.answered
    finally:
        if flooder is not None:
            flooder.stopped = True
        if running is not None:
            try:
                running.result(30)
            except Exception:  # noqa: S110 - the flood's end is not what this test checks
                pass
        if flooder_p2p is not None:
            net_loop.run(flooder_p2p.shutdown(), 10)
        for m in (honest, victim):
            if m is not None:
                m.close()
        for d in (honest_dht, victim_dht):
            if d is not None:
                d.shutdown()


@pytest.mark.integration
def test_a_mate_refused_for_flooding_is_not_waited_for_by_leaders(bootstrap_dht, net_loop):
    """A flooder's `ready` words say it is not looking: counted as a live mate, every leader waited out its window
    for it before each merge (the honest peers' merge rate fell by a third in `bench byzantine --kinds flood`).
    Refused as persistently as `StreamGate.refusing` says, it is neither invited nor waited for."""
    from collections import deque

    from p2pdiloco.network.admission import SHUN_REFUSALS

    cfg = merge_config(run_id="flood-wait", merge_window_s=8, merge_timeout_s=4, codec="none", min_window_s=6,
                       window_fraction=1.0)
    with running_mergers(bootstrap_dht, net_loop, 3, cfg, 1000) as (a, b, flooder):
        for m in (a, b):  # the gates' own record of the flooder's refused streams, as its flood leaves it
            now = m.rpc.gate.clock()
            m.rpc.gate.last_refused[flooder.peer_id] = deque([now] * SHUN_REFUSALS, maxlen=SHUN_REFUSALS)
            assert m.rpc.gate.refusing(flooder.peer_id)
        results = [flat(f.result(timeout=60)) for f in [m.submit(_part(i, 1000)) for i, m in enumerate((a, b))]]
    assert all(sorted(r.group) == sorted([a.peer_id, b.peer_id]) and r.failure == "" for r in results), \
        [(r.group, r.failure) for r in results]
    assert max(r.match_s for r in results) < 4.0, [r.match_s for r in results]  # not its window of 6 s or more
