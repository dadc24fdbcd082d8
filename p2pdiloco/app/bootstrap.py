"""A DHT-only bootstrap node with a persistent identity, so that its address survives restarts."""

from __future__ import annotations

import logging
import signal
import threading
from pathlib import Path

from p2pdiloco.config import SwarmConfig
from p2pdiloco.network.reachability import serving_reach
from p2pdiloco.network.swarm import Reaper, SwarmError, start_dht, visible_maddrs
from p2pdiloco.util.files import write_atomic

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
    try:
        with serving_reach(dht):  # peers ask it first whether others can dial them
            serve(dht, identity, created, maddr_file, print_fn, stop)
    finally:
        dht.shutdown()
        reaper.close()


def serve(dht, identity: Path, created: bool, maddr_file: Path | None, print_fn, stop: threading.Event) -> None:
    """Print the node's addresses (and write them to `maddr_file`), then wait for `stop` while the DHT lives."""
    maddrs = visible_maddrs(dht)
    print_fn(f"bootstrap node {dht.peer_id.to_base58()} ({'new' if created else 'reused'} identity {identity})")
    print_fn("peers join with --initial-peers and one of:")
    for m in maddrs:
        print_fn(f"  {m}")
    if maddr_file is not None:
        write_atomic(maddr_file, "".join(m + "\n" for m in maddrs))
    print_fn("running; Ctrl+C to stop")
    while not stop.wait(1.0):
        if not dht.is_alive():
            raise SwarmError("the DHT process died; restart the bootstrap node (its identity file keeps its address)")
