"""Peers started together wait for each other before their first inner step (`startup.wait_for_peers`), so that
their first rounds merge as a group."""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from pathlib import Path

from hivemind.utils.timed_storage import get_dht_time

from p2pdiloco.config import Config
from p2pdiloco.network.census import Census, census_of, epoch_of, read_census
from p2pdiloco.network.peer_tag import short_id
from p2pdiloco.network.swarm import BackgroundLoop

logger = logging.getLogger(__name__)


def wait_for_peers(loop: BackgroundLoop, dht, cfg: Config, peer_id: str, stop: Callable[[], bool],
                   barrier: Path | None = None, census: Census | None = None) -> int:
    """Block until `startup.wait_for_peers` peers (this one included) are in matchmaking's census (or the wait
    times out); returns how many are. Every peer's merger registers it there when it starts.

    With `barrier` (a folder `local` gives all its peers), a peer that is in the census (its `census` stored its
    registration, or a read found it) says so there with an empty file named by its id, and then waits for the
    others' files instead of reading the census:
    listing a folder costs no DHT bytes, where each census read carries every peer's record. One census read once
    every file is there gives the count, and the polling goes on if it is short.

    With `barrier`, census reads take one node's copy of the census (one of the nodes this peer's registration
    was stored on, `swarm.read_near_subkeys`): without `census`, the first read, looking for this peer's own
    registration (if that copy lacks it, the next reads walk, until it is found), and the count once every file is
    there (if that copy holds fewer peers than the folder, a walk counts). A count from a walk, or a copy that holds
    every awaited peer, is handed to `census` (this peer's matchmaking census, `Census.expect`) with the peers it
    found: its view of the epoch, so that its first search there reads nothing.
    """
    want, deadline = cfg.startup.wait_for_peers, time.monotonic() + cfg.startup.wait_for_peers_s
    pause, told, reads = 0.25, False, 0
    while True:
        if told and not stop() and time.monotonic() <= deadline and _files_in(barrier) < want:
            time.sleep(0.1)  # a listing of a local folder, not a DHT read
            continue
        epoch = epoch_of(get_dht_time(), cfg.merge.epoch_s)
        if barrier is not None and not told and census is not None and census.stored(epoch):
            told = _tell(barrier, peer_id)  # stored where every near read of the census asks first: no read needed
            if told:
                continue
            barrier = None
        near = barrier is not None and (reads == 0 or told)
        reads += 1
        records = loop.run(read_census(dht, cfg.swarm.run_id, near=near), timeout=30)
        registered = census_of(records, epoch)
        if near and told and len(registered | {peer_id}) < want:  # that copy is short of the folder: walk
            near = False
            records = loop.run(read_census(dht, cfg.swarm.run_id), timeout=30)
            registered = census_of(records, epoch)
        if census is not None and (not near or len(registered | {peer_id}) >= want):
            census.expect(len(registered | {peer_id}), epoch, records)
        if barrier is not None and not told and peer_id in registered:
            told = _tell(barrier, peer_id)
            barrier = barrier if told else None
        live = len(registered | {peer_id})
        # with a folder, not before this peer's own file is there: the others wait for it (a copy that held every
        # other peer, but not this one's registration still on its way, let it start alone while 31 peers waited
        # out `wait_for_peers_s` for its file, in `bench scale` at 32 peers)
        if (live >= want and (barrier is None or told)) or stop() or time.monotonic() > deadline:
            return live
        # polling the census (one DHT key, whose read grows with the swarm), with a deadline: every peer waits for
        # the last. Polled every 0.25 s, 32 peers starting over ~35 s on 2 cores (bench scale) spent 41 % of their
        # DHT bytes before their first merge, while this poll was all a waiting peer read; backing off to 1 s costs
        # a start at most 1 s after the last peer's; with 1 s, it was still half of them (hence the barrier)
        time.sleep(pause)
        pause = min(1.0, pause * 1.5)


def _tell(barrier: Path, peer_id: str) -> bool:
    """Say in `barrier` that this peer is in the census; False if the folder is gone (its run folder removed): the
    census alone decides, as without one."""
    try:
        (barrier / peer_id).touch()
        return True
    except OSError as e:
        logger.warning("[%s] cannot write to %s (%s): waiting on the census alone", short_id(peer_id), barrier, e)
        return False


def _files_in(folder: Path) -> int:
    """How many entries `folder` holds; a folder that is gone holds as many as can be awaited (the census decides)."""
    try:
        return sum(1 for _ in folder.iterdir())
    except OSError:
        return sys.maxsize
