"""A peer's records in the DHT: its heartbeat, its config record (its fingerprint and what it says about itself), and
the 'left' or 'finished' record it leaves."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable

from hivemind.utils.timed_storage import get_dht_time

from p2pdiloco.network.dht_store import DHT_REPLICAS
from p2pdiloco.network.swarm import (
    CONFIG_TTL_S,
    config_key,
    live_records,
    peer_shard,
    peers_key,
    write_subkey,
)

FINISHED_RECORD_S = 3600.0
"""How long a finished peer's 'left' record stays in the DHT."""

RECORD_BEATS = DHT_REPLICAS + 1
"""A heartbeat record lives this many heartbeats. Each beat refreshes it on one of its key's `DHT_REPLICAS` nearest
nodes in turn, so every node's copy is refreshed every `DHT_REPLICAS` beats and expires a beat after that."""


def swarm_finished(records: dict[str, dict], me: str, total_steps: int) -> tuple[str, int] | None:
    """(peer, step) of a peer that finished this run (reached `total_steps`) and left, if no peer is still live."""
    others = {p: r for p, r in records.items() if p != me}
    if not others or live_records(others):
        return None
    for peer, r in others.items():
        step = r.get("step")
        if r.get("finished") is True and isinstance(step, int) and step >= total_steps:
            return peer, step
    return None


class Heartbeat:
    """This peer's record in the DHT: refreshed every `period` seconds, expiring `RECORD_BEATS` periods after the
    last beat, and replaced by a 'left' record when the peer exits cleanly, so others stop counting on it at once.

    The first beat and the 'left' record go to every one of the key's nearest nodes; the beats between, to one of
    them in turn (`store_near`'s `turn`): a third of the bytes of storing each beat on all three. A reader's walk
    (`swarm.read_subkeys`, as `read_peers` reads) visits them all and keeps the newest copy; a copy on one node is
    at most `DHT_REPLICAS` beats old, and outlives one node that leaves by as long.

    Each record carries `time`, the DHT time (Unix seconds) it was written, so that readers can tell how
    fresh it is and place its values on a time axis."""

    def __init__(self, dht, run_id: str, peer_id: str, record, period: float):
        self.dht, self.peer_id, self.record, self.period = dht, peer_id, record, period
        self.key, self.config_key = peers_key(run_id, peer_shard(peer_id)), config_key(run_id)
        self._expiration = 0.0
        self._config_written = -math.inf
        self._config: dict | None = None
        """The config record last written."""
        self.beats = 0
        """Records written (the 'left' one included)."""

    async def _write(self, value: dict, ttl: float | None = None, every_node: bool = False) -> None:
        # a newer record must expire later than the one it replaces, or the DHT keeps the old one
        self._expiration = max(get_dht_time() + (ttl or RECORD_BEATS * self.period), self._expiration + 1e-3)
        turn = None if every_node or self.beats == 0 else self.beats
        self.beats += 1
        await write_subkey(self.dht, self.key, self.peer_id, value, self._expiration, turn=turn)

    async def beat(self) -> None:
        """Write this peer's record once (`run` does, every `period`)."""
        await self._write({**self.record(), "time": get_dht_time()})

    async def run(self, fingerprint: dict, about: Callable[[], dict] = dict) -> None:
        """Beat until cancelled. The config's full fingerprint and what `about` returns (this peer's
        `peer_records.ABOUT_FIELDS`) go in a record of their own, the config record: written at the first beat,
        again when `about` changes (the dial-back's verdict), and renewed at half its life, since only `status`, the
        dashboard and a joiner read them, where every heartbeat moves its record."""
        while True:
            await self.beat()
            config = {"fingerprint": fingerprint, **about()}
            if config != self._config or time.monotonic() - self._config_written >= CONFIG_TTL_S / 2:
                if await write_subkey(self.dht, self.config_key, self.peer_id, config, get_dht_time() + CONFIG_TTL_S):
                    self._config, self._config_written = config, time.monotonic()
            await asyncio.sleep(self.period)

    async def leave(self, finished_at: int | None = None) -> None:
        """Replace the record by a 'left' one; a peer that finished the run says so, for an hour, so that a peer
        restarted after the swarm finished does not train on alone (see `swarm_finished`)."""
        if finished_at is None:
            await self._write({"left": True, "time": get_dht_time()}, every_node=True)
        else:
            await self._write({"left": True, "finished": True, "step": finished_at, "time": get_dht_time()},
                              ttl=FINISHED_RECORD_S, every_node=True)
