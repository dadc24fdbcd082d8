"""Who takes part in matchmaking in an epoch: one small owner-signed DHT record per peer, renewed every epoch.

A peer registers for the current epoch and the next one (so that at an epoch's start its census already holds
everyone who was around during the last) with one record under the swarm's census key, which names the next epoch
and stands for both (`in_epoch`); every epoch it writes it again for the epoch after: one store an epoch, to a
key whose nearest nodes `dht_store` keeps in its cache (a key per epoch took two stores an epoch, each to a new
key). It reads an epoch's census once (from its key's nearest node when that copy looks whole, see
`Census.members`), and reads it again, by a walk, only when a peer it has not seen announces itself
(rate-limited). Matchmaking's groups of an epoch are dealt from its census (`my_group`), and readiness travels
peer to peer within a group: a peer's DHT work per epoch is a store and a read or two, whatever the swarm's size
(a read's bytes do grow with it), instead of reading every peer's records while looking for a group
(docs/benchmarks.md, Scale and DHT, has the bytes).

How a census record is kept honest: its subkey is the peer's id, so only that peer can write it
(`PeerRecordValidator`); it carries nothing a reader trusts but its existence and its commitments.

Commitments: a record for epoch e+1, written in epoch e, carries `commit`, a hash of this peer's secret nonce for
e+1, and `prev`, the one for e if the peer's record before it already carried it. In an epoch a peer tells its
ready mates its nonce (matchmaking's ready word), and the leader among them is drawn from the nonces together
(leaders.py): nobody knows them all before the epoch's reveals, so no id can be ground to lead. A reader keeps
the first commitment it saw for a peer and epoch, and none it first sees after it revealed its own nonce for that
epoch: a commitment made after seeing others' nonces is never counted.
"""

from __future__ import annotations

import asyncio
import hashlib
import random
import secrets
import time
from collections.abc import Callable
from pathlib import Path

import hivemind
from hivemind.utils.timed_storage import get_dht_time

from p2pdiloco.network.swarm import read_near_subkeys, read_subkeys, write_subkey

EPOCH_S = 30.0
"""Groups and leaders are drawn anew every this many seconds of DHT time, by default (`merge.epoch_s`)."""

REREAD_S = 1.0
"""A census is read again at most this often, and only after an unknown peer announced itself (or when this peer
seems to be alone: see `settled`)."""


COMMIT_BYTES = 16
"""Length of a nonce and of its commitment: a second preimage or a collision of 128 bits is out of reach."""


def epoch_of(now: float, epoch_s: float = EPOCH_S) -> int:
    return int(now // epoch_s)


def leader_rank(run_id: str, peer: str, epoch: int) -> bytes:
    """A peer's place in the order of `epoch` that groups are dealt in (`my_group`); where no ready mate revealed a
    nonce it committed to (a swarm's first epoch), also the order in which they lead (leaders.py).

    A hash of (run id, peer id, epoch), so the order changes every epoch. It is public: an id can be ground in
    advance to rank first in every epoch of a window which is why who leads is drawn
    from the revealed nonces instead (`lead_rank`). Every peer computes the same order from the same census; a
    search still going at an epoch's end is dealt again in the new order (`Matchmaker.find_group`), so two peers
    disagree only while their clocks straddle the end (an invite from either is accepted).
    """
    return hashlib.blake2b(f"{run_id}\x00{peer}\x00{epoch}".encode(), digest_size=16).digest()


def lead_rank(run_id: str, peer: str, epoch: int, mix: bytes) -> bytes:
    """A ready mate's place in the order of who leads its group in `epoch`: the lowest leads.

    `mix` is the XOR of the nonces that the ready mates revealed (leaders.py): unknown to anyone until the
    last of them is revealed, so an id cannot be ground to rank first, as `leader_rank` alone can (it is public)."""
    return hashlib.blake2b(f"{run_id}\x00{peer}\x00{epoch}\x00".encode() + mix, digest_size=16).digest()


def commitment(nonce: bytes) -> bytes:
    """The hash of `nonce` that a census record carries before the nonce is revealed."""
    return hashlib.blake2b(b"p2pdiloco-commit\x00" + nonce, digest_size=COMMIT_BYTES).digest()


def secret_of(identity_file: Path) -> bytes | None:
    """A census secret (`Census`) that is the same in every process of a peer resumed from `identity_file` (its
    private key, which nobody else holds): a keyed hash of the file; None where it cannot be read."""
    try:
        key = identity_file.read_bytes()
    except OSError:
        return None
    return hashlib.blake2b(key, key=b"p2pdiloco-census-secret", digest_size=COMMIT_BYTES).digest()


def commit_of(value: object, epoch: int) -> bytes | None:
    """The commitment a census record makes for `epoch`: its `commit` if it names that epoch, its `prev` if it
    names the next one; None if it makes none (or a malformed one)."""
    if not isinstance(value, dict):
        return None
    c = value.get("commit") if value.get("epoch") == epoch else value.get("prev") if value.get("epoch") == epoch + 1 \
        else None
    return c if isinstance(c, bytes) and len(c) == COMMIT_BYTES else None


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


def registration_expiry(epoch: int, now: float, epoch_s: float = EPOCH_S) -> float:
    """When a registration for `epoch` made at DHT time `now` expires: one epoch past the epoch's end (a search
    that began in it may still read it), plus a millisecond per second since the epoch before it began.

    The DHT keeps, per subkey, the record that expires last and refuses an equal one, so a later registration
    must expire later: a peer restarted under the same id (`--resume`) re-registers for epochs its killed process
    had registered for, and with equal expirations it would be refused and wait out two epochs unmatched.
    Registrations for an epoch happen within the two epochs before its end, so the extra is under 0.2 % of two
    epochs (0.06 s with 30 s epochs) and grows with `now`. Hours-long epochs (the small and medium presets)
    store registrations hours ahead: checked to store and read back on hivemind 1.1.12 with 4 h to go."""
    return (epoch + 2) * epoch_s + max(0.0, now - (epoch - 1) * epoch_s) * 1e-3


def census_key(run_id: str) -> str:
    """The swarm's census: one key for every epoch, so that a registration usually finds the key's nearest nodes
    in `dht_store`'s cache instead of by a lookup walk. In `bench scale` at 32 peers this halved a peer's census
    stores and left its census bytes where they were (docs/benchmarks.md, Scale): those are mostly what the key's
    holders serve."""
    return f"{run_id}_census"


def in_epoch(value: object, epoch: int) -> bool:
    """Whether a census record says its peer takes part in `epoch`: it registered for that epoch or one of the next
    two (a peer whose clock is a little ahead may be an epoch on). A record for an earlier epoch is a peer that
    stopped registering: it left or was killed. The number is the writer's own claim, bounded so: a record claiming
    a later epoch keeps a peer that left in the census two epochs longer at most, as its expiration does anyway."""
    registered = value.get("epoch") if isinstance(value, dict) else None
    return isinstance(registered, int) and epoch <= registered <= epoch + 2


def census_of(records: dict[str, object], epoch: int) -> set[str]:
    """The peers of `records` (a read of the census key) that take part in `epoch`."""
    return {peer for peer, value in records.items() if in_epoch(value, epoch)}


async def registered_now(dht: hivemind.DHT, run_id: str, timeout: float = 5.0, epoch_s: float = EPOCH_S,
                         near: bool = False, epoch: int | None = None) -> set[str]:
    """The peers registered for the current epoch, as one read of its census (a small key: one short record a
    peer). `wait_for_peers` polls this before training starts instead of every shard of the heartbeat records,
    which would be most of a peer's start-up DHT bytes in a large swarm.

    Args:
        near: read the copy of the key's nearest node only (`swarm.read_near_subkeys`, a third of a walk's bytes),
            which may lack registrations stored elsewhere: for a peer looking for its own registration, which it
            stored on those very nodes (`dht_store`), or for a count that a short copy sends to a walk
            (`together.wait_for_peers`).
        epoch: the epoch whose peers are wanted (None: the current one when the read ends)."""
    records = await read_census(dht, run_id, timeout, near)
    return census_of(records, epoch_of(get_dht_time(), epoch_s) if epoch is None else epoch)


async def read_census(dht: hivemind.DHT, run_id: str, timeout: float = 5.0, near: bool = False) -> dict[str, object]:
    """The census key's records, by a walk or (`near`) from its nearest node's copy (see `registered_now`)."""
    return await (read_near_subkeys if near else read_subkeys)(dht, census_key(run_id), timeout)


class Census:
    """This peer's registrations and its views of recent epochs' censuses.

    Args:
        dht: this peer's running DHT.
        run_id: the swarm's run id.
        peer_id: this peer's id (it is in every view of an epoch it registered for).
        epoch_s: seconds of DHT time an epoch lasts (`merge.epoch_s`, the same on every peer of a swarm).
        secret: the key of this peer's nonces (`nonce`); None: drawn now. A peer resumed under its id must keep it:
            its mates hold the commitments its last process stored, and a resumed peer with new nonces ranked
            itself by a nonce nobody else could check, leading beside the leader its mates followed all epoch.
    """

    def __init__(self, dht: hivemind.DHT, run_id: str, peer_id: str, epoch_s: float = EPOCH_S,
                 secret: bytes | None = None):
        self.dht, self.run_id, self.peer_id, self.epoch_s = dht, run_id, peer_id, epoch_s
        self._registered: dict[int, float] = {}
        """Epochs this peer is in the census of -> when it registered (monotonic)."""
        self._views: dict[int, tuple[float, frozenset[str]]] = {}
        self._stale: set[int] = set()
        self.reads = self.writes = self.walks = 0
        """DHT requests made (`walks`: reads that walked), for tests and benchmarks (they must not grow with the
        swarm)."""
        self._last_size = 0
        """Peers in the last view read (this one included); 0 before the first."""
        self._secret = secrets.token_bytes(COMMIT_BYTES) if secret is None else secret
        self._ahead: set[int] = set()
        """Epochs whose commitment this peer stored in the epoch before: only their nonces are revealed."""
        self._commits: dict[int, dict[str, bytes]] = {}
        """Epoch -> peer -> the first commitment this peer read for it (its own included)."""
        self._revealed: set[int] = set()
        """Epochs whose nonce this peer revealed: commitments read after that are not counted."""

    async def register(self, epoch: int) -> None:
        """Be in the census of `epoch` and of the next one: one DHT store, of a record for the next epoch (which
        stands for this one too: `in_epoch`), unless this peer already registered for it."""
        if epoch + 1 not in self._registered:
            self.writes += 1
            now = get_dht_time()
            record = {"epoch": epoch + 1, "commit": commitment(self.nonce(epoch + 1)),
                      **({"prev": commitment(self.nonce(epoch))} if epoch in self._ahead else {})}
            if await write_subkey(self.dht, census_key(self.run_id), self.peer_id, record,
                                  registration_expiry(epoch + 1, now, self.epoch_s)):
                t = time.monotonic()
                self._registered.setdefault(epoch, t)
                self._registered[epoch + 1] = t
                self._ahead.add(epoch + 1)
        self._registered = {e: t for e, t in self._registered.items() if e >= epoch}
        self._ahead = {e for e in self._ahead if e >= epoch}

    def nonce(self, epoch: int) -> bytes:
        """This peer's secret nonce for `epoch` (a keyed hash of its secret, `secret_of` its identity file: nothing
        to store, and the same in a process resumed under its id)."""
        return hashlib.blake2b(str(epoch).encode(), key=self._secret, digest_size=COMMIT_BYTES).digest()

    def reveal(self, epoch: int) -> bytes | None:
        """This peer's nonce for `epoch`, to tell its ready mates, if it committed to it in the epoch before (a peer
        in its first epoch reveals none: a commitment stored in the epoch it counts for proves nothing); from now
        on, commitments for `epoch` read for the first time are not counted (`commit`)."""
        self._revealed.add(epoch)
        self._revealed = {e for e in self._revealed if e >= epoch - 1}
        return self.nonce(epoch) if epoch in self._ahead else None

    def commit(self, peer: str, epoch: int) -> bytes | None:
        """The commitment for `epoch` that this peer counts for `peer`: the first it read, if it read it before it
        revealed its own nonce for that epoch; this peer's own if it committed ahead."""
        if peer == self.peer_id:
            return commitment(self.nonce(epoch)) if epoch in self._ahead else None
        return self._commits.get(epoch, {}).get(peer)

    def _note_commits(self, records: dict[str, object], epoch: int) -> None:
        """Keep the first commitments `records` (a read of the census) make for `epoch` and the next, except for an
        epoch whose nonce this peer already revealed."""
        self._commits = {e: c for e, c in self._commits.items() if e >= epoch - 1}
        for e in (epoch, epoch + 1):
            if e in self._revealed:
                continue
            seen = self._commits.setdefault(e, {})
            for peer, value in records.items():
                if peer not in seen and (c := commit_of(value, e)) is not None:
                    seen[peer] = c

    def expect(self, size: int, epoch: int | None = None, records: dict[str, object] | None = None) -> None:
        """A read made elsewhere (`together.wait_for_peers`: a walk, or one node's copy that held every awaited peer)
        counted `size` peers in the census, this one included: the first read of an epoch may then take one node's
        copy when that copy holds as many (`_whole`), instead of walking again (a walk costs a few times one node's
        copy: docs/benchmarks.md, Scale, start-up DHT bytes).

        Args:
            epoch, records: the epoch that read was of, and the records it read: this peer's view of that epoch
                (and the commitments they make), if it has none yet, so that its first search there reads nothing
                (the read that let the peers start together and the first search's were one after the other)."""
        self._last_size = max(self._last_size, size)
        if epoch is not None and records is not None and epoch not in self._views:
            self._note_commits(records, epoch)
            self._views[epoch] = (time.monotonic(), frozenset(census_of(records, epoch) | {self.peer_id}))

    def stored(self, epoch: int) -> bool:
        """Whether this peer's registration for `epoch` was stored (on one of the census key's nearest nodes at
        least, where every near read of it asks first)."""
        return epoch in self._registered

    def counts(self) -> dict[str, int]:
        """DHT requests made, for a peer's summary."""
        return {"reads": self.reads, "walks": self.walks, "writes": self.writes}

    async def keep_registered(self, closed: Callable[[], bool]) -> None:
        """Register for every epoch while this peer runs, searching or not: a peer whose round is longer than an
        epoch, or that has not searched yet, is still dealt into groups and waited for (one store an epoch)."""
        while not closed():
            now = get_dht_time()
            await self.register(epoch_of(now, self.epoch_s))
            await asyncio.sleep(self.epoch_s - now % self.epoch_s + random.uniform(0.0, 1.0))

    async def members(self, epoch: int) -> frozenset[str]:
        """The peers registered for `epoch`, this one included, as last read."""
        view = self._views.get(epoch)
        # a view of this peer alone may be a read that timed out: it is never trusted for long
        if view is None or ((epoch in self._stale or len(view[1]) == 1) and time.monotonic() - view[0] >= REREAD_S):
            self.reads += 1
            key, records = census_key(self.run_id), None
            if view is None and self._last_size > 1:
                raw = await read_near_subkeys(self.dht, key)
                near = census_of(raw, epoch)
                if self._whole(near, epoch):
                    records = near | {self.peer_id}
                    self._note_commits(raw, epoch)
            if records is None:
                self.walks += 1
                raw = await read_subkeys(self.dht, key)
                records = census_of(raw, epoch) | {self.peer_id}
                self._note_commits(raw, epoch)
            self._last_size = len(records)
            self._views = {e: v for e, v in self._views.items() if e >= epoch - 1}
            self._views[epoch] = (time.monotonic(), frozenset(records))
            self._stale = {e for e in self._stale if e >= epoch - 1 and e != epoch}  # an epoch without a view is read
        return self._views[epoch][1]

    def _whole(self, near: set[str], epoch: int) -> bool:
        """Whether a census read from its key's nearest node alone may stand for the walk's merged read: it holds
        this peer's own registration (when there is one) and at least as many peers as the last view.

        An epoch's first read takes one node's copy of the census (`swarm.read_near_subkeys`), a third of a walk's
        bytes (the walk merges the whole copy of each of the ~3 nodes holding it), and census reads are much of a
        large swarm's DHT bytes. One node's copy may lack registrations that a writer, its routing table still
        filling, stored elsewhere: peers that read only that node can miss each other for many seconds at
        start-up and end apart (docs/experiments.md, "The census read from one node"). So the first read
        of all, any copy smaller than the last view, any copy without this peer, and every re-read (an unknown peer
        announced itself, or the view was read too soon after registering) walk."""
        return (epoch not in self._registered or self.peer_id in near) and len(near | {self.peer_id}) >= self._last_size

    @property
    def size(self) -> int:
        """How many peers (this one included) the last census read held; 0 before any read."""
        return self._last_size

    def settled(self, epoch: int) -> bool:
        """Whether this peer's view of `epoch` was read at least `REREAD_S` after it registered for it, so that
        peers who registered at about the same time are in it; if not, it is read again when allowed."""
        view, registered = self._views.get(epoch), self._registered.get(epoch)
        if view is not None and registered is not None and view[0] - registered >= REREAD_S:
            return True
        self._stale.add(epoch)
        return False

    def saw(self, peer: str, epoch: int) -> None:
        """`peer` announced itself in `epoch`: if this peer's view of that epoch lacks it, read the census again."""
        view = self._views.get(epoch)
        if view is not None and peer not in view[1]:
            self._stale.add(epoch)
