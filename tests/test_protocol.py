"""The wire protocol's version (config/fingerprint.py): written by leaving it out at version 1, so that version 1's
bytes stay what every version-1 peer sends; named in the fingerprint and invites from version 2 on; a peer of
another version is refused at start and its invites declined."""

from __future__ import annotations

import asyncio
import logging
import types

import pytest

from p2pdiloco.config import (
    PROTOCOL_VERSION,
    Config,
    GuardConfig,
    fingerprint_digest,
    protocol_of,
)
from p2pdiloco.config import fingerprint as fingerprint_module
from p2pdiloco.network.admission import Request, StreamGate
from p2pdiloco.network.matchmaking import Matchmaker
from p2pdiloco.network.search import OTHER_PROTOCOLS
from p2pdiloco.network.swarm import SwarmError, check_fingerprint
from tests.conftest import merge_config

VERSION_1_DIGEST = "504b97f806b7da1b"
"""The default config's fingerprint digest at protocol version 1, as every version-1 peer computes it."""


def test_version_one_is_the_fingerprint_without_a_protocol_entry():
    fp = Config().fingerprint()
    if PROTOCOL_VERSION == 1:
        assert "protocol" not in fp and fingerprint_digest(fp) == VERSION_1_DIGEST
    else:
        assert fp["protocol"] == PROTOCOL_VERSION and fingerprint_digest(fp) != VERSION_1_DIGEST
    assert protocol_of(fp) == PROTOCOL_VERSION
    assert protocol_of({}) == 1 and protocol_of({"protocol": 3}) == 3
    assert protocol_of({"protocol": "2"}) is None and protocol_of({"protocol": True}) is None
    assert protocol_of({"protocol": 0}) is None


def test_a_newer_version_is_named_in_the_fingerprint_and_changes_its_digest(monkeypatch):
    before = Config().fingerprint()
    monkeypatch.setattr(fingerprint_module, "PROTOCOL_VERSION", PROTOCOL_VERSION + 1)
    after = Config().fingerprint()
    assert after["protocol"] == PROTOCOL_VERSION + 1
    assert fingerprint_digest(after) != fingerprint_digest(before)  # so older peers decline its invites too


def test_a_starting_peer_stops_on_a_swarm_of_another_version():
    mine = Config().fingerprint()
    theirs = {**mine, "protocol": PROTOCOL_VERSION + 1}
    with pytest.raises(SwarmError, match=f"speaks wire protocol {PROTOCOL_VERSION + 1} and this peer "
                                         f"{PROTOCOL_VERSION}: peers of different protocol versions"):
        check_fingerprint(mine, {"12D3KooWother": {"fingerprint": theirs}})
    check_fingerprint(mine, {"12D3KooWother": {"fingerprint": dict(mine)}})  # the same version and config: fine


def test_an_invite_from_a_leader_of_another_version_is_declined_and_said_once(caplog):
    replies = []

    class Rpc:
        peer_id = "12D3KooWmyself"
        gate = StreamGate()  # whom this peer refused streams lately: nobody

        async def receive_payload(self, reader, size):
            return b""

        async def reply(self, reader, writer, op, peer, header):
            replies.append(header)

    m = Matchmaker(None, merge_config(run_id="versions"), Rpc(), types.SimpleNamespace(banned=set()), GuardConfig(),
                   "fp", {"d": 8})
    newer = {"group_id": "g1", "fp": "fp", "closing": False, "protocol": PROTOCOL_VERSION + 1}

    async def invites():
        for _ in range(3):
            await m.on_invite(Request("invite", "12D3KooWleader", newer), None, None)
        await m.on_invite(Request("invite", "12D3KooWleader", {**newer, "protocol": PROTOCOL_VERSION}), None, None)

    with caplog.at_level(logging.WARNING, logger="p2pdiloco.network.matchmaking"):
        asyncio.run(invites())
    assert [r["accept"] for r in replies] == [False] * 4
    assert all(r["error"] == f"wire protocol {PROTOCOL_VERSION + 1} differs from this peer's {PROTOCOL_VERSION}"
               for r in replies[:3])
    assert replies[3].get("error") != replies[0]["error"]  # its own version: not declined for it (no search here)
    assert caplog.text.count("declined the invites of leader") == 1
    assert f"it speaks wire protocol {PROTOCOL_VERSION + 1}, this peer {PROTOCOL_VERSION}" in caplog.text

    # leaders made up by the thousand are all declined, and the ones said so are bounded
    async def strangers():
        for i in range(OTHER_PROTOCOLS + 200):
            await m.on_invite(Request("invite", f"12D3KooWmadeup{i}", newer), None, None)

    replies.clear()
    asyncio.run(strangers())
    assert [r["why"] for r in replies] == ["protocol"] * (OTHER_PROTOCOLS + 200)
    assert len(m._other_protocol) == OTHER_PROTOCOLS
