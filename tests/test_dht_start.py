"""A join whose initial peers answered no ping (a loaded bootstrap node) is tried again until the join timeout
(`swarm._joined_dht`); real DHT nodes on loopback."""

from __future__ import annotations

import hivemind
import pytest

from p2pdiloco.config import SwarmConfig
from p2pdiloco.network import swarm
from p2pdiloco.network.swarm import BOOTSTRAP_PING, SwarmError, start_dht

pytestmark = pytest.mark.integration

PING_FAILED = RuntimeError(f"DHTNode bootstrap failed: {BOOTSTRAP_PING}. (set ensure_bootstrap_success=False ...)")


def test_a_join_whose_bootstrap_answered_no_ping_is_tried_again(bootstrap_dht, monkeypatch):
    real, calls = hivemind.DHT, []

    def slow_bootstrap_once(*args, **kwargs):
        calls.append(kwargs["initial_peers"])
        if len(calls) == 1:
            raise PING_FAILED  # as hivemind raises it from its DHT process
        return real(*args, **kwargs)

    monkeypatch.setattr(swarm.hivemind, "DHT", slow_bootstrap_once)
    maddrs = [str(m) for m in bootstrap_dht.get_visible_maddrs()]
    dht = start_dht(SwarmConfig(host="127.0.0.1", initial_peers=maddrs, join_timeout_s=30))
    try:
        assert len(calls) == 2 and dht.peer_id != bootstrap_dht.peer_id
        assert dht.get_visible_maddrs()  # a running node
    finally:
        dht.shutdown()


def test_a_join_nobody_answers_ends_in_a_swarm_error_within_the_join_timeout(monkeypatch):
    calls = []

    def never_answered(*args, **kwargs):
        calls.append(1)
        raise PING_FAILED

    monkeypatch.setattr(swarm.hivemind, "DHT", never_answered)
    nobody = "/ip4/127.0.0.1/tcp/9/p2p/12D3KooWNoCmJBXGUxB4Eg1M4kzki6u8kU4UvVSqqc4fmisFGNPU"
    cfg = SwarmConfig(host="127.0.0.1", initial_peers=[nobody], join_timeout_s=3)
    with pytest.raises(SwarmError, match="answered a ping within 3 s"):
        start_dht(cfg)
    assert 2 <= len(calls) <= 4  # tried again a second apart, then gave up in time
