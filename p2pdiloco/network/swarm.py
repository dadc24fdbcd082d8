"""The swarm: start or join a hivemind DHT, publish and read peer records, refuse mismatched configs.

DHT keys are prefixed by the run id, so several swarms can share one bootstrap node:
``{run_id}_peers_{shard}`` hold one expiring record per live peer (subkey = peer id; `PEER_SHARDS` keys),
``{run_id}_config`` one record per peer with its config's fingerprint and what it says about itself that does not
change while it runs (`peer_records.ABOUT_FIELDS`: name, version, addresses, device, start time), and
``{run_id}_census`` one per peer taking part in matchmaking, naming the epoch (census.py).
Only the peer a subkey names can write under it (`PeerRecordValidator`, network/identity.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import hashlib
import logging
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

import hivemind
import psutil
import torch
from hivemind.p2p.p2p_daemon_bindings.utils import P2PDaemonError
from hivemind.utils.multiaddr import Multiaddr
from hivemind.utils.timed_storage import get_dht_time

from p2pdiloco.config import SwarmConfig, fingerprint_diff, protocol_of
from p2pdiloco.network.dht_store import DHT_BUCKET_SIZE, DHT_REPLICAS, read_near_many, store_near
from p2pdiloco.network.identity import (
    IdentityError,
    PeerIdentity,
    PeerRecordValidator,
    load_or_create_identity,
    write_temporary_identity,
)
from p2pdiloco.network.loop import BackgroundLoop as BackgroundLoop  # where callers have imported it from
from p2pdiloco.network.sockets import daemon_sockets, remove_stale_sockets
from p2pdiloco.network.swarm_key import KeyedRecordValidator, SwarmAuth, SwarmKeyError, load_key
from p2pdiloco.network.traffic import install_dht_counter
from p2pdiloco.util.memory import keep_releasing_memory

logger = logging.getLogger(__name__)

if "HIVEMIND_MEMORY_SHARING_STRATEGY" not in os.environ:
    # hivemind asks torch to share tensors between processes through files in /dev/shm ('file_system'), which
    # makes torch start a torch_shm_manager process beside each peer at its first DHT call: ~57 MB (libtorch's
    # static initialisation) to share the few bytes of state of each DHT call's future. File descriptors share
    # them without an extra process. Set before any DHT exists, since hivemind shares its
    # futures' state from the first one; an explicit HIVEMIND_MEMORY_SHARING_STRATEGY still decides.
    torch.multiprocessing.set_sharing_strategy("file_descriptor")


class SwarmError(RuntimeError):
    """The swarm cannot be joined as asked; the message is shown to the user as one line."""


def host_maddrs(host: str, port: int) -> list[str]:
    proto = "ip6" if ":" in host else "ip4"
    return [f"/{proto}/{host}/tcp/{port}"]


def check_maddrs(addrs: list[str], what: str) -> None:
    """Raise SwarmError naming the first string that is not a full multiaddr with a /p2p/ peer id."""
    for addr in addrs:
        try:
            maddr = Multiaddr(addr)
        except Exception:
            raise SwarmError(f"{what} {addr!r} is not a multiaddr (expected e.g. /ip4/1.2.3.4/tcp/31337/p2p/12D3Koo...)") from None
        if what == "initial peer" and "/p2p/" not in str(maddr):
            raise SwarmError(f"initial peer {addr!r} lacks the /p2p/<peer id> part (copy the full address printed by the node)")


P2PD_GOGC = "25"
"""Go's GC target for p2pd, the libp2p daemon: collect when the heap has grown 25 % past what is live, not 100 %.
1000 concurrent streams from strangers (tests/test_stranger_streams.py) grew a peer by up to 57 MB at Go's
default and 48 MB at 25 (docs/security.md), nearly all of it p2pd. Its CPU for three 2-peer fp32 merges of 20M
parameters: 2.05-2.26 s at 25, 1.77-2.09 s at 100, the merges as fast (docs/security.md)."""

P2PD_TCP_REUSEPORT = "false"
"""go-libp2p's TCP transport dials out from its listening port by default (SO_REUSEPORT, for hole punching, which
p2pdiloco does not use). Timed rounds make group mates dial each other at the same instant; over a link with
delay the two opens then cross, TCP joins them into one connection that both sides initiated, and libp2p's noise
handshake fails on both ("noise: message is too short"). From an ephemeral port each dial is a connection of its
own. Loopback never shows it: its round trip is too short for the opens to cross."""


def identity_and_validators(cfg: SwarmConfig, identity_path: str | None) -> tuple[PeerIdentity, list]:
    """The DHT node's identity (see `start_dht`) and the validators of the records it stores: signed by the swarm
    key of a private swarm, and peer records signed by their own peer.

    Raises:
        SwarmError: a bad swarm key or identity file.
    """
    validators = []
    if cfg.swarm_key:  # a private swarm: only records signed with the key are stored or read
        try:
            validators.append(KeyedRecordValidator(load_key(cfg.swarm_key)))
        except SwarmKeyError as e:
            raise SwarmError(str(e)) from None
    try:
        identity = PeerIdentity.generate() if identity_path is None else load_or_create_identity(identity_path)
    except IdentityError as e:
        raise SwarmError(str(e)) from None
    validators.append(PeerRecordValidator(identity))
    return identity, validators


def start_dht(cfg: SwarmConfig, identity_path: str | None = None, client_mode: bool = False) -> hivemind.DHT:
    """Start this process's DHT node and join the swarm through `cfg.initial_peers` (if any).

    The node runs with a libp2p identity this process holds, so that it can sign its own peer records and
    every node can refuse records signed by anyone else (`PeerRecordValidator`).

    Args:
        cfg: the swarm's config.
        identity_path: the node's identity key file, created if missing and reused afterwards (same peer id);
            None: a fresh identity, handed to p2pd through a private temporary file removed once it started.
        client_mode: join as a DHT client (stores nothing, serves nobody), as `status` and `dashboard` do.

    Raises:
        SwarmError: bad addresses or identity file, or no initial peer reachable within `cfg.join_timeout_s`.
    """
    check_maddrs(cfg.initial_peers, "initial peer")
    check_maddrs(cfg.announce, "announce address")
    identity, validators = identity_and_validators(cfg, identity_path)
    temporary = write_temporary_identity(identity) if identity_path is None else None
    t0 = time.monotonic()
    with contextlib.suppress(OSError):  # what earlier killed daemons on this machine left behind
        remove_stale_sockets()
    install_dht_counter()  # before the DHT process forks, so that it counts its own traffic
    os.environ.setdefault("GOGC", P2PD_GOGC)  # p2pd inherits this process's environment (a user's GOGC wins)
    os.environ.setdefault("LIBP2P_TCP_REUSEPORT", P2PD_TCP_REUSEPORT)
    # The DHT process is a fork of this one: the pages of everything made so far (torch, hivemind, the data) stay
    # shared with it until either process writes to them, and a full garbage collection writes to every object it
    # visits. Frozen objects are never visited (CPython's advice for a fork without exec, see `gc.freeze`); they
    # are long-lived anyway, and any of them that later becomes garbage in a cycle is left to the process's end.
    gc.freeze()
    try:
        dht = _joined_dht(cfg, t0, identity_path=temporary or identity_path, client_mode=client_mode,
                          validators=validators)
    except P2PDaemonError as e:
        reason = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        if cfg.initial_peers:
            waited = time.monotonic() - t0
            raise SwarmError(
                f"could not join the swarm through {', '.join(cfg.initial_peers)} "
                f"({reason}; gave up after {waited:.1f} s)"
            ) from None
        raise SwarmError(f"could not start the p2p daemon on {cfg.host}:{cfg.port} ({reason})") from None
    except TimeoutError:
        raise SwarmError(f"the DHT did not start within {cfg.join_timeout_s:.0f} s") from None
    finally:
        if temporary is not None:
            os.unlink(temporary)  # p2pd has read it; the key now lives only in this process and its children
    if dht.peer_id.to_base58() != identity.peer_id:  # p2pd ignored the key: our records would all be refused
        dht.shutdown()
        raise SwarmError(f"the p2p daemon runs as {dht.peer_id} instead of its identity {identity.peer_id}")
    # the DHT process reads and answers records all the time: what malloc keeps of their freed buffers would grow
    dht.run_coroutine(functools.partial(keep_releasing_memory, 60.0))  # for hours (util/memory)
    return dht


BOOTSTRAP_PING = "none of the initial_peers responded to a ping"
"""hivemind's error when no initial peer answered its first ping within its request timeout (3 s): on a loaded
machine (32 peers starting on 2 cores) a bootstrap node can be that slow, and the peer's start failed for it."""


def _joined_dht(cfg: SwarmConfig, t0: float, identity_path: str | None, client_mode: bool,
                validators: list) -> hivemind.DHT:
    """hivemind's DHT node, started and joined (see `start_dht`); a join whose initial peers answered no ping is
    tried again, a second later, until `cfg.join_timeout_s` from `t0` has passed.

    Raises:
        SwarmError: no initial peer answered a ping in that time.
    """
    while True:
        try:
            return hivemind.DHT(
                start=True,
                initial_peers=cfg.initial_peers or None,
                host_maddrs=host_maddrs(cfg.host, cfg.port),
                announce_maddrs=cfg.announce or None,
                identity_path=identity_path,
                # hivemind's check that nobody else runs with this key starts a second p2pd (~0.3 s a start) and
                # cannot read Ed25519 keys; a fresh key is nobody else's, and a reused file is the operator's to
                # keep to one process
                check_if_identity_free=False,
                client_mode=client_mode,
                startup_timeout=cfg.join_timeout_s,
                await_ready=True,
                record_validators=validators,
                # a DHT request's reply lists up to a bucket of contacts: in a swarm of 16, ~14 KB a request with
                # hivemind's defaults (20 contacts per reply, 5 replicas), ~4.5 KB with these (BitTorrent's DHT
                # also keeps 8 per bucket)
                bucket_size=DHT_BUCKET_SIZE, num_replicas=DHT_REPLICAS,
                # hivemind's reader keeps what it found (and re-reads it in the background before it expires) and
                # pushes it to a node near the key: records live on their key's nearest nodes and are read from
                # there (`read_subkeys`), so neither copy serves anyone, and the push would cost a whole census
                # after each read (tests/test_records.py)
                cache_locally=False, cache_nearest=0,
            )
        except RuntimeError as e:
            if BOOTSTRAP_PING not in str(e):
                raise
            if time.monotonic() - t0 + 1.0 >= cfg.join_timeout_s:
                raise SwarmError(f"no initial peer of {', '.join(cfg.initial_peers)} answered a ping within "
                                 f"{cfg.join_timeout_s:.0f} s") from None
            logger.warning("no initial peer answered a ping yet (%.1f s): trying again", time.monotonic() - t0)
            time.sleep(1.0)  # a back-off before the next join, not a wait for a condition


class Reaper:
    """Ends the DHT process and p2p daemon of this process if it dies without closing them (see reaper.py).

    Args:
        dht: a started DHT; its process and the processes it started are watched.
    """

    def __init__(self, dht: hivemind.DHT):
        targets = []
        try:
            root = psutil.Process(dht.pid)
            for p in [root, *root.children(recursive=True)]:
                targets.append(f"{p.pid}:{p.create_time()}")
                if p.name() == "p2pd":
                    targets += daemon_sockets(p.cmdline())
        except psutil.Error as e:
            logger.warning("cannot watch the DHT's processes: %r", e)
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "p2pdiloco.network.reaper", *targets],
            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )

    def close(self, timeout: float = 5.0) -> None:
        """Call after shutting the DHT down: the watchdog kills what is left and exits."""
        try:
            self._proc.stdin.close()
            self._proc.wait(timeout)
        except (OSError, subprocess.TimeoutExpired):
            self._proc.kill()
            self._proc.wait()


def swarm_auth(cfg: SwarmConfig) -> SwarmAuth:
    """The request authenticator of this swarm: keyed if `cfg.swarm_key` names a key file, else open."""
    try:
        return SwarmAuth(load_key(cfg.swarm_key) if cfg.swarm_key else None, cfg.run_id)
    except SwarmKeyError as e:
        raise SwarmError(str(e)) from None


def visible_maddrs(dht: hivemind.DHT) -> list[str]:
    return [str(m) for m in dht.get_visible_maddrs()]


DHT_READ_BEAM = DHT_REPLICAS
"""Nodes a read keeps in its beam: those of `store_near`'s walk, where the records were stored (hivemind: the
bucket size, 8 here)."""

PEER_SHARDS = 4
"""Peer records are spread over this many DHT keys. A heartbeat moves only its own record (`store_near`): shards
share out the holders' load (a shard's beats and reads), and each costs a whole-swarm reader (`status`, the
dashboard, a starting peer) a walk to its nearest nodes, ~3 kB from a fresh node at 32 peers, more than its copy."""

CONFIG_TTL_S = 600.0
"""A peer's config record (its full fingerprint, for a joiner's check, and `peer_records.ABOUT_FIELDS`) lives this long,
renewed at half of it and written again when what it holds changes."""


def peers_key(run_id: str, shard: int = 0) -> str:
    return f"{run_id}_peers_{shard}"


def peer_shard(peer_id: str) -> int:
    """The shard of `peer_id`'s records (a hash, so that shards fill evenly)."""
    return int.from_bytes(hashlib.blake2b(peer_id.encode(), digest_size=4).digest(), "big") % PEER_SHARDS


def config_key(run_id: str) -> str:
    return f"{run_id}_config"


async def read_peers(dht: hivemind.DHT, run_id: str, timeout: float = 5.0, near: bool = False,
                     shards: Sequence[int] | None = None) -> dict[str, dict]:
    """Every peer record of the swarm: all shards (or those of `shards`), read at once. `near`: one node's copy of
    each shard (`read_near_subkeys`), which may be a few heartbeats old or lack a record stored elsewhere: a first
    look."""
    keys = [peers_key(run_id, s) for s in (range(PEER_SHARDS) if shards is None else shards)]
    parts = [await read_near_subkeys(dht, keys, timeout)] if near else await asyncio.gather(
        *(read_subkeys(dht, key, timeout) for key in keys))
    return {peer: record for part in parts for peer, record in part.items()}


async def read_subkeys(dht: hivemind.DHT, key: str, timeout: float = 5.0) -> dict[str, dict]:
    """Unexpired records under `key` as {subkey: value}; {} if none or on timeout. Malformed entries are skipped."""
    try:
        found = await asyncio.wait_for(dht.get(key, latest=True, beam_size=DHT_READ_BEAM, return_future=True), timeout)
    except TimeoutError:
        logger.debug("DHT get %s timed out", key)
        return {}
    if found is None or not isinstance(found.value, dict):
        return {}
    now = get_dht_time()
    out = {}
    for subkey, item in found.value.items():
        value = getattr(item, "value", None)
        if isinstance(subkey, str) and isinstance(value, dict) and getattr(item, "expiration_time", 0) > now:
            out[subkey] = value
    return out


async def read_near_subkeys(dht: hivemind.DHT, key: str | list[str], timeout: float = 5.0) -> dict[str, dict]:
    """As `read_subkeys`, from the key's nearest node only (`dht_store.read_near_many`); {} if none or on timeout. A list
    of keys: their records together, their nearest nodes found by one walk (`dht_store.read_near_many`)."""
    try:
        found = await asyncio.wait_for(read_near_many(dht, [key] if isinstance(key, str) else key), timeout)
    except TimeoutError:
        logger.debug("DHT read of %s timed out", key)
        return {}
    now = get_dht_time()
    return {k: v for part in found.values() for k, (v, expiration) in part.items()
            if isinstance(k, str) and isinstance(v, dict) and expiration > now}


async def write_subkey(
    dht: hivemind.DHT, key: str, subkey: str, value: dict, expiration: float, timeout: float = 5.0,
    turn: int | None = None,
) -> bool:
    """Store `value` under (key, subkey) until `expiration` (DHT time), on the key's nearest nodes (`store_near`;
    `turn`: on one of them, in rotation).

    The DHT keeps whichever value expires last, so a record meant to replace an earlier one must be given a
    later expiration than it, or the store is silently refused.
    """
    try:
        return bool(await asyncio.wait_for(store_near(dht, key, subkey, value, expiration, turn=turn), timeout))
    except TimeoutError:
        logger.warning("DHT store %s timed out", key)
        return False


def live_records(records: dict[str, dict]) -> dict[str, dict]:
    """Peer records of peers that have not announced that they left."""
    return {p: r for p, r in records.items() if not r.get("left")}


async def live_configs(dht: hivemind.DHT, run_id: str, peers: dict[str, dict], timeout: float = 5.0) -> dict[str, dict]:
    """The config records (`config_key`) of the peers live now, by `peers` (a `read_peers` already made)."""
    configs = await read_subkeys(dht, config_key(run_id), timeout)
    live = live_records(peers)
    return {p: r for p, r in configs.items() if p in live}


def configs_differ(records: dict[str, dict], digest: str) -> bool:
    """Whether a live peer's record (`read_peers`) carries a config digest other than `digest`, or none: only then
    does a starting peer read the config records (`live_configs`), to say what differs (`check_fingerprint`). The
    config key holds one full fingerprint a peer (~0.5 kB signed), read from each of the ~3 nodes holding it: a
    joiner's read of it grows with the swarm, where the digests come with the peer records it reads anyway."""
    return any(record.get("fingerprint") != digest for record in live_records(records).values())


def check_fingerprint(mine: dict[str, Any], records: dict[str, dict]) -> None:
    """Raise SwarmError if any live peer's config record carries a different config fingerprint.

    Args:
        records: config records (`config_key`) of the live peers only: a peer that left with another config
            must not keep a new run from starting."""
    for peer_id, record in records.items():
        theirs = record.get("fingerprint")
        if isinstance(theirs, dict) and protocol_of(theirs) != protocol_of(mine):
            raise SwarmError(f"peer {peer_id[-8:]} speaks wire protocol {protocol_of(theirs)} and this "
                             f"peer {protocol_of(mine)}: peers of different protocol versions cannot train together "
                             "(run the swarm's version of p2pdiloco)")
        if isinstance(theirs, dict) and theirs != mine:
            diff = "; ".join(fingerprint_diff(mine, theirs)) or "unknown difference"
            raise SwarmError(f"this peer's config differs from the swarm's (peer {peer_id[-8:]}): {diff}")

