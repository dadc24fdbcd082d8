"""Hostile kinds that hold the swarm key and attack the swarm's rules rather than the model (`bench byzantine`):

- grinder: its id is ground, before its DHT starts, to rank first in the public order (`census.leader_rank`) of
  the next epochs against the ids of the other peers of its `local` run (read from their identity files); it
  announces honest deadlines, looks for a group all the time, and never invites.
- pinner: every 0.1 s it asks a live peer for its state and never reads a byte of the reply (a download it is
  granted stalls until the donor cuts it).
- flood: it sends valid `ready` requests to every live peer from `FLOOD_STREAMS` streams each, asking again as
  soon as it is answered.

docs/security.md says how each is stopped ("The leader order", "Per-sender limits").
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from pathlib import Path

from hivemind.p2p import PeerID
from hivemind.utils.timed_storage import get_dht_time

from p2pdiloco.config import Config
from p2pdiloco.network.census import epoch_of, leader_rank, registered_now
from p2pdiloco.network.identity import IdentityError, PeerIdentity
from p2pdiloco.network.wire import send_msg

logger = logging.getLogger(__name__)

GRIND_KEYS = 20000
"""Keys the grinder tries at most (about 2-4 s on one core)."""
GRIND_EPOCHS = 8
"""Epochs ahead the grinder tries to rank first in (each costs about 4x the keys against 3 others)."""
SIBLINGS_WAIT_S = 30.0
"""How long the grinder waits for the other peers' identity files (they start together with it)."""
PIN_EVERY_S = 0.1
"""How often the pinner asks a donor for its state."""
FLOOD_STREAMS = 12
"""Streams the flooder keeps asking from, per victim."""


def ground_identity(cfg: Config, path: Path) -> None:
    """Write to `path` (this peer's identity file) a key whose id ranks first in as many of the next
    `GRIND_EPOCHS` epochs as `GRIND_KEYS` keys allow, against the ids of the other peers of this `local` run
    (whose identity files lie beside this one's folder, written as their DHTs start)."""
    others = _sibling_ids(path, max(1, cfg.startup.wait_for_peers - 1))
    e0 = epoch_of(get_dht_time(), cfg.merge.epoch_s)
    epochs = range(e0, e0 + GRIND_EPOCHS)
    floor = {e: min((leader_rank(cfg.swarm.run_id, p, e) for p in others), default=b"\xff" * 16) for e in epochs}
    best, best_n = PeerIdentity.generate(), -1
    for _ in range(GRIND_KEYS):
        key = PeerIdentity.generate()
        n = next((i for i, e in enumerate(epochs) if leader_rank(cfg.swarm.run_id, key.peer_id, e) >= floor[e]),
                 len(epochs))
        if n > best_n:
            best, best_n = key, n
            if n == len(epochs):
                break
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(best.to_protobuf())
    logger.warning("HOSTILE grinder: id %s ranks first among %d peers in epochs %d..%d", best.peer_id[-8:],
                   len(others) + 1, e0, e0 + best_n - 1)


def _sibling_ids(path: Path, expected: int) -> set[str]:
    """The peer ids in the identity files of the other peer folders beside `path`'s, once `expected` of them are
    there, or none more came for 5 s (another grinder writes its own only after this wait), or `SIBLINGS_WAIT_S`
    passed."""
    start = changed = time.monotonic()
    ids: set[str] = set()
    while True:
        found = set()
        for other in path.parent.parent.glob(f"*/{path.name}"):
            if other.parent != path.parent:
                with contextlib.suppress(OSError, IdentityError):
                    found.add(PeerIdentity.from_protobuf(other.read_bytes()).peer_id)
        now = time.monotonic()
        if found != ids:
            ids, changed = found, now
        if len(ids) >= expected or (ids and now - changed > 5.0) or now - start > SIBLINGS_WAIT_S:
            return ids
        time.sleep(0.2)


class InsiderTasks:
    """The pinner's or the flooder's background work against every live peer, on the merger's loop.

    Args:
        merger: this peer's `P2PMerger` (its DHT, run id, swarm key and p2p client are used).
        kind: `pinner` or `flood`.
    """

    def __init__(self, merger, kind: str):
        self.merger, self.kind, self.stopped = merger, kind, False
        self.sent = 0
        self._held: list[asyncio.StreamWriter] = []
        self._future = merger._loop.submit(self._run())

    async def _run(self) -> None:
        rpc, me = self.merger.rpc, self.merger.peer_id
        attacked: dict[str, list[asyncio.Task]] = {}
        while not self.stopped:
            with contextlib.suppress(Exception):
                peers = await registered_now(self.merger.dht, self.merger.cfg.swarm.run_id,
                                             epoch_s=self.merger.cfg.merge.epoch_s)
                for peer in peers - {me} - set(attacked):
                    n = 1 if self.kind == "pinner" else FLOOD_STREAMS
                    attacked[peer] = [asyncio.create_task(self._attack(rpc, peer)) for _ in range(n)]
            await asyncio.sleep(2.0)
        for tasks in attacked.values():
            for t in tasks:
                t.cancel()
        for writer in self._held:
            writer.close()

    async def _attack(self, rpc, peer: str) -> None:
        """Pin `peer`'s state slots, or flood it with `ready` requests, until stopped."""
        me = self.merger.peer_id
        op = "state" if self.kind == "pinner" else "ready"
        while not self.stopped:
            answered = False
            try:
                _, reader, writer = await rpc._p2p.call_binary_stream_handler(PeerID.from_base58(peer), rpc.proto(op))
                header = {"auth": rpc.auth.tag(op, me, peer)} | ({} if op == "state" else {"looking": False})
                await send_msg(writer, header)
                self.sent += 1
                if self.kind == "pinner":
                    self._held = [w for w in self._held[-63:] if not w.is_closing()] + [writer]  # never read
                else:
                    answered = bool(await asyncio.wait_for(reader.read(1), 10))
                    writer.close()
            except Exception:  # noqa: S110 - refused or reset: ask again, as an attacker would
                pass
            await asyncio.sleep(PIN_EVERY_S if self.kind == "pinner" else 0.0 if answered else 0.5)

    def close(self) -> None:
        self.stopped = True
        with contextlib.suppress(Exception):
            self._future.result(5)
