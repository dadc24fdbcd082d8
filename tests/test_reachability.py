"""The dial-back check: another node connects back to the address it sees a peer come from, at the ports the peer
announces, and refuses anything else. Real DHTs and p2p daemons on loopback."""

from __future__ import annotations

import socket

import pytest

from p2pdiloco.network.reachability import (
    MAX_PORTS,
    ReachService,
    ask,
    check_reachability,
    peer_ids_of,
    tcp_endpoint,
    verdict,
)
from p2pdiloco.observe.status import format_status, swarm_status
from tests.conftest import start_local_dht

pytestmark = pytest.mark.integration


def closed_port() -> int:
    """A loopback port nobody listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Nodes:
    def __init__(self, checker_dht, peer_dht, net_loop):
        self.loop = net_loop
        self.checker_id = checker_dht.peer_id.to_base58()
        self.peer_maddrs = [str(m) for m in peer_dht.get_visible_maddrs()]
        self.checker_p2p = net_loop.run(checker_dht.replicate_p2p(), timeout=10)
        self.peer_p2p = net_loop.run(peer_dht.replicate_p2p(), timeout=10)
        self.service = ReachService(self.checker_id, dial_timeout_s=1.0)
        net_loop.run(self.service.start(self.checker_p2p), timeout=10)

    def check(self, announced: list[str], checkers: list[str] | None = None):
        checkers = [self.checker_id] if checkers is None else checkers
        return self.loop.run(check_reachability(self.peer_p2p, checkers, announced, timeout_s=10), timeout=30)

    def close(self):
        for p2p in (self.checker_p2p, self.peer_p2p):
            self.loop.run(p2p.shutdown(), timeout=10)


@pytest.fixture
def nodes(bootstrap_dht, net_loop):
    peer = start_local_dht([str(m) for m in bootstrap_dht.get_visible_maddrs()])
    built = None
    try:
        built = Nodes(bootstrap_dht, peer, net_loop)
        yield built
    finally:
        if built is not None:
            built.close()
        peer.shutdown()


def test_a_peer_on_loopback_is_dialed_back_and_reachable(nodes):
    found = nodes.check(nodes.peer_maddrs)
    assert found.reachable is True and found.checker == nodes.checker_id and found.observed_ip == "127.0.0.1"
    assert nodes.service.checks == 1


def test_a_port_nobody_listens_on_is_not_reachable_and_says_why(nodes):
    port = closed_port()
    found = nodes.check([f"/ip4/127.0.0.1/tcp/{port}"])
    assert found.reachable is False
    assert f"127.0.0.1:{port}" in found.detail and "refused" in found.detail.lower()
    assert "behind NAT" not in found.detail  # it announced the address it connects from


def test_the_checker_dials_the_address_it_sees_never_the_one_the_requester_names(nodes):
    # The peer listens on 127.0.0.1 only. Naming 127.0.0.2 with its real port gets a dial to 127.0.0.1 (where the
    # connection came from), which answers; had the checker dialed 127.0.0.2, nobody would have.
    port = tcp_endpoint(nodes.peer_maddrs[0])[1]
    found = nodes.check([f"/ip4/127.0.0.2/tcp/{port}"])
    assert found.reachable is True and found.observed_ip == "127.0.0.1"
    # and where that port is closed too, the verdict says the announced address is not where it connects from
    found = nodes.check([f"/ip4/127.0.0.2/tcp/{closed_port()}"])
    assert found.reachable is False and "announces 127.0.0.2 but connects from 127.0.0.1" in found.detail


@pytest.mark.parametrize("ports, why", [
    (list(range(1000, 1001 + MAX_PORTS)), f"a check names 1 to {MAX_PORTS} ports"),
    ([], f"a check names 1 to {MAX_PORTS} ports"),
    ([0], "ports must be integers in 1..65535"),
    ([True], "ports must be integers in 1..65535"),
    (["80"], "ports must be integers in 1..65535"),
    ("80", f"a check names 1 to {MAX_PORTS} ports"),
])
def test_a_malformed_request_is_refused_without_a_dial(nodes, ports, why):
    reply = nodes.loop.run(ask(nodes.peer_p2p, nodes.checker_id, ports, timeout_s=10), timeout=20)
    assert reply == {"refused": why}
    assert nodes.service.checks == 0 and nodes.service.refused == 1


def test_without_a_node_that_checks_the_verdict_is_unknown_and_names_who_was_tried(nodes, bootstrap_dht, net_loop):
    assert nodes.check(nodes.peer_maddrs, checkers=[]).reachable is None
    other = start_local_dht([str(m) for m in bootstrap_dht.get_visible_maddrs()])  # serves no dial-back
    try:
        found = nodes.check(nodes.peer_maddrs, checkers=[other.peer_id.to_base58()])
        assert found.reachable is None and other.peer_id.to_base58()[-6:] in found.detail
        # the next one in the list answers
        found = nodes.check(nodes.peer_maddrs, checkers=[other.peer_id.to_base58(), nodes.checker_id])
        assert found.reachable is True and found.checker == nodes.checker_id
    finally:
        other.shutdown()


def test_replies_from_strangers_are_not_trusted_to_be_well_formed():
    me = ["/ip4/127.0.0.1/tcp/4001"]
    for bad in ({}, {"observed": 1, "ports": [[4001, ""]]}, {"observed": "1.2.3.4", "ports": "x"},
                {"observed": "1.2.3.4", "ports": []}, {"observed": "1.2.3.4", "ports": [[4001, 0]]},
                {"observed": "1.2.3.4", "ports": [4001]}, {"refused": "busy"}):
        assert verdict(bad, "QmChecker", me) is None, bad
    assert verdict({"observed": "127.0.0.1", "ports": [[4001, ""]]}, "QmChecker", me).reachable is True


def test_helpers_parse_multiaddrs():
    assert tcp_endpoint("/ip4/10.0.0.2/tcp/4001/p2p/QmX") == ("10.0.0.2", 4001)
    assert tcp_endpoint("/ip6/::1/tcp/5") == ("::1", 5)
    assert tcp_endpoint("/ip4/1.2.3.4/tcp/1/p2p/QmR/p2p-circuit/p2p/QmX") is None
    assert tcp_endpoint("/dns4/example.org/tcp/1") is None and tcp_endpoint("/ip4/999.1.1.1/tcp/1") is None
    assert peer_ids_of(["/ip4/1.2.3.4/tcp/1/p2p/QmA", "/ip4/1.2.3.4/tcp/2"]) == ["QmA"]


def test_status_shows_who_is_not_reachable_and_does_not_trust_the_field():
    records = {
        "QmAAAAAAAAAAreach": {"name": "a", "reachable": True, "time": 100.0},
        "QmBBBBBBBBBBnatd": {"name": "b", "reachable": False, "reach_detail": "x could not connect", "time": 100.0},
        "QmCCCCCCCCCCunkn": {"name": "c", "time": 100.0},
        "QmDDDDDDDDDDjunk": {"name": "d", "reachable": "yes", "reach_detail": 5, "time": 100.0},
    }
    status = swarm_status(records, "run", now=101.0)
    by_name = {p["name"]: p for p in status["peers"]}
    assert [by_name[n]["reachable"] for n in "abcd"] == [True, False, None, None]
    assert by_name["b"]["reach_detail"] == "x could not connect" and by_name["d"]["reach_detail"] == ""
    text = format_status(status)
    assert "1 peer(s) cannot be dialed by others" in text and "b: x could not connect" in text
