"""Byte accounting: what a peer really sent and received, by kind, and its ratio against data-parallel.

Three kinds of traffic:

- ``merge``: p2pdiloco's merge protocols (invites, group notices, pseudo-gradient slices and averages),
  counted frame by frame in wire.py.
- ``state``: state downloads served to joiners and fetched when joining, counted the same way.
- ``dht``: hivemind's DHT requests and responses (peer records, ready records, routing). The DHT runs in
  its own forked process; `install_dht_counter` wraps the p2p daemon client's unary calls before the fork,
  so the child counts the protobuf bytes of every request it makes and answers, and `refresh_dht` reads
  the child's counts through `DHT.run_coroutine`.

All counts are application bytes: libp2p's framing, Noise encryption and TCP/IP headers add a few percent
on the wire that no counter here sees.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

import hivemind
from hivemind.proto import dht_pb2

from p2pdiloco.network.wire import ByteCounter

logger = logging.getLogger(__name__)

_DHT_COUNTER = ByteCounter()
"""In a DHT process: the bytes of its unary requests and responses (meaningless in the parent)."""
_DHT_BY_RPC: dict[str, list[int]] = {}
"""In a DHT process: {rpc name ("find", "store", "ping"): [requests made, requests served, bytes sent + received]}."""
_DHT_BY_KEY: dict[str, int] = {}
"""In a DHT process: {key id (hex): bytes sent + received} of find and store requests, made and served; a request
for k keys gives each a k-th of its bytes. At most `MAX_KEYS` keys, and `OTHER_KEYS` for the rest (`count_key`)."""
MAX_KEYS = 256
"""Keys `_DHT_BY_KEY` counts one by one. The keys a request names are anyone's choice (a stranger may ask for
thousands of random ids in one request, and every joining node looks up its own new id), so an unbounded table
would grow with them for as long as the process lives; a run's own keys are a few dozen and busy."""
OTHER_KEYS = "other"
"""The entry of `_DHT_BY_KEY` that holds the bytes of the keys no longer counted one by one."""
_installed = False


_KEYED_REQUESTS = {"find": dht_pb2.FindRequest, "store": dht_pb2.StoreRequest}
"""The DHT requests that name keys, by rpc name: their bytes are also counted by key."""


def _rpc_name(proto: str) -> str:
    return proto.rsplit(".", 1)[-1].removeprefix("rpc_")


def count_key(by_key: dict[str, int], key: str, moved: int, max_keys: int = MAX_KEYS) -> None:
    """Add `moved` bytes to `key` in `by_key`, keeping at most `max_keys` keys besides `OTHER_KEYS`: before a new key
    would make one too many, the keys that moved the fewest bytes are folded into `OTHER_KEYS` until half are left
    (so a run's busy keys stay, the totals stay exact, and a fold, a sort of `max_keys` keys, comes once every
    `max_keys / 2` new keys)."""
    if key not in by_key and len(by_key) - (OTHER_KEYS in by_key) >= max_keys:
        counted = sorted((k for k in by_key if k != OTHER_KEYS), key=by_key.__getitem__)
        folded = sum(by_key.pop(k) for k in counted[: len(counted) - max_keys // 2])
        by_key[OTHER_KEYS] = by_key.get(OTHER_KEYS, 0) + folded
    by_key[key] = by_key.get(key, 0) + moved


def install_dht_counter() -> None:
    """Count the DHT's traffic in every DHT process started after this call (idempotent)."""
    global _installed
    if _installed:
        return
    from hivemind.p2p.p2p_daemon_bindings.p2pclient import Client

    call, add = Client.call_unary_handler, Client.add_unary_handler

    def by_rpc(proto: str) -> list[int]:
        return _DHT_BY_RPC.setdefault(_rpc_name(proto), [0, 0, 0])

    def by_key(proto: str, request: bytes, moved: int) -> None:
        kind = _KEYED_REQUESTS.get(_rpc_name(proto))
        if kind is None:
            return
        try:
            keys = kind.FromString(request).keys
        except Exception:  # a malformed request: its bytes are in the totals, under no key
            return
        for key in keys:
            count_key(_DHT_BY_KEY, key.hex(), moved // len(keys))

    async def counted_call(self, peer_id, proto: str, data: bytes) -> bytes:
        _DHT_COUNTER.sent += len(data)
        rpc = by_rpc(proto)
        rpc[0] += 1
        rpc[2] += len(data)
        response = await call(self, peer_id, proto, data)
        _DHT_COUNTER.received += len(response)
        rpc[2] += len(response)
        by_key(proto, data, len(data) + len(response))
        return response

    async def counted_add(self, proto: str, handler, balanced: bool = False) -> None:
        async def counted_handler(request: bytes, remote_id):
            _DHT_COUNTER.received += len(request)
            rpc = by_rpc(proto)
            rpc[1] += 1
            rpc[2] += len(request)
            response = await handler(request, remote_id)
            _DHT_COUNTER.sent += len(response)
            rpc[2] += len(response)
            by_key(proto, request, len(request) + len(response))
            return response

        await add(self, proto, counted_handler, balanced=balanced)

    Client.call_unary_handler, Client.add_unary_handler = counted_call, counted_add
    _installed = True


async def _dht_counts(dht: hivemind.DHT, node) -> tuple[int, int, dict[str, list[int]], dict[str, int]]:
    return _DHT_COUNTER.sent, _DHT_COUNTER.received, {k: list(v) for k, v in _DHT_BY_RPC.items()}, dict(_DHT_BY_KEY)


def dht_bytes_by_kind(by_key: dict[str, int], run_id: str) -> dict[str, int]:
    """A DHT process's bytes by key (`Traffic.dht_by_key`) by what the key holds: "peer records" (the heartbeat
    shards), "census", "config", and "other" (hivemind's routing-table refreshes, which look up random ids, and
    keys of other runs)."""
    from hivemind.dht.routing import DHTID

    from p2pdiloco.network.census import census_key
    from p2pdiloco.network.dht_store import beside
    from p2pdiloco.network.swarm import PEER_SHARDS, config_key, peers_key

    kinds: dict[str, str] = {}

    def add(key: str, kind: str) -> None:  # a key's walks look up the id beside it (dht_store.beside)
        key_id = DHTID.generate(source=key)
        kinds[key_id.to_bytes().hex()] = kinds[beside(key_id).to_bytes().hex()] = kind

    for shard in range(PEER_SHARDS):
        add(peers_key(run_id, shard), "peer records")
    add(config_key(run_id), "config")
    add(census_key(run_id), "census")
    out = dict.fromkeys(("peer records", "census", "config", "other"), 0)
    for key, moved in by_key.items():
        out[kinds.get(key, "other")] += moved
    return out


def ddp_bytes_per_step(n_params: int, n_peers: int) -> float:
    """Bytes one peer sends per step in a ring all-reduce of fp32 gradients: 2·(N−1)/N · params · 4."""
    return 2 * (n_peers - 1) / n_peers * n_params * 4 if n_peers > 1 else 0.0


@dataclass
class Traffic:
    """This peer's byte counters, by kind."""

    merge: ByteCounter = field(default_factory=ByteCounter)
    state: ByteCounter = field(default_factory=ByteCounter)
    dht: ByteCounter = field(default_factory=ByteCounter)
    dht_by_rpc: dict[str, list[int]] = field(default_factory=dict)
    """The DHT's traffic by request kind: {"find": [requests made, requests served, bytes both ways], ...}."""
    dht_by_key: dict[str, int] = field(default_factory=dict)
    """The DHT's find and store bytes by key id (hex), both ways; see `dht_bytes_by_kind`."""

    async def refresh_dht(self, dht: hivemind.DHT, timeout: float = 5.0) -> None:
        """Read the DHT process's counts (keeps the last ones if it does not answer in time)."""
        try:
            sent, received, by_rpc, by_key = await asyncio.wait_for(
                dht.run_coroutine(_dht_counts, return_future=True), timeout)
        except Exception as e:  # a slow or shutting-down DHT process: the counts are a few seconds older
            logger.debug("reading the DHT byte counts failed: %r", e)
            return
        self.dht.sent, self.dht.received, self.dht_by_rpc, self.dht_by_key = sent, received, by_rpc, by_key

    async def watch_dht(self, dht: hivemind.DHT, interval: float) -> None:
        while True:
            await self.refresh_dht(dht)
            await asyncio.sleep(interval)

    def sent(self, with_dht: bool = False) -> int:
        return self.merge.sent + self.state.sent + (self.dht.sent if with_dht else 0)

    def received(self, with_dht: bool = False) -> int:
        return self.merge.received + self.state.received + (self.dht.received if with_dht else 0)

    def snapshot(self) -> dict[str, dict[str, int]]:
        return {k: {"sent": c.sent, "received": c.received} for k, c in
                (("merge", self.merge), ("state", self.state), ("dht", self.dht))}


def bandwidth_report(traffic: Traffic, inner_steps: int, n_params: int, n_peers: int) -> dict:
    """Bytes sent per inner step, beside what data-parallel training of the same peers would send.

    Args:
        traffic: this peer's counters.
        inner_steps: inner steps this peer ran.
        n_params: parameters of the model.
        n_peers: N of the data-parallel baseline (the largest merge group this peer was part of).

    Returns:
        ``bytes_sent_per_step`` (merges and state), ``ddp_bytes_per_step``, ``bandwidth_ratio_vs_ddp`` (DDP ÷
        ours; None when nothing was sent or N < 2) and the same with the DHT's bytes included.
    """
    steps = max(inner_steps, 1)
    ddp = ddp_bytes_per_step(n_params, n_peers)
    ours, ours_dht = traffic.sent() / steps, traffic.sent(with_dht=True) / steps
    return {
        "bytes_sent_per_step": ours, "bytes_sent_per_step_with_dht": ours_dht, "ddp_bytes_per_step": ddp,
        "ddp_peers": n_peers,
        "bandwidth_ratio_vs_ddp": ddp / ours if ours > 0 and ddp > 0 else None,
        "bandwidth_ratio_vs_ddp_with_dht": ddp / ours_dht if ours_dht > 0 and ddp > 0 else None,
    }


def swarm_bandwidth(peer_summaries: list[dict]) -> dict:
    """Run-level ratios from the peers' summaries: all peers' data-parallel bytes ÷ all bytes they sent."""
    out = {}
    for suffix in ("", "_with_dht"):
        ddp = ours = 0.0
        for p in peer_summaries:
            steps = p.get("inner_steps", 0)
            ddp += p.get("ddp_bytes_per_step", 0.0) * steps
            ours += p.get(f"bytes_sent_per_step{suffix}", 0.0) * steps
        out[f"bandwidth_ratio_vs_ddp{suffix}"] = ddp / ours if ours > 0 and ddp > 0 else None
    return out
