"""What a peer's records say, split by who reads them: the heartbeat (`swarm.peers_key`, every few seconds: progress,
read by joiners and matchmaking's neighbours) and the config record (`swarm.config_key`, written at start and when
it changes: the config's fingerprint and `ABOUT_FIELDS`, read by `status`, the dashboard, and a joiner whose peers'
config digests differ from its own).

A heartbeat moves its whole record to a node every few seconds for as long as the peer runs, and every reader of
the swarm's records moves every peer's: what never changes while a peer runs is written once instead.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random

import hivemind

from p2pdiloco.network.swarm import PEER_SHARDS, config_key, live_records, read_peers, read_subkeys

ABOUT_FIELDS = ("name", "version", "maddrs", "device", "started", "reach_detail")
"""What a peer says about itself in its config record, not in every heartbeat: shown by `status` and the dashboard
(`with_about`), never read by matchmaking or a joiner."""

START_SAMPLE = 4
"""Live peers whose records a starting peer reads at least (`sample_peers`; every record where the swarm has fewer)."""


def about_of(config_record: object) -> dict:
    """The `ABOUT_FIELDS` of a peer's config record (its full fingerprint left out); {} if it is malformed."""
    if not isinstance(config_record, dict):
        return {}
    return {k: config_record[k] for k in ABOUT_FIELDS if k in config_record}


def with_about(records: dict[str, dict], configs: dict[str, object]) -> dict[str, dict]:
    """Each peer record of `records` with its peer's `ABOUT_FIELDS` from `configs` (config records by peer id). The
    heartbeat's own fields win: a peer of another version that still sends them there is shown as it says."""
    return {p: {**about_of(configs.get(p)), **r} for p, r in records.items()}


async def read_with_about(dht: hivemind.DHT, run_id: str, timeout: float = 5.0) -> dict[str, dict]:
    """Every peer record of the swarm (`swarm.read_peers`, by walks), each with its peer's `ABOUT_FIELDS`
    (`with_about`): what `status` shows."""
    records, configs = await asyncio.gather(read_peers(dht, run_id, timeout),
                                            read_subkeys(dht, config_key(run_id), timeout))
    return with_about(records, configs)


@dataclasses.dataclass
class PeerSample:
    """Peer records as `swarm.read_peers` returns them, of the shards `shards` only."""

    records: dict[str, dict]
    shards: tuple[int, ...]

    @property
    def whole(self) -> bool:
        """Whether every shard was read: the records are the whole swarm's."""
        return len(set(self.shards)) == PEER_SHARDS


async def sample_peers(dht: hivemind.DHT, run_id: str, me: str, enough: int = START_SAMPLE,
                       timeout: float = 5.0) -> PeerSample:
    """The records of a random shard, and of every other shard too if it holds fewer than `enough` live peers other
    than `me`: one node's copy of each (`read_peers(near=True)`), which may be a few heartbeats old.

    A starting peer's first look at the swarm (its config check, whether anyone is ahead) reads a whole shard, so
    every live peer of that shard is seen, but not every shard: that read is the whole swarm's records, and it grew
    with the swarm (docs/benchmarks.md, Scale). A swarm that has trained is ahead of a fresh peer in every shard; a
    sample of fewer than `enough` live peers is completed, so that "nobody else is live" is read from every shard."""
    order = random.sample(range(PEER_SHARDS), PEER_SHARDS)
    records = await read_peers(dht, run_id, timeout, near=True, shards=order[:1])
    if sum(p != me for p in live_records(records)) >= enough:
        return PeerSample(records, tuple(order[:1]))
    records.update(await read_peers(dht, run_id, timeout, near=True, shards=order[1:]))
    return PeerSample(records, tuple(order))
