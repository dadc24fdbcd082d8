"""A peer's side of the dial-back check (network/reachability.py): serve it to others, ask it of itself at start,
and say loudly, in the log and in `status`, when nobody can dial this peer."""

from __future__ import annotations

import logging
import random
from collections.abc import Callable

from hivemind import DHT

from p2pdiloco.network.admission import StreamGate
from p2pdiloco.network.peer_tag import short_id
from p2pdiloco.network.reachability import (
    Reachability,
    ReachService,
    find_reachability,
    peer_ids_of,
    tcp_endpoint,
)
from p2pdiloco.network.swarm import BackgroundLoop, live_records, read_peers
from p2pdiloco.network.wire import ByteCounter

logger = logging.getLogger(__name__)

CHECKERS = 3
"""Nodes asked, at most, in one attempt: the initial peers first, then live peers picked at random."""


def unreachable_message(found: Reachability, maddrs: list[str]) -> str:
    """What a peer that others cannot dial prints: why, what it costs, and what fixes it."""
    port = next((e[1] for m in maddrs if (e := tcp_endpoint(m)) is not None), "PORT")
    return (f"others cannot dial this peer: {found.detail}. It will neither lead a merge group nor own a slice "
            f"of one, so it merges only in groups led by a peer others can dial, and alone where there is none. "
            f"Forward TCP port {port} on "
            f"your router to this machine and pass --port {port} --announce /ip4/<public address>/tcp/{port} "
            f"(docs/operations.md, Behind a home router)")


def start_reachability(loop: BackgroundLoop, dht: DHT, run_id: str, initial_peers: list[str], maddrs: list[str],
                       gate: StreamGate, counter: ByteCounter,
                       on_verdict: Callable[[Reachability], None] | None = None) -> dict:
    """Serve the dial-back check on this peer's p2p daemon and, in the background, have others check this peer.

    Args:
        loop: the peer's network loop.
        dht: its DHT (the check runs on hivemind's replica of its P2P, shared with the merger's protocols).
        run_id: the swarm's run id (live peers are read from its records when no initial peer can check).
        initial_peers: the multiaddrs the peer joined through (asked first).
        maddrs: the addresses the peer announces (their ports are dialed back).
        gate, counter: the peer's bounds on incoming streams and its byte counter.
        on_verdict: called with what each attempt of the check found (on the network loop; the first within
            seconds, whether or not a node could check), e.g. to call `P2PMerger.set_dialable`.

    Returns:
        The fields the peer's heartbeat record carries, filled in when the check has an answer.
    """
    fields = Reachability(None).record()
    p2p = loop.run(dht.replicate_p2p(), timeout=10)
    me = dht.peer_id.to_base58()
    loop.run(ReachService(me, gate, counter).start(p2p), timeout=10)
    first = peer_ids_of(initial_peers)

    asked = 0

    async def candidates() -> list[str]:
        nonlocal asked
        asked += 1
        if first and asked == 1:  # the common case reads no record: a bootstrap node checks
            return first[:CHECKERS]
        live = [p for p in live_records(await read_peers(dht, run_id)) if p != me and p not in first]
        return (first + random.sample(live, len(live)))[:CHECKERS]

    async def check() -> None:
        found = await find_reachability(p2p, maddrs, candidates, counter, on_attempt=on_verdict)
        fields.update(found.record())
        if found.reachable:
            logger.info("[%s] reachable: %s dialed back %s", short_id(me), short_id(found.checker), found.observed_ip)
        elif found.reachable is False:
            logger.warning("[%s] %s", short_id(me), unreachable_message(found, maddrs))
        else:
            logger.warning("[%s] could not learn whether others can dial this peer: %s", short_id(me), found.detail)

    loop.submit(check())
    return fields
