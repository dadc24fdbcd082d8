"""Why a search ends without a group: the cause a merge alone carries, the word a declined invite gives, and the
first search's window under timed rounds. No network: the matchmaker talks to fakes."""

from __future__ import annotations

import asyncio
import types

import torch
from hivemind.utils.timed_storage import get_dht_time

from p2pdiloco.bench.scale import alone_causes
from p2pdiloco.config import PROTOCOL_VERSION, GuardConfig, protocol_fields
from p2pdiloco.network import matchmaking
from p2pdiloco.network.admission import Request, StreamGate
from p2pdiloco.network.matchmaking import Matchmaker
from p2pdiloco.network.merger import Contribution
from p2pdiloco.network.search import Search, Window
from tests.conftest import merge_config


class FakeRpc:
    """Requests answered from `replies` ({peer: reply}, None: unreachable); replies to handlers kept in `sent`."""

    peer_id = "me"
    gate = StreamGate()

    def __init__(self, replies: dict | None = None):
        self.replies, self.sent = replies or {}, []

    async def request(self, peer, tag, header):
        return self.replies.get(peer, {"ok": True}) if tag == "invite" else {"ok": True}

    async def receive_payload(self, reader, size):
        return b""

    async def reply(self, reader, writer, tag, peer, header):
        self.sent.append(header)


class FakeCensus:
    size = 3

    def __init__(self, members):
        self._members = frozenset(members)

    async def register(self, epoch):
        pass

    async def members(self, epoch):
        return self._members

    def settled(self, epoch):
        return True


def _matchmaker(rpc: FakeRpc, members=("me",), **keys) -> Matchmaker:
    m = Matchmaker(None, merge_config(run_id="why", **keys), rpc, types.SimpleNamespace(banned=set()), GuardConfig(),
                   "fp", {"d": 8})
    m.census = FakeCensus(members)
    return m


def _contribution() -> Contribution:
    return Contribution(pseudo_grad=torch.zeros(8), weight=1.0, global_params=torch.zeros(8),
                        momentum=torch.zeros(8), state_digest="same", state_weight=1.0)


def test_a_declined_invite_says_why_in_one_word():
    m = _matchmaker(FakeRpc())
    invite = {"group_id": "g1", "fp": "fp", **protocol_fields()}

    def answer(header: dict) -> dict:
        m.rpc.sent.clear()
        asyncio.run(m.on_invite(Request("invite", "leader", header), None, None))
        return m.rpc.sent[0]

    assert answer(invite)["why"] == "not_looking"  # between searches
    assert answer({**invite, "fp": "other"})["why"] == "config"
    assert answer({**invite, "protocol": PROTOCOL_VERSION + 1})["why"] == "protocol"
    m._search = Search(contribution=_contribution(), deadline=get_dht_time() + 5, leading=True)
    assert answer(invite)["why"] == "leading"
    m._search = Search(contribution=_contribution(), deadline=get_dht_time() + 5, accepted_gid="g0", leader="x")
    assert answer(invite)["why"] == "taken"
    m._search = Search(contribution=_contribution(), deadline=get_dht_time() + 5)
    reply = answer(invite)
    assert reply["accept"] is True and "why" not in reply


def test_a_leader_whose_invites_were_all_declined_merges_alone_with_their_reasons():
    rpc = FakeRpc({"a": {"accept": False, "why": "leading"}, "b": None, "c": {"accept": False, "why": "hostile words"}})
    m = _matchmaker(rpc)
    search = Search(contribution=_contribution(), deadline=get_dht_time())
    assert asyncio.run(m._lead(search, ["a", "b", "c"])) is None
    assert m.alone_cause == "declined:leading+other+unreachable"


def test_a_search_says_whether_its_leader_never_invited_it_or_no_mate_was_ready(monkeypatch):
    # "x" ranks first and says it is looking, but never invites: the search ends alone, passed over by it
    monkeypatch.setattr(matchmaking, "my_group", lambda run_id, me, census, epoch, size: ["x", "me"])
    m = _matchmaker(FakeRpc(), members=("me", "x"))
    m.window = types.SimpleNamespace(length=lambda round_s: 0.0, round_ema=None)  # its deadline is now
    m._ready["x"] = get_dht_time() + 60
    assert asyncio.run(m.find_group(_contribution())) is None
    assert m.alone_cause == "not_invited"
    # this peer ranks first and leads, but its mate never said it was looking before the deadline
    monkeypatch.setattr(matchmaking, "my_group", lambda run_id, me, census, epoch, size: ["me", "x"])
    m._ready.clear()
    assert asyncio.run(m.find_group(_contribution())) is None
    assert m.alone_cause == "no_mate_ready"


def test_a_stop_word_of_a_mates_last_search_that_arrives_after_its_next_search_began_leaves_it_ready():
    # a mate's words travel as separate requests: the stop of its last search (sent in the background at its end)
    # may arrive after the word that its next search is looking. Taken as a stop, the mate counted as live but not
    # ready, and a leader waited for it to its own deadline (a whole window of every merge of its group).
    m = _matchmaker(FakeRpc())

    def word(looking: bool, deadline: float) -> None:
        asyncio.run(m.on_ready(Request("ready", "x", {"looking": looking, "deadline": deadline}), None, None))

    now = get_dht_time()
    word(True, now + 2.0)  # its next search: looking until now + 2
    word(False, now - 1.0)  # its last search's stop, overtaken on the way
    assert m._ready == {"x": now + 2.0}
    word(False, now + 2.0)  # the stop of the search it is looking in: no longer ready
    assert m._ready == {}
    word(True, now + 2.0)
    word(True, now + 3.0)  # a later word of its own replaces the earlier one
    assert m._ready == {"x": now + 3.0}


def test_bench_scale_counts_merges_alone_by_cause():
    merges = [{"group_size": 4}, {"group_size": 1, "alone_cause": "not_invited"},
              {"group_size": 1, "alone_cause": "not_invited"}, {"group_size": 1, "failure": "TimeoutError"},
              {"group_size": 1, "alone_cause": "declined:leading"}, {"group_size": 1}]
    assert alone_causes(merges) == {"not_invited": 2, "failed": 1, "declined:leading": 1, "unknown": 1}


def test_a_first_search_under_timed_rounds_spans_the_next_cadence_point_until_a_group_formed():
    # peers that started apart end their first 3 s rounds on adjacent cadence points: a 1 s window never meets
    w = Window(merge_config(merge_window_s=10.0, min_window_s=1.0, window_fraction=0.25, round_seconds=3.0))
    assert w.length(3.0) == 4.0  # the floor, plus one cadence period
    w.record(alone=True, marks={})
    assert w.length(3.0) == 8.0  # alone again: doubled as any window is
    w.record(alone=False, marks={})
    assert w.length(3.0) == 1.0  # once in a group, the usual quarter of a round (here the floor)
    w.record(alone=True, marks={})
    assert w.length(3.0) == 2.0  # and no longer spans a cadence point
