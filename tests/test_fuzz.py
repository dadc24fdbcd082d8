"""Fuzzing what a peer decodes from the network: it never crashes, never allocates without bound, never merges
garbage. Bounded in time: few examples per test and no per-example deadline surprises on shared cores."""

from __future__ import annotations

import asyncio
import math

import msgpack
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from p2pdiloco.algorithm.codecs import Codec
from p2pdiloco.algorithm.guards import screen_parts
from p2pdiloco.network.allreduce import AllReduce
from p2pdiloco.network.group import valid_notice
from p2pdiloco.network.matchmaking import Matchmaker
from p2pdiloco.network.p2p_merger import MergeFailed
from p2pdiloco.network.session import Sessions
from p2pdiloco.network.state_sync import GlobalState, StateError, unpack_state
from p2pdiloco.network.wire import WireError
from tests.conftest import merge_config, recv_msg

FUZZ = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])

json_like = st.recursive(
    st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | st.floats(allow_nan=False) | st.text(max_size=20) | st.binary(max_size=20),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=10), inner, max_size=5),
    max_leaves=20,
)

def _decode(data: bytes, max_payload: int) -> tuple[dict, bytes]:
    async def go():
        reader = asyncio.StreamReader(limit=2**20)
        reader.feed_data(data)
        reader.feed_eof()
        return await asyncio.wait_for(recv_msg(reader, max_payload), 5)

    return asyncio.run(go())


def _frame(header_bytes: bytes, payload: bytes, declared_payload: int | None = None) -> bytes:
    n = len(payload) if declared_payload is None else declared_payload
    return len(header_bytes).to_bytes(4, "big") + header_bytes + n.to_bytes(8, "big") + payload


@FUZZ
@given(st.binary(max_size=300), st.integers(0, 64))
def test_recv_msg_on_random_bytes_returns_a_map_or_wire_error(data, max_payload):
    try:
        header, payload = _decode(data, max_payload)
    except WireError:
        return
    assert isinstance(header, dict) and len(payload) <= max_payload


@FUZZ
@given(json_like, st.binary(max_size=64), st.integers(0, 2**64 - 1), st.integers(0, 128))
def test_recv_msg_on_wellframed_but_arbitrary_messages(value, payload, declared, max_payload):
    head = msgpack.packb(value, use_bin_type=True)
    try:
        header, got = _decode(_frame(head, payload, declared), max_payload)
    except WireError:
        return
    assert isinstance(header, dict) and header == value
    assert got == payload[:declared] and len(got) <= max_payload


def test_huge_declared_sizes_are_refused_before_reading():
    with pytest.raises(WireError, match="header"):
        _decode((2**32 - 1).to_bytes(4, "big"), 10)  # no bytes follow: refused on the number alone
    with pytest.raises(WireError, match="payload"):
        _decode(_frame(msgpack.packb({}), b"", 2**63), 2**20)


GROUP_SIZE = 3


def _bare_matchmaker() -> Matchmaker:
    """Only the decoding paths: no DHT, no daemon."""
    m = Matchmaker.__new__(Matchmaker)
    m.peer_id, m._search, m._groups, m.cfg = "me", None, {}, merge_config(group_size=GROUP_SIZE)
    return m


@FUZZ
@given(st.dictionaries(st.text(max_size=12), json_like, max_size=6))
def test_part_headers_from_strangers_are_refused_without_state(header):  # before any payload is read
    m = _bare_matchmaker()
    allreduce = AllReduce(None, Sessions(m.expected_group, m.forget).find, {"d": Codec(), "s": Codec()})
    with pytest.raises(MergeFailed):
        asyncio.run(allreduce._expect_part("stranger", header))
    assert m._groups == {}  # nothing was allocated for an unknown group


def _is_sound_notice(h: dict, me: str) -> bool:
    """What a group notice must be for a member to act on it, written out independently of `valid_notice`."""
    members, weights, sw, digests = h.get("members"), h.get("weights"), h.get("state_weights"), h.get("digests")
    if not (type(members) is list and type(weights) is list and type(sw) is list and type(digests) is list):
        return False
    numbers = weights + sw
    return (len(members) >= 2 and len(members) == len(weights) == len(sw) == len(digests) and me in members
            and all(type(d) is str for d in digests)
            and h.get("need_state") is (len(set(digests)) > 1)  # says the models differ exactly when they do
            and (len(members) <= GROUP_SIZE or h.get("closing") is True)  # bounded, but for a run's last merges
            and all(type(m) is str for m in members) and len(set(members)) == len(members)
            and all(type(w) in (int, float) and math.isfinite(w) and w >= 0 for w in numbers)
            and type(h.get("need_state")) is bool)


@FUZZ
@given(st.dictionaries(st.sampled_from(["members", "weights", "state_weights", "need_state", "group_id", "closing",
                                        "digests"]), json_like, max_size=7))
@example({"members": [[1], [1]], "weights": [1, 1], "state_weights": [1, 1], "need_state": False, "digests": ["d"] * 2})
@example({"members": ["a", "b", "c", "me"], "weights": [1] * 4, "state_weights": [1] * 4, "need_state": False,
          "digests": ["d"] * 4})
@example({"members": ["a", "b", "c", "me"], "weights": [1] * 4, "state_weights": [1] * 4, "need_state": False,
          "closing": True, "digests": ["d"] * 4})
@example({"members": ["me", "you"], "weights": [1, 2.5], "state_weights": [0, 3], "need_state": True,
          "digests": ["d", "e"]})
@example({"members": ["me", "you"], "weights": [1, 2.5], "state_weights": [0, 3], "need_state": False,
          "digests": ["d", "e"]})
@example({"members": ["me", "you"], "weights": [1, 2.5], "state_weights": [0, 3], "need_state": True,
          "digests": ["d", "d"]})
@example({"members": ["me", "you"], "weights": [1, 2.5], "state_weights": [0, 3], "need_state": True,
          "digests": ["d", 1]})
@example({"members": ["me", "me"], "weights": [1, 1], "state_weights": [1, 1], "need_state": False, "digests": ["d"] * 2})
@example({"members": ["me", "you"], "weights": [1, float("nan")], "state_weights": [1, 1], "need_state": False,
          "digests": ["d"] * 2})
@example({"members": ["me", "you"], "weights": [True, 1], "state_weights": [1, 1], "need_state": False,
          "digests": ["d"] * 2})
def test_group_notice_is_accepted_exactly_when_sound(header):
    assert valid_notice(header, "me", GROUP_SIZE) == _is_sound_notice(header, "me")


def test_a_sound_group_notice_is_accepted():  # the property above would also hold if every notice were refused
    notice = {"members": ["you", "me"], "weights": [10, 20], "state_weights": [0.0, 5.5], "need_state": False,
              "digests": ["d", "d"]}
    assert valid_notice(notice, "me", GROUP_SIZE)
    assert not valid_notice({**notice, "members": ["you", "them"]}, "me", GROUP_SIZE)  # not a member
    assert valid_notice({**notice, "digests": ["d", "e"], "need_state": True}, "me", GROUP_SIZE)
    assert not valid_notice({**notice, "digests": ["d", "e"]}, "me", GROUP_SIZE)  # models differ, no agreement
    assert not valid_notice({**notice, "need_state": True}, "me", GROUP_SIZE)  # an agreement of equal models


@FUZZ
@given(st.dictionaries(st.sampled_from(["n_params", "sha256", "round", "step", "global_tokens", "ok"]), json_like),
       st.binary(max_size=160))
def test_state_replies_are_verified_or_refused(header, payload):
    try:
        state = unpack_state(header, payload, 16)
    except StateError:
        return
    assert isinstance(state, GlobalState) and torch.isfinite(state.global_params).all()


@FUZZ
@given(st.lists(st.lists(st.floats(width=32), min_size=4, max_size=4), min_size=1, max_size=6), st.integers(0, 5))
def test_guards_judge_any_numbers(values, own):
    parts = [torch.tensor(v, dtype=torch.float32) for v in values]
    reasons = screen_parts(parts, min(own, len(parts) - 1), 4.0, 0.0)
    assert len(reasons) == len(parts)
    assert all(r for p, r in zip(parts, reasons, strict=True) if not torch.isfinite(p).all())
