"""Who takes part in matchmaking in an epoch: one small owner-signed DHT record per peer and epoch.

A peer registers for the current epoch and the next one (so that at an epoch's start its census already holds
everyone who was around during the last), reads an epoch's census once (from its key's nearest node when that
copy looks whole, see `Census.members`), and reads it again, by a walk, only when a peer it has not seen announces
itself (rate-limited). Matchmaking's groups of an epoch are dealt from its census
(`my_group`), and readiness travels peer to peer within a group: a peer's DHT work per epoch is a store and a
read or two, whatever the swarm's size, where it used to read every peer's records every 0.25 s while looking
for a group (issue 17: 211 kB/s of DHT traffic sent and received per peer at 8 peers, 64 kB/s with the census).

**Pools.** A census read moves every record in it, so reading the whole census made a peer's DHT bytes grow with
the swarm (issue 17: census reads were most of a peer's 2.2 kB/s at 32 peers, 3.6 times their bytes at 4). Above
twice `group_size` peers, a peer reads only its *pool*: the peers whose `leader_rank` in the epoch begins with the
same `level` bits (`pool_of`), 2^level pools of `group_size` to twice that on average (`level_for`), each under a
key of its own, and its groups are dealt from its pool alone. Pools are drawn anew every epoch, as groups are, so
what a pool learned reaches the others within a few epochs. Every peer also registers at level 0, and reads the
whole census at its first search and in every `SYNC_EPOCHS`-th epoch (the same epochs for all): groups of those
epochs are dealt from the whole census, and its size sets the level up to the next such epoch, the same for every
peer that read the same census. A level decided by each peer from its own pools' sizes left peers that started at
different times at different levels for good, each level's peers unseen by the others' pools: 13 % of a 32-peer
run's merges were alone, against 7 % without pools (docs/benchmarks.md, Scale). A peer that moved stays registered
at the level it left for one epoch, so that mates whose read of the census differed still meet it. A joiner, whose
first read is of the whole census, may expect other groups than its pool's mates until the next epoch; as with any
two views that differ, that costs at most a smaller group (an invite from any leader is accepted). A peer alone
in its pool (a rare draw, or a read that found nothing) reads again a second later, and if still alone deals from its
share of the pool above it (read from the whole census). A run's last merge takes the whole pool, not the whole swarm.

How a census record is kept honest: its subkey is the peer's id, so only that peer can write it
(`PeerRecordValidator`); it carries nothing a reader trusts but its existence.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import random
import time
from collections.abc import Callable

import hivemind
from hivemind.utils.timed_storage import get_dht_time

from p2pdiloco.network.swarm import read_near_subkeys, read_subkeys, write_subkey

EPOCH_S = 30.0
"""Groups and leaders are drawn anew every this many seconds of DHT time."""

REREAD_S = 1.0
"""A census is read again at most this often, and only after an unknown peer announced itself (or when this peer
seems to be alone: see `settled`)."""


MAX_LEVEL = 20
"""Pools are at most 2^20 (a million peers in pools of eight)."""
SYNC_EPOCHS = 8
"""Every this many epochs (epochs whose number it divides) every peer reads the whole census: its groups of that
epoch are dealt from it, and its size sets the level of the epochs up to the next such epoch, the same for all."""


def epoch_of(now: float) -> int:
    return int(now // EPOCH_S)


def leader_rank(run_id: str, peer: str, epoch: int) -> bytes:
    """A peer's place in the order of `epoch`: groups are dealt in it and the first ready mate leads.

    A hash of (run id, peer id, epoch), so the order changes every epoch and nobody can choose an id that leads
    every group (issue 18: with `min(ready)`, an id generated to sort first led every group it was in, and
    by never inviting stopped all merging). Every peer computes the same order from the same census;
    two peers whose clocks straddle an epoch's end may disagree for one search, which costs at most that
    search (an invite from either is accepted).
    """
    return hashlib.blake2b(f"{run_id}\x00{peer}\x00{epoch}".encode(), digest_size=16).digest()


def my_group(run_id: str, me: str, members: list[str], epoch: int, group_size: int) -> list[str]:
    """The mates `me` is dealt in `epoch`, in leader order: at most `group_size` of the epoch's census `members`.

    The members, ordered by `leader_rank`, are dealt round-robin into the fewest groups of at most `group_size`:
    groups differ in size by one at most. Every peer that read the same census computes the same groups, and
    the order is redrawn every epoch, so groups change and what one group learned reaches the others within
    a few epochs (Moshpit SGD's changing groups, dealt by hash rather than on a grid: a grid needs the swarm's
    exact size). Peers whose views differ (a record still on its way) may expect different groups; an invite
    from any leader is accepted and no leader invites more than its own group, so that costs at most a
    smaller group.
    """
    order = sorted(set(members) | {me}, key=lambda p: leader_rank(run_id, p, epoch))
    n_groups = -(-len(order) // group_size)
    return order[order.index(me) % n_groups::n_groups]


def registration_expiry(epoch: int, now: float) -> float:
    """When a registration for `epoch` made at DHT time `now` expires: one epoch past the epoch's end (a search
    that began in it may still read it), plus a millisecond per second since the epoch before it began.

    The DHT keeps, per subkey, the record that expires last and refuses an equal one, so a later registration
    must expire later: a peer restarted under the same id (issue 14) re-registers for epochs its killed process
    had registered for, and with equal expirations it was refused and waited out two epochs unmatched (120 s
    sync merges alone in `bench churn`). Registrations for an epoch happen within the two epochs before its end,
    so the extra is under 0.06 s and grows with `now`."""
    return (epoch + 2) * EPOCH_S + max(0.0, now - (epoch - 1) * EPOCH_S) * 1e-3


def census_key(run_id: str, epoch: int, level: int = 0, pool: int = 0) -> str:
    """The DHT key of an epoch's census (level 0) or of one of its pools (level >= 1, `pool_of`)."""
    return f"{run_id}_census_{epoch}" if level == 0 else f"{run_id}_census_{epoch}_{level}_{pool}"


def pool_of(run_id: str, peer: str, epoch: int, level: int) -> int:
    """The pool `peer` is in at `level` in `epoch`: the first `level` bits of its `leader_rank`, so that pools are
    drawn anew every epoch and the pool at level L is split in two at level L + 1."""
    return int.from_bytes(leader_rank(run_id, peer, epoch)[:4], "big") >> (32 - level) if level > 0 else 0


def level_for(swarm_size: float, group_size: int) -> int:
    """The level whose 2^level pools hold `group_size` to twice that many peers each on average: 0 (the whole
    census, one pool) below twice `group_size` peers."""
    if swarm_size < 2 * group_size:
        return 0
    return min(MAX_LEVEL, math.floor(math.log2(swarm_size / group_size)))


async def registered_now(dht: hivemind.DHT, run_id: str, timeout: float = 5.0) -> set[str]:
    """The peers registered for the current epoch, as one read of its census (a small key: one short record a
    peer). `wait_for_peers` polls this before training starts, where it used to read every shard of the
    heartbeat records every 0.2 s: in `bench scale` at 16 peers that start-up poll was 44 % of a peer's DHT
    bytes (issue 17)."""
    return set(await read_subkeys(dht, census_key(run_id, epoch_of(get_dht_time())), timeout))


class Census:
    """This peer's registrations and its views of recent epochs' censuses.

    Args:
        dht: this peer's running DHT.
        run_id: the swarm's run id.
        peer_id: this peer's id (it is in every view of an epoch it registered for).
        group_size: the swarm's `group_size`, which sets the size of a pool (`level_for`).
    """

    def __init__(self, dht: hivemind.DHT, run_id: str, peer_id: str, group_size: int = 8):
        self.dht, self.run_id, self.peer_id, self.group_size = dht, run_id, peer_id, group_size
        self._registered: dict[int, dict[int, float]] = {}
        """Epoch -> {level this peer is in the census of at it -> when it registered (monotonic)}."""
        self._views: dict[int, tuple[float, frozenset[str]]] = {}
        self._view_level: dict[int, int] = {}
        """Epoch -> the level its view was read at (fixed by the epoch's first read)."""
        self._stale: set[int] = set()
        self._outsiders: dict[int, set[str]] = {}
        """Epoch -> peers that announced themselves but were not in the pool when it was read again: not read for
        again (a peer whose level differs, or who joined late, is met in the next epoch)."""
        self._asked: dict[int, set[str]] = {}
        """Epoch -> peers that announced themselves and are not in its view: the reason it is read again."""
        self.reads = self.writes = self.walks = 0
        """DHT requests made (`walks`: reads that walked), for tests and benchmarks (they must not grow with the
        swarm)."""
        self._last_size = 0
        """Peers in the last view read at level 0 (this one included); 0 before the first."""
        self.level = 0
        """The level whose pools this peer reads from the next epoch on (0: the whole census)."""
        self._moved_from: int | None = None
        """The level this peer left at its last move: it stays registered there one epoch more."""
        self.fresh = True
        """No census read yet: the first read is of the whole census (level 0), which tells the swarm's size."""

    def counts(self) -> dict[str, int]:
        """DHT requests made and the level reached, for a peer's summary."""
        return {"reads": self.reads, "walks": self.walks, "writes": self.writes, "level": self.level}

    def levels(self) -> set[int]:
        """The levels this peer registers at for the next epoch: 0 (read by a joiner and by `registered_now`), its
        own, and the one it just left (peers that have not moved yet still read it)."""
        return {0, self.level} | ({self._moved_from} if self._moved_from is not None else set())

    async def register(self, epoch: int) -> None:
        """Be in the census of `epoch` and of the next one, at each of `levels()` (a DHT store for each epoch and
        level not yet registered)."""
        for e in (epoch, epoch + 1):
            await self._register_for(e)
        self._registered = {e: d for e, d in self._registered.items() if e >= epoch}

    async def _register_for(self, epoch: int) -> None:
        done = self._registered.setdefault(epoch, {})
        for level in sorted(self.levels() - set(done)):
            self.writes += 1
            key = census_key(self.run_id, epoch, level, pool_of(self.run_id, self.peer_id, epoch, level))
            if await write_subkey(self.dht, key, self.peer_id, {"t": get_dht_time()},
                                  registration_expiry(epoch, get_dht_time())):
                done[level] = time.monotonic()

    async def keep_registered(self, closed: Callable[[], bool]) -> None:
        """Register for every epoch while this peer runs, searching or not: a peer whose round is longer than an
        epoch, or that has not searched yet, is still dealt into groups and waited for (a store or two an epoch)."""
        while not closed():
            now = get_dht_time()
            await self.register(epoch_of(now))
            await asyncio.sleep(EPOCH_S - now % EPOCH_S + random.uniform(0.0, 1.0))

    async def members(self, epoch: int) -> frozenset[str]:
        """The peers in this peer's pool of `epoch` (the whole census at level 0), this one included, as last read."""
        view = self._views.get(epoch)
        # a view of this peer alone may be a read that timed out: it is never trusted for long
        if view is None or ((epoch in self._stale or len(view[1]) == 1) and time.monotonic() - view[0] >= REREAD_S):
            level = self._view_level.setdefault(epoch, 0 if self.fresh or epoch % SYNC_EPOCHS == 0 else self.level)
            records = await self._read(epoch, level, first=view is None)
            if level > 0 and len(records) < 2 and view is not None:
                # alone in its pool a second time (a rare draw): its share of the pool above, from the whole census
                parent = pool_of(self.run_id, self.peer_id, epoch, level - 1)
                records = {p for p in await self._read(epoch, 0, first=False)
                           if pool_of(self.run_id, p, epoch, level - 1) == parent} | {self.peer_id}
            if view is not None:  # read again because peers announced themselves: those still missing are in
                asked = self._asked.pop(epoch, set())  # another pool, or joined late: not read for again
                self._outsiders.setdefault(epoch, set()).update(asked - records)
            self._views = {e: v for e, v in self._views.items() if e >= epoch - 1}
            self._view_level = {e: v for e, v in self._view_level.items() if e >= epoch - 1}
            self._outsiders = {e: v for e, v in self._outsiders.items() if e >= epoch - 1}
            self._views[epoch] = (time.monotonic(), frozenset(records))
            self._stale.discard(epoch)
            if view is None:
                await self._choose_level(epoch, level, len(records))
        return self._views[epoch][1]

    async def _read(self, epoch: int, level: int, first: bool) -> set[str]:
        self.reads += 1
        key, records = census_key(self.run_id, epoch, level, pool_of(self.run_id, self.peer_id, epoch, level)), None
        if first and (level > 0 or self._last_size > 1):
            near = set(await read_near_subkeys(self.dht, key))
            if self._whole(near, epoch, level):
                records = near | {self.peer_id}
        if records is None:
            self.walks += 1
            records = set(await read_subkeys(self.dht, key)) | {self.peer_id}
        if level == 0:
            self._last_size = len(records)
        return records

    async def _choose_level(self, epoch: int, level: int, size: int) -> None:
        """After an epoch's first read: if it was of the whole census, the level to read from the next epoch on
        (registered at at once, so that the next epoch's pool holds this peer when its mates read it)."""
        self._moved_from = None
        if level > 0:
            return
        self.fresh, new = False, level_for(size, self.group_size)
        if new != self.level:
            self._moved_from, self.level = self.level, new
            await self._register_for(epoch + 1)

    def _whole(self, near: set[str], epoch: int, level: int) -> bool:
        """Whether a census read from its key's nearest node alone may stand for the walk's merged read: it holds
        this peer's own registration (when there is one) and, at level 0, at least as many peers as the last view;
        in a pool, at least half the pool's expected size (pools are drawn anew every epoch, so their sizes vary).

        An epoch's first read takes one node's copy of the census (`swarm.read_near_subkeys`), a third of a walk's
        bytes (the walk merges the whole copy of each of the ~3 nodes holding it): at 32 peers census reads were
        half of a peer's DHT bytes (issue 17). One node's copy may lack registrations that a writer, its routing
        table still filling, stored elsewhere: reading only that node once kept three of a run's four peers from
        seeing the others for 22 s, and the run ended apart (the README's run, since reverted). So the first read
        of all, any copy smaller than that, any copy without this peer, and every re-read (an unknown peer
        announced itself, or the view was read too soon after registering) walk."""
        if level in self._registered.get(epoch, {}) and self.peer_id not in near:
            return False
        if level == 0:
            return len(near | {self.peer_id}) >= self._last_size
        return len(near | {self.peer_id}) >= max(2.0, self._last_size / 2 ** level / 2)

    def settled(self, epoch: int) -> bool:
        """Whether this peer's view of `epoch` was read at least `REREAD_S` after it registered for it (at the
        view's level), so that peers who registered at about the same time are in it; if not, it is read again
        when allowed."""
        view = self._views.get(epoch)
        registered = self._registered.get(epoch, {}).get(self._view_level.get(epoch, self.level))
        if view is not None and registered is not None and view[0] - registered >= REREAD_S:
            return True
        self._stale.add(epoch)
        return False

    def saw(self, peer: str, epoch: int) -> None:
        """`peer` announced itself in `epoch`: if this peer's view of that epoch lacks it, read the census again
        (once per such peer: one still missing after that is in another pool, see `_outsiders`)."""
        view = self._views.get(epoch)
        if view is not None and peer not in view[1] and peer not in self._outsiders.get(epoch, ()):
            self._stale.add(epoch)
            self._asked.setdefault(epoch, set()).add(peer)
