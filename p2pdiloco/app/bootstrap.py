"""A DHT-only bootstrap node with a persistent identity, so that its address survives restarts."""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
from pathlib import Path

from p2pdiloco.config import SwarmConfig
from p2pdiloco.network.reachability import ReachService
from p2pdiloco.network.swarm import BackgroundLoop, Reaper, SwarmError, start_dht, visible_maddrs

logger = logging.getLogger(__name__)


def run_bootstrap(
    host: str, port: int, identity: Path, announce: list[str], maddr_file: Path | None = None, print_fn=print,
    swarm_key: str = "",
) -> None:
    """Serve the DHT until SIGINT or SIGTERM.

    Args:
        host: interface to listen on (0.0.0.0 for all).
        port: TCP port (0 picks a free one; use a fixed one so the address survives restarts).
        identity: private key file; created on first run, reused afterwards (same peer id, same address).
        announce: public multiaddrs to advertise instead of the listening ones (behind NAT or a proxy).
        maddr_file: if given, the node's full multiaddrs are also written here, one a line (for scripts).
        print_fn: where the addresses are printed.
        swarm_key: a private swarm's key file: the node then stores and serves only records signed with it.
    """
    identity.parent.mkdir(parents=True, exist_ok=True)
    created = not identity.exists()
    cfg = SwarmConfig(host=host, port=port, announce=announce, swarm_key=swarm_key)
    stop = threading.Event()
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    dht = start_dht(cfg, identity_path=str(identity))
    reaper = Reaper(dht)
    loop = BackgroundLoop("bootstrap-net")
    p2p = None
    try:
        # peers ask it first whether others can dial them (network/reachability.py): it is the one node every
        # peer of a swarm reaches
        p2p = loop.run(dht.replicate_p2p(), timeout=10)
        loop.run(ReachService(dht.peer_id.to_base58()).start(p2p), timeout=10)
        maddrs = visible_maddrs(dht)
        print_fn(f"bootstrap node {dht.peer_id.to_base58()} ({'new' if created else 'reused'} identity {identity})")
        print_fn("peers join with --initial-peers and one of:")
        for m in maddrs:
            print_fn(f"  {m}")
        if maddr_file is not None:
            tmp = maddr_file.with_name(maddr_file.name + ".tmp")
            tmp.write_text("".join(m + "\n" for m in maddrs))
            tmp.replace(maddr_file)
        print_fn("running; Ctrl+C to stop")
        while not stop.wait(1.0):
            if not dht.is_alive():
                raise SwarmError("the DHT process died; restart the bootstrap node (its identity file keeps its address)")
    finally:
        if p2p is not None:  # its socket file in /tmp goes with it
            with contextlib.suppress(Exception):  # shutting down: a stuck daemon must not keep the node up
                loop.run(p2p.shutdown(), timeout=5)
        loop.close()
        dht.shutdown()
        reaper.close()
