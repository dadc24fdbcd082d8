"""One peer process: data, model, DHT, merger and learner wired together, and closed in order."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import torch
from hivemind import DHT
from safetensors.torch import save_file

from p2pdiloco import __version__
from p2pdiloco.app.heartbeat import Heartbeat, swarm_finished
from p2pdiloco.app.reach import start_reachability
from p2pdiloco.app.startup import StartupClock, process_started_monotonic, say
from p2pdiloco.app.together import wait_for_peers
from p2pdiloco.config import Config, fingerprint_digest
from p2pdiloco.network.p2p_merger import P2PMerger
from p2pdiloco.network.state_sync import StateSync
from p2pdiloco.network.swarm import (
    BackgroundLoop,
    Reaper,
    check_fingerprint,
    check_maddrs,
    configs_differ,
    live_configs,
    live_records,
    read_peers,
    start_dht,
    swarm_auth,
    visible_maddrs,
)
from p2pdiloco.network.traffic import Traffic, dht_bytes_by_kind
from p2pdiloco.testing.hooks import peer_hooks  # the one door to test doubles and fault injection
from p2pdiloco.training.accel import pick_device
from p2pdiloco.training.batches import BatchSampler, eval_batches
from p2pdiloco.training.checkpoint import load_latest
from p2pdiloco.training.corpus import load_corpus
from p2pdiloco.training.data import TextData
from p2pdiloco.training.distributed import (
    UnitSync,
    close_unit,
    context_from_env,
    init_unit,
    rank_shard,
    run_follower,
)
from p2pdiloco.training.evaluation import evaluate_model
from p2pdiloco.training.flat import load_flat_
from p2pdiloco.training.learner import Learner
from p2pdiloco.training.model import build_model, count_params, named_weights
from p2pdiloco.training.reporting import MetricsLog
from p2pdiloco.training.tokenizer import check_vocab, load_tokenizer

logger = logging.getLogger(__name__)


class StopFlag:
    """Set by SIGINT/SIGTERM: the peer finishes its inner step, abandons any merge and exits cleanly.

    A second SIGINT raises KeyboardInterrupt for an immediate (still cleaned-up) exit.
    """

    def __init__(self) -> None:
        self._event = threading.Event()

    def __call__(self) -> bool:
        return self._event.is_set()

    def set(self) -> None:
        self._event.set()

    def install(self) -> None:
        owner = os.getpid()

        def on_signal(signum, _frame):
            if os.getpid() != owner:  # a forked child (the DHT process) inherited us: behave as default
                signal.signal(signum, signal.SIG_DFL)
                os.kill(os.getpid(), signum)
                return
            if self._event.is_set() and signum == signal.SIGINT:
                raise KeyboardInterrupt
            logger.warning("%s received: stopping after the current step", signal.Signals(signum).name)
            self._event.set()

        signal.signal(signal.SIGINT, on_signal)
        signal.signal(signal.SIGTERM, on_signal)


def write_json_atomic(path: Path, obj) -> None:
    """Write via a temporary file, fsync and rename, so a reader never sees a half-written file."""
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w") as f:
        json.dump(obj, f, indent=2)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def save_model(path: Path, learner: Learner) -> None:
    """The global model θg as named safetensors tensors, a tied matrix once (`named_weights`; load it into
    `build_model(cfg.model)` with `load_named_weights_`)."""
    model = build_model(learner.cfg.model)
    load_flat_(model, learner.global_params)
    tmp = path.with_name(path.name + ".tmp")
    # the config too, so that `p2pdiloco sample` and `export` can rebuild the model from this file alone
    save_file(named_weights(model), str(tmp), metadata={"round": str(learner.c.round), "step": str(learner.c.step),
                                                        "config": json.dumps(learner.cfg.to_dict())})
    os.replace(tmp, path)


IDENTITY_FILE = "identity.key"
"""The peer's libp2p identity in its run folder (0600): kept across --resume, replaced on a fresh start."""


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


def join_swarm_state(learner: Learner, sync: StateSync, loop: BackgroundLoop, dht, cfg: Config, peer_id: str,
                     metrics: MetricsLog, every: dict[str, dict] | None = None) -> None:
    """If live peers' global models have absorbed more tokens than ours, download the freshest one first,
    so that a joiner (or a resumed peer that fell behind) continues the swarm's run instead of pulling it back.

    If no peer is live and one left having finished the run, the run is over: this peer ends at once
    (`Learner.ended_with_swarm`) instead of training on alone.

    Args:
        every: the swarm's peer records as read at this peer's start (`read_peers`), or None to read them here."""
    say("joining the swarm %s: %s its peer records", cfg.swarm.run_id, "reading" if every is None else "checking",
        tag=peer_id[-6:])
    if every is None:
        every = loop.run(read_peers(dht, cfg.swarm.run_id), timeout=30)
    finished = swarm_finished(every, peer_id, cfg.run.total_steps)
    if finished is not None:  # training on alone would only move this peer's model away from the swarm's result
        learner.ended_with_swarm = learner.report.arrived_after_end = True
        metrics.write(kind="swarm_finished", peer=finished[0], step=finished[1])
        logger.warning("[%s] the swarm already finished this run (peer %s left at step %d): nothing left to train; "
                       "keeping this peer's model as it is", peer_id[-6:], finished[0][-6:], finished[1])
        return
    records = live_records(every)
    ahead = {p: r for p, r in records.items()
             if p != peer_id and float(r.get("global_tokens") or 0) > learner.c.global_tokens}
    if not ahead:
        return
    say("joining: downloading the swarm's state (%d live peer(s) ahead of this one)", len(ahead), tag=peer_id[-6:])
    t0 = time.monotonic()

    async def refresh() -> dict[str, dict]:
        await asyncio.sleep(cfg.swarm.heartbeat_s)  # a donor's record can lag its last merge by one heartbeat
        return live_records(await read_peers(dht, cfg.swarm.run_id))

    # every live record counts in checking a donor's state, not only those claiming to be ahead
    passes = 3
    got = loop.run(sync.fetch(records, peer_id, timeout=cfg.swarm.merge_timeout_s, refresh=refresh, passes=passes),
                   timeout=(cfg.swarm.merge_timeout_s + cfg.swarm.heartbeat_s + 5) * (len(records) + 1) * passes + 10)
    if got is None:
        logger.warning("[%s] no live peer could give its state; the first merge will bring this peer in line",
                       peer_id[-6:])
        return
    state, donor = got
    learner.adopt_state(state)
    metrics.write(kind="join", donor=donor, round=state.round, step=state.step,
                  download_s=time.monotonic() - t0, global_digest=learner.g.digest())
    logger.info("[%s] downloaded the swarm's state (round %d, step %d) from %s in %.2f s", peer_id[-6:],
                state.round, state.step, donor[-6:], time.monotonic() - t0)


def telemetry_snapshot(learner: Learner, static: dict) -> dict:
    """What /metrics reports: the heartbeat record, plus counters too dull for the DHT record."""
    c = learner.c
    return {**static, **learner.report.record(), "merge_failures": c.merge_failures, "compute_s": c.compute_s,
            "merge_wait_s": c.merge_wait_s}


def join_address(maddrs: list[str]) -> str:
    """The address to tell other machines: the first one that is not loopback, if any."""
    for m in maddrs:
        if not (m.startswith("/ip4/127.") or m.startswith("/ip6/::1/")):
            return m
    return maddrs[0] if maddrs else "<address>"


def keep_previous(path: Path) -> None:
    """A new run into an old folder must not mix with (or erase) the old run's metrics: move them aside."""
    if path.exists() and path.stat().st_size > 0:
        stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(path.stat().st_mtime))
        path.rename(path.with_name(f"{path.stem}-{stamp}{path.suffix}"))


def run_peer(cfg: Config, stop: StopFlag, announce=print, start_barrier: Path | None = None) -> dict | None:
    """Join the swarm, train, write the run folder; returns the summary (None on a follower rank of a
    multi-process learner unit, see distributed.py).

    Args:
        cfg: the run's config.
        stop: polled between steps.
        announce: where to print the lines a user needs (addresses); `print` for the CLI.
        start_barrier: a folder shared by the peers of one `local` run (see `wait_for_peers`).
    """
    # from the real start of this process (interpreter and imports included)
    t_process_start = process_started_monotonic(psutil.Process().create_time())
    startup = StartupClock(t_process_start)
    if cfg.run.cpu_affinity:  # before anything starts, so the DHT and p2p daemon inherit it too
        os.sched_setaffinity(0, {int(c) for c in cfg.run.cpu_affinity.split(",")})
    if cfg.run.threads > 0:
        torch.set_num_threads(cfg.run.threads)
    run_dir = Path(cfg.run.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    # a resumed peer keeps its peer id, and with it what others learned of it (their guards' trust: under a new
    # id a restarted peer is a stranger, whose first unusual parts the trust screen rejects); a fresh run takes a
    # fresh id
    identity = run_dir / IDENTITY_FILE
    if not cfg.run.resume:
        identity.unlink(missing_ok=True)
    check_maddrs(cfg.swarm.initial_peers, "initial peer")  # a typo should not cost a data load first
    unit = context_from_env()
    device = init_unit(unit, pick_device(cfg.run.device))
    if not unit.is_main:  # a follower rank: trains in step with rank 0, which alone talks to the swarm
        try:
            run_follower(cfg, unit, device)
            return None
        finally:
            close_unit(unit)
    tokenizer = load_tokenizer(cfg.data.tokenizer)
    check_vocab(tokenizer, cfg.model.vocab_size, cfg.data.tokenizer)  # before a long tokenization, not after
    # the DHT process forked below never tokenizes: say so, or HF tokenizers warns about the fork on stderr
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    startup.lap("device_and_tokenizer")
    say("loading data and building the model while the DHT starts (%.1f s of interpreter and imports)",
        startup.laps["interpreter_and_imports"])

    # peers started together wait for each other (a restarted peer joins a running swarm), and all evaluate the
    # initial model before their first step: on a busy machine that is seconds, so it is taken while the DHT starts
    together = cfg.swarm.wait_for_peers > 1 and not cfg.run.resume

    def data_and_model() -> tuple[TextData, BatchSampler, list, torch.nn.Module, float | None]:
        t0 = time.monotonic()
        data = load_corpus(cfg.data, tokenizer, min_tokens=2 * (cfg.model.seq_len + 1))
        sampler = BatchSampler(data.train, cfg.model.seq_len, cfg.data.batch_size, cfg.run.seed,
                               rank_shard(cfg.data.shard, unit.rank, unit.world_size))
        val = eval_batches(data.val, cfg.model.seq_len, cfg.data.batch_size, cfg.run.eval_batches)
        model = build_model(cfg.model).to(device)
        say("loaded data and model in %.1f s: %d parameters on %s; %d files, %d bytes (%s)", time.monotonic() - t0,
            count_params(model), device, data.n_files, data.n_bytes, data.source)
        return data, sampler, val, model, evaluate_model(model, val, device, cfg.run.precision) if together else None

    def dht_up() -> DHT:
        t0 = time.monotonic()
        dht = start_dht(cfg.swarm, identity_path=str(identity))
        say("DHT up in %.1f s: peer %s", time.monotonic() - t0, dht.peer_id.to_base58())
        return dht

    # the DHT's start is mostly waiting (its process, the p2p daemon, the join): load and build meanwhile
    dht, built = startup.side_by_side("dht_with_data_and_model", ("dht", dht_up), {"data_and_model": data_and_model},
                                      undo=DHT.shutdown)
    data, sampler, val, model, first_eval = built["data_and_model"]
    n_params = count_params(model)
    reaper = Reaper(dht)
    loop = BackgroundLoop()
    merger = metrics = heartbeat = metrics_server = learner = None
    finished = False
    try:
        peer_id = dht.peer_id.to_base58()
        maddrs = visible_maddrs(dht)
        announce(f"peer {peer_id} listening on:")
        for m in maddrs:
            announce(f"  {m}")
        announce("others can join with: p2pdiloco peer --initial-peers " + join_address(maddrs))
        fingerprint = cfg.fingerprint(tokenizer=tokenizer.digest)
        # one read of every peer record serves both the config check and the join: a second read would walk all 8
        # shards again, each over the nodes holding it (docs/benchmarks.md, Scale, start-up DHT bytes). One
        # node's copy of each shard instead cost more: a fresh peer first looks up each shard's nearest nodes
        every = loop.run(read_peers(dht, cfg.swarm.run_id), timeout=30)
        if configs_differ(every, fingerprint_digest(fingerprint)):
            check_fingerprint(fingerprint, loop.run(live_configs(dht, cfg.swarm.run_id, every), timeout=30))

        auth = swarm_auth(cfg.swarm)
        hooks = peer_hooks(cfg)  # no faults and no hostile wrapper unless a test or benchmark asked for them
        merger = P2PMerger(dht, cfg.swarm, loop, n_params, auth=auth, guard=cfg.guard,
                           fingerprint=fingerprint_digest(fingerprint), faults=hooks.faults)
        say("merger ready in %.1f s (codec %s)", startup.lap("merger"), cfg.swarm.codec, tag=peer_id[-6:])
        if not cfg.run.resume:
            keep_previous(run_dir / "metrics.jsonl")
        metrics = MetricsLog(run_dir / "metrics.jsonl")
        learner = Learner(cfg, model, sampler.next_batch, val, hooks.wrap_merger(merger), device, metrics,
                          should_stop=stop, checkpoint_dir=run_dir / "checkpoints", faults=hooks.faults,
                          t_process_start=t_process_start)
        learner.checkpoint_meta = lambda: {"guard_trust": merger.trust_table()}
        if first_eval is not None:  # θg is the model's weights, as evaluated
            learner.last_eval = (learner.g.digest(), first_eval)
        startup.lap("learner")  # the model on its device, the optimizers, the initial global model
        learner.log_start(startup.laps)  # before any state download: a restart's start-up is its own, in the metrics
        learner.report.traffic = Traffic(merge=merger.counter)
        learner.report.tokens_per_byte = data.tokens_per_byte
        if unit.world_size > 1:
            UnitSync(unit, device).attach(learner)
        state_sync = StateSync(dht, cfg.swarm.run_id, n_params, hooks.wrap_state(lambda: learner.shared),
                               learner.report.traffic.state, auth=auth, gate=merger.gate)
        loop.run(state_sync.start(), timeout=30)
        # its bytes count with the state downloads' (both are start-up traffic), not in any merge's
        merger.expect_dialable_verdict()
        reach = start_reachability(loop, dht, cfg.swarm.run_id, cfg.swarm.initial_peers, maddrs, merger.gate,
                                   learner.report.traffic.state,
                                   on_verdict=lambda found: merger.set_dialable(found.reachable is not False))
        loop.submit(learner.report.traffic.watch_dht(dht, cfg.swarm.heartbeat_s))
        if cfg.run.resume:
            resume_from_checkpoint(learner, sampler, merger.remember_trust, run_dir / "checkpoints", announce)
        join_swarm_state(learner, state_sync, loop, dht, cfg, peer_id, metrics, every)
        # public: anyone who knows the run id reads it, so no host name or user (the name is opt-in)
        static = {
            "name": cfg.run.name, "version": __version__, "maddrs": maddrs,
            "device": str(device) if unit.world_size == 1 else f"{device} x{unit.world_size}",
            "fingerprint": fingerprint_digest(fingerprint), "started": time.time(),
        }
        heartbeat = Heartbeat(dht, cfg.swarm.run_id, peer_id, lambda: {**static, **reach, **learner.report.record()},
                              cfg.swarm.heartbeat_s)
        loop.submit(heartbeat.run(fingerprint))
        if cfg.run.metrics_port:
            # aiohttp: imported only by a peer that serves /metrics
            from p2pdiloco.observe.telemetry import MetricsServer

            ids = {**static, "peer_id": peer_id, "run_id": cfg.swarm.run_id}
            metrics_server = MetricsServer(lambda: telemetry_snapshot(learner, ids), cfg.run.metrics_host,
                                           cfg.run.metrics_port)
            announce(f"Prometheus metrics at {loop.run(metrics_server.start(), timeout=10)}")
        if together:
            learner.evaluate_global()  # the first eval (held if taken beside the DHT's start), before the wait
            say("waiting for %d peers to be live", cfg.swarm.wait_for_peers, tag=peer_id[-6:])
            live = wait_for_peers(loop, dht, cfg, peer_id, stop, start_barrier, merger.census)
            logger.info("[%s] %d of %d peers live; starting", peer_id[-6:], live, cfg.swarm.wait_for_peers)
        summary = learner.run()
        loop.run(learner.report.traffic.refresh_dht(dht), timeout=10)  # the DHT's final counts, not the last poll's
        summary.update(name=cfg.run.name, n_params=n_params, **learner.report.bandwidth(), guard=merger.guard_report(),
                       hostile=cfg.emulate.hostile, census=merger.census.counts())
        summary["dht_by_kind"] = dht_bytes_by_kind(learner.report.traffic.dht_by_key, cfg.swarm.run_id)
        write_json_atomic(run_dir / "peer_summary.json", summary)
        if not stop():  # a peer told to stop mid-round still has its last merged state in the checkpoints
            learner.checkpoint(wait=True)
        save_model(run_dir / "model.safetensors", learner)
        finished = not stop()
        return summary
    finally:
        if heartbeat is not None:
            try:
                loop.run(heartbeat.leave(learner.c.step if finished else None), timeout=5)
            except Exception as e:  # leaving: others will see the record expire instead
                logger.debug("withdrawing the peer record failed: %r", e)
        if metrics_server is not None:
            try:
                loop.run(metrics_server.stop(), timeout=5)
            except Exception as e:  # shutting down: log, never raise
                logger.debug("stopping the metrics server: %r", e)
        if learner is not None:
            try:  # a peer told to stop: the checkpoint being written is finished, not cut off at exit
                learner.checkpoints.close()
            except Exception as e:  # shutting down: log, never raise
                logger.error("writing the last checkpoint failed: %r", e)
        if merger is not None:
            merger.close()
        if metrics is not None:
            metrics.close()
        loop.close()
        dht.shutdown()
        reaper.close()
        close_unit(unit)
