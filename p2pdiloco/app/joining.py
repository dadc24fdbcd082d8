"""Where a starting peer's state comes from: its newest checkpoint (--resume), then the swarm's state if live
peers are ahead of it."""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Callable
from pathlib import Path

import torch
from hivemind.utils.timed_storage import get_dht_time

from p2pdiloco.app.heartbeat import swarm_finished
from p2pdiloco.app.startup import say
from p2pdiloco.config import Config
from p2pdiloco.network.peer_records import PeerSample
from p2pdiloco.network.peer_tag import short_id
from p2pdiloco.network.state_sync import BUSY_WAIT_S, StateSync
from p2pdiloco.network.swarm import BackgroundLoop, live_records, read_peers
from p2pdiloco.training.batches import BatchSampler
from p2pdiloco.training.checkpoint import load_latest
from p2pdiloco.training.evaluation import state_check
from p2pdiloco.training.learner import Learner
from p2pdiloco.training.reporting import MetricsLog

logger = logging.getLogger(__name__)


def resume_from_checkpoint(learner: Learner, sampler: BatchSampler, remember_trust: Callable[[object], None],
                           folder: Path, announce) -> None:
    """Continue from the newest checkpoint: its state, the data order where this peer's tokens left it, and what
    its guards had learned of the others (kept under the same peer id, see `IDENTITY_FILE`)."""
    found = load_latest(folder)
    if found is None:
        announce(f"--resume: no usable checkpoint in {folder}; starting fresh")
        return
    tensors, meta, path = found
    learner.restore(tensors, meta)
    remember_trust(meta.get("guard_trust"))
    # a unit's tokens count all its ranks' batches; rank 0 skips its own share (followers replay theirs)
    sampler.skip(learner.c.tokens // (sampler.tokens_per_batch * learner.report.data_parallel))
    announce(f"resumed from {path.name}: round {meta['round']}, step {meta['step']}")


def own_check(learner: Learner, sampler: BatchSampler | None, n_batches: int) -> Callable[[torch.Tensor], str | None]:
    """The joiner's own check of a downloaded θg (`state_check`): against its own global model, on `n_batches`
    random windows of its own shard, drawn with a seed from the OS (None `sampler`: no check)."""
    if sampler is None:
        return lambda _params: None
    probe = sampler.probe(n_batches, torch.Generator().manual_seed(secrets.randbits(63)))
    return state_check(learner.model, learner.g.params, probe, learner.device, learner.cfg.run.precision)


def _fresh(records: dict[str, dict], peer_id: str, period: float) -> bool:
    """Whether every other live record of `records` was written within the last heartbeat `period` (its `time`, DHT
    time): then no newer beat of it can be on another node. A record's time is its own claim; one that lies can
    only spare this peer a walk that the other records would still call for."""
    now = get_dht_time()
    return all(isinstance(t := r.get("time"), (int, float)) and now - t <= period
               for p, r in live_records(records).items() if p != peer_id)


def _ahead(records: dict[str, dict], peer_id: str, global_tokens: float) -> dict[str, dict]:
    """The live peers of `records` whose global models absorbed more tokens than `global_tokens`."""
    return {p: r for p, r in live_records(records).items()
            if p != peer_id and float(r.get("global_tokens") or 0) > global_tokens}


def _look(loop: BackgroundLoop, dht, cfg: Config, peer_id: str, every: PeerSample | None,
          global_tokens: float) -> dict[str, dict]:
    """The peer records a starting peer decides by (see `join_swarm_state`): `every` if its copies are fresh,
    else its shards read again by walks; and every shard, by walks, where a sample of some shards shows a peer
    ahead (a joiner picks its donor and checks the state among all live peers) or no live peer at all (whether the
    swarm finished is read from every shard)."""
    if every is None:
        return loop.run(read_peers(dht, cfg.swarm.run_id), timeout=30)
    records = every.records
    if not _fresh(records, peer_id, cfg.swarm.heartbeat_s):
        records = loop.run(read_peers(dht, cfg.swarm.run_id, shards=every.shards), timeout=30)
    alone = not any(p != peer_id for p in live_records(records))
    if not every.whole and (alone or _ahead(records, peer_id, global_tokens)):
        records = loop.run(read_peers(dht, cfg.swarm.run_id), timeout=30)
    return records


def join_swarm_state(learner: Learner, sync: StateSync, loop: BackgroundLoop, dht, cfg: Config, peer_id: str,
                     metrics: MetricsLog, every: PeerSample | None = None,
                     sampler: BatchSampler | None = None) -> None:
    """If live peers' global models have absorbed more tokens than ours, download the freshest one first,
    so that a joiner (or a resumed peer that fell behind) continues the swarm's run instead of pulling it back.

    If no peer is live and one left having finished the run, the run is over: this peer ends at once
    (`Learner.ended_with_swarm`) instead of training on alone.

    A state is taken only if enough live peers hold it (`StateSync.fetch`) and it predicts this peer's own data
    better than this peer's own model does (`own_check`): ids are free, so no count of peers naming a state can
    vouch for it alone.

    Args:
        every: the peer records read at this peer's start (`peer_records.sample_peers`: one node's copy of some
            shards), or None to read them all here. A node's copy is refreshed every few heartbeats
            (`heartbeat.RECORD_BEATS`): unless every other live record in it is from the last heartbeat, those
            shards are read again by walks, which find every copy and the newest, before this peer decides whether
            anyone is ahead (a copy of a swarm's first beats showed nobody ahead of a joiner 12 s into a run, and it
            trained alone from step 0). A sample of some shards stands for the swarm only where it shows live
            peers and none of them ahead (peers starting together); else every shard is read (`_look`).
        sampler: this peer's batches, from which the check's windows are drawn (None: no check)."""
    say("joining the swarm %s: %s its peer records", cfg.swarm.run_id, "reading" if every is None else "checking",
        tag=short_id(peer_id))
    every = _look(loop, dht, cfg, peer_id, every, learner.c.global_tokens)
    finished = swarm_finished(every, peer_id, cfg.run.total_steps)
    if finished is not None:  # training on alone would only move this peer's model away from the swarm's result
        learner.ended_with_swarm = learner.report.arrived_after_end = True
        metrics.write(kind="swarm_finished", peer=finished[0], step=finished[1])
        logger.warning("[%s] the swarm already finished this run (peer %s left at step %d): nothing left to train; "
                       "keeping this peer's model as it is", short_id(peer_id), short_id(finished[0]), finished[1])
        return
    records = live_records(every)
    ahead = _ahead(records, peer_id, learner.c.global_tokens)
    if not ahead:
        return
    say("joining: downloading the swarm's state (%d live peer(s) ahead of this one)", len(ahead), tag=short_id(peer_id))
    t0 = time.monotonic()

    async def refresh() -> dict[str, dict]:
        await asyncio.sleep(cfg.swarm.heartbeat_s)  # a donor's record can lag its last merge by one heartbeat
        return live_records(await read_peers(dht, cfg.swarm.run_id))

    # every live record counts in checking a donor's state, not only those claiming to be ahead
    passes = 3
    # each pass may also wait up to BUSY_WAIT_S for donors that said "busy" and when to come back
    judge = own_check(learner, sampler, cfg.run.eval_batches)
    got = loop.run(sync.fetch(records, peer_id, timeout=cfg.merge.merge_timeout_s, refresh=refresh, passes=passes,
                              judge=judge),
                   timeout=((cfg.merge.merge_timeout_s + cfg.swarm.heartbeat_s + 5) * (len(records) + 1) + BUSY_WAIT_S)
                   * passes + 10)
    if got is None:
        metrics.write(kind="join_refused", refused_states=len(sync.refused))
        logger.warning("[%s] no live peer could give its state; the first merge will bring this peer in line",
                       short_id(peer_id))
        return
    state, donor = got
    learner.adopt_state(state)
    metrics.write(kind="join", donor=donor, round=state.round, step=state.step, refused_states=len(sync.refused),
                  download_s=time.monotonic() - t0, global_digest=learner.g.digest())
    logger.info("[%s] downloaded the swarm's state (round %d, step %d) from %s in %.2f s", short_id(peer_id),
                state.round, state.step, short_id(donor), time.monotonic() - t0)
