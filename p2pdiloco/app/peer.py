"""One peer process: data, model, DHT, merger and learner wired together, and closed in order."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
import torch
from hivemind import DHT
from safetensors.torch import save_file

from p2pdiloco import __version__
from p2pdiloco.app.heartbeat import Heartbeat
from p2pdiloco.app.joining import join_swarm_state, resume_from_checkpoint
from p2pdiloco.app.reach import start_reachability
from p2pdiloco.app.startup import StartupClock, process_started_monotonic, say
from p2pdiloco.app.together import wait_for_peers
from p2pdiloco.config import Config, fingerprint_digest
from p2pdiloco.network.census import secret_of
from p2pdiloco.network.p2p_merger import P2PMerger
from p2pdiloco.network.peer_records import PeerSample, sample_peers
from p2pdiloco.network.peer_tag import short_id
from p2pdiloco.network.state_sync import StateSync
from p2pdiloco.network.swarm import (
    BackgroundLoop,
    Reaper,
    check_fingerprint,
    check_maddrs,
    configs_differ,
    live_configs,
    start_dht,
    swarm_auth,
    visible_maddrs,
)
from p2pdiloco.network.swarm_key import SwarmAuth
from p2pdiloco.network.traffic import Traffic, dht_bytes_by_kind
from p2pdiloco.testing.hooks import PeerHooks, peer_hooks  # the one door to test doubles and fault injection
from p2pdiloco.training.accel import pick_device
from p2pdiloco.training.batches import BatchSampler, eval_batches
from p2pdiloco.training.corpus import load_corpus
from p2pdiloco.training.data import TextData
from p2pdiloco.training.distributed import (
    UnitContext,
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
from p2pdiloco.util.files import replacing, write_json_atomic
from p2pdiloco.util.logfiles import OutputCap, rotations

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


def save_model(path: Path, learner: Learner) -> None:
    """The global model θg as named safetensors tensors, a tied matrix once (`named_weights`; load it into
    `build_model(cfg.model)` with `load_named_weights_`)."""
    model = build_model(learner.cfg.model)
    load_flat_(model, learner.global_params)
    # the config too, so that `p2pdiloco sample` and `export` can rebuild the model from this file alone
    with replacing(path) as tmp:
        save_file(named_weights(model), str(tmp), metadata={"round": str(learner.c.round), "step": str(learner.c.step),
                                                            "config": json.dumps(learner.cfg.to_dict())})


IDENTITY_FILE = "identity.key"
"""The peer's libp2p identity in its run folder (0600): kept across --resume, replaced on a fresh start."""


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
    """A new run into an old folder must not mix with (or erase) the old run's metrics: move them aside, the
    rotated older half (`NAME.1`) with them."""
    if path.exists() and path.stat().st_size > 0:
        stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(path.stat().st_mtime))
        for p in rotations(path):
            p.rename(p.with_name(p.name.replace(path.name, f"{path.stem}-{stamp}{path.suffix}", 1)))


@dataclass
class Peer:
    """A built peer: its parts, for `start_services` and `train` (made by `build_peer`)."""

    cfg: Config
    stop: StopFlag
    unit: UnitContext
    device: torch.device
    peer_id: str
    maddrs: list[str]
    fingerprint: dict
    every: PeerSample
    """The peer records read at the start (some shards, `peer_records.sample_peers`)."""
    dht: DHT
    loop: BackgroundLoop
    merger: P2PMerger
    learner: Learner
    sampler: BatchSampler
    metrics: MetricsLog
    n_params: int
    auth: SwarmAuth
    hooks: PeerHooks
    together: bool
    """Started together with the others of a `local` run: waits for them before its first step."""
    finished: bool = False
    """Set once it has trained to the end (not stopped): its record then says it left having finished."""
    state_sync: StateSync | None = None
    """Serves this peer's state to joiners (set by `start_services`)."""


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
    # each part registers its close as it starts, and they close in reverse: the peer record withdrawn, /metrics
    # stopped, the last checkpoint finished, the merger, the metrics log, the network loop, the DHT, its reaper,
    # the learner unit; whatever was started when an error comes is closed all the same
    with contextlib.ExitStack() as closing:
        unit, device = prepare_process(cfg, closing)
        if not unit.is_main:  # a follower rank: trains in step with rank 0, which alone talks to the swarm
            run_follower(cfg, unit, device)
            return None
        peer = build_peer(cfg, stop, unit, device, startup, t_process_start, announce, closing)
        start_services(peer, announce, closing)
        return train(peer, start_barrier)


def prepare_process(cfg: Config, closing: contextlib.ExitStack) -> tuple[UnitContext, torch.device]:
    """Settle this process's cores, threads, run folder and identity, and join its learner unit (closed by
    `closing`); returns the unit and the device to train on."""
    if cfg.run.cpu_affinity:  # before anything starts, so the DHT and p2p daemon inherit it too
        os.sched_setaffinity(0, {int(c) for c in cfg.run.cpu_affinity.split(",")})
    if cfg.run.threads > 0:
        torch.set_num_threads(cfg.run.threads)
    Path(cfg.run.run_dir).mkdir(parents=True, exist_ok=True)
    # a resumed peer keeps its peer id, and with it what others learned of it (their guards' trust: under a new
    # id a restarted peer is a stranger, whose first unusual parts the trust screen rejects); a fresh run takes a
    # fresh id
    if not cfg.run.resume:
        (Path(cfg.run.run_dir) / IDENTITY_FILE).unlink(missing_ok=True)
    check_maddrs(cfg.swarm.initial_peers, "initial peer")  # a typo should not cost a data load first
    unit = context_from_env()
    device = init_unit(unit, pick_device(cfg.run.device))
    closing.callback(close_unit, unit)
    return unit, device


def start_dht_beside_model(cfg: Config, unit: UnitContext, device: torch.device, tokenizer, together: bool,
                           startup: StartupClock) -> tuple[DHT, TextData, BatchSampler, list, torch.nn.Module,
                                                           float | None]:
    """Start the DHT and, while it starts, load the data, build the model and (`together`) evaluate it.

    Returns:
        The DHT, the data, its batch sampler, the validation batches, the model and its first eval loss (None
        unless `together`).
    """
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
        peer_hooks(cfg).prepare_identity(cfg, Path(cfg.run.run_dir) / IDENTITY_FILE)  # a hostile grinder's key
        dht = start_dht(cfg.swarm, identity_path=str(Path(cfg.run.run_dir) / IDENTITY_FILE))
        say("DHT up in %.1f s: peer %s", time.monotonic() - t0, dht.peer_id.to_base58())
        return dht

    # the DHT's start is mostly waiting (its process, the p2p daemon, the join): load and build meanwhile
    dht, built = startup.side_by_side("dht_with_data_and_model", ("dht", dht_up), {"data_and_model": data_and_model},
                                      undo=DHT.shutdown)
    return dht, *built["data_and_model"]


def build_peer(cfg: Config, stop: StopFlag, unit: UnitContext, device: torch.device, startup: StartupClock,
               t_process_start: float, announce, closing: contextlib.ExitStack) -> Peer:
    """Start the DHT, load the data and model, check the swarm's config and make the merger and learner, each
    closed by `closing`."""
    tokenizer = load_tokenizer(cfg.data.tokenizer)
    check_vocab(tokenizer, cfg.model.vocab_size, cfg.data.tokenizer)  # before a long tokenization, not after
    # the DHT process forked below never tokenizes: say so, or HF tokenizers warns about the fork on stderr
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    startup.lap("device_and_tokenizer")
    say("loading data and building the model while the DHT starts (%.1f s of interpreter and imports)",
        startup.laps["interpreter_and_imports"])
    # peers started together wait for each other (a restarted peer joins a running swarm), and all evaluate the
    # initial model before their first step: on a busy machine that is seconds, so it is taken while the DHT starts
    together = cfg.startup.wait_for_peers > 1 and not cfg.run.resume
    dht, data, sampler, val, model, first_eval = start_dht_beside_model(cfg, unit, device, tokenizer, together,
                                                                        startup)
    reaper = Reaper(dht)
    closing.callback(reaper.close)  # after the DHT's shutdown: the watchdog ends what is left of it
    closing.callback(dht.shutdown)
    loop = BackgroundLoop()
    closing.callback(loop.close)
    peer_id = dht.peer_id.to_base58()
    maddrs = visible_maddrs(dht)
    announce(f"peer {peer_id} listening on:")
    for m in maddrs:
        announce(f"  {m}")
    announce("others can join with: p2pdiloco peer --initial-peers " + join_address(maddrs))
    fingerprint = cfg.fingerprint(tokenizer=tokenizer.digest)
    # one node's copy of a shard (or of every shard, if it holds few live peers) serves the config check and the
    # first look at the swarm's progress: the join reads every shard only when a live peer is ahead of this one
    every = loop.run(sample_peers(dht, cfg.swarm.run_id, peer_id), timeout=30)
    if configs_differ(every.records, fingerprint_digest(fingerprint)):
        check_fingerprint(fingerprint, loop.run(live_configs(dht, cfg.swarm.run_id, every.records), timeout=30))

    run_dir = Path(cfg.run.run_dir)
    if not cfg.run.resume:
        keep_previous(run_dir / "metrics.jsonl")
    metrics = MetricsLog(run_dir / "metrics.jsonl", int(cfg.run.max_log_mb * 1e6))
    closing.callback(metrics.close)  # after the merger's close, whose last results the learner may still log
    auth = swarm_auth(cfg.swarm)
    hooks = peer_hooks(cfg)  # no faults and no hostile wrapper unless a test or benchmark asked for them
    merger = P2PMerger(dht, cfg, loop, count_params(model), auth=auth, guard=cfg.guard, faults=hooks.faults,
                       fingerprint=fingerprint_digest(fingerprint), census_secret=secret_of(run_dir / IDENTITY_FILE))
    closing.callback(merger.close)
    say("merger ready in %.1f s (codec %s)", startup.lap("merger"), cfg.codec.name, tag=short_id(peer_id))
    learner = Learner(cfg, model, sampler.next_batch, val, hooks.wrap_merger(merger), device, metrics,
                      should_stop=stop, checkpoint_dir=run_dir / "checkpoints", faults=hooks.faults,
                      t_process_start=t_process_start)
    closing.callback(finish_checkpoints, learner)
    learner.checkpoint_meta = lambda: {"guard_trust": merger.trust_table()}
    if first_eval is not None:  # θg is the model's weights, as evaluated
        learner.last_eval = (learner.g.digest(), first_eval)
    startup.lap("learner")  # the model on its device, the optimizers, the initial global model
    learner.log_start(startup.laps)  # before any state download: a restart's start-up is its own, in the metrics
    learner.report.traffic = Traffic(merge=merger.counter)
    learner.report.tokens_per_byte = data.tokens_per_byte
    if unit.world_size > 1:
        UnitSync(unit, device).attach(learner)
    return Peer(cfg, stop, unit, device, peer_id, maddrs, fingerprint, every, dht, loop, merger, learner, sampler,
                metrics, count_params(model), auth, hooks, together)


def start_services(peer: Peer, announce, closing: contextlib.ExitStack) -> None:
    """Serve the state and the dial-back check, resume or download the swarm's state, then serve /metrics and
    publish the peer record (withdrawn by `closing`)."""
    cfg, dht, loop, merger, learner = peer.cfg, peer.dht, peer.loop, peer.merger, peer.learner
    state_sync = StateSync(dht, cfg.swarm.run_id, peer.n_params, peer.hooks.wrap_state(lambda: learner.shared, peer.n_params),
                           learner.report.traffic.state, auth=peer.auth, gate=merger.gate,
                           held=peer.hooks.wrap_held(learner.held.get))
    loop.run(state_sync.start(), timeout=30)
    peer.state_sync = state_sync
    # its bytes count with the state downloads' (both are start-up traffic), not in any merge's
    merger.expect_dialable_verdict()
    reach = start_reachability(loop, dht, cfg.swarm.run_id, cfg.swarm.initial_peers, peer.maddrs, merger.gate,
                               learner.report.traffic.state,
                               on_verdict=lambda found: merger.set_dialable(found.reachable is not False))
    loop.submit(learner.report.traffic.watch_dht(dht, cfg.swarm.heartbeat_s))
    closing.callback(OutputCap(int(cfg.run.max_log_mb * 1e6)).close)  # the log file `local` sends our output to
    if cfg.run.resume:
        resume_from_checkpoint(learner, peer.sampler, merger.remember_trust, Path(cfg.run.run_dir) / "checkpoints", announce)
    join_swarm_state(learner, state_sync, loop, dht, cfg, peer.peer_id, peer.metrics, peer.every, peer.sampler)
    # public, so no host name or user (the name is opt-in); in the config record, not in every heartbeat
    static = {
        "name": cfg.run.name[:64], "version": __version__, "maddrs": peer.maddrs[:8],
        "device": str(peer.device) if peer.unit.world_size == 1 else f"{peer.device} x{peer.unit.world_size}",
        "started": time.time(),
    }
    digest = fingerprint_digest(peer.fingerprint)
    if cfg.run.metrics_port:
        # aiohttp: imported only by a peer that serves /metrics
        from p2pdiloco.observe.telemetry import MetricsServer

        ids = {**static, "fingerprint": digest, "peer_id": peer.peer_id, "run_id": cfg.swarm.run_id}
        metrics_server = MetricsServer(lambda: telemetry_snapshot(learner, ids), cfg.run.metrics_host,
                                       cfg.run.metrics_port)
        closing.callback(stop_metrics_server, loop, metrics_server)
        announce(f"Prometheus metrics at {loop.run(metrics_server.start(), timeout=10)}")
    # what changes, the config's digest (a starting peer's check) and whether others can dial it (a joiner's donors)
    record = peer.hooks.wrap_record(lambda: {"fingerprint": digest, "reachable": reach["reachable"],
                                             **learner.report.record()}, peer.n_params)
    heartbeat = Heartbeat(dht, cfg.swarm.run_id, peer.peer_id, record, cfg.swarm.heartbeat_s)
    closing.callback(leave_swarm, peer, heartbeat)
    loop.submit(heartbeat.run(peer.fingerprint, lambda: {**static, "reach_detail": reach["reach_detail"]}))


def train(peer: Peer, start_barrier: Path | None) -> dict:
    """Train to the end (or a stop), then write the peer's summary, last checkpoint and model; returns the
    summary."""
    cfg, dht, loop, merger, learner, stop = peer.cfg, peer.dht, peer.loop, peer.merger, peer.learner, peer.stop
    run_dir = Path(cfg.run.run_dir)
    if peer.together:
        learner.evaluate_global()  # the first eval (held if taken beside the DHT's start), before the wait
        say("waiting for %d peers to be live", cfg.startup.wait_for_peers, tag=short_id(peer.peer_id))
        live = wait_for_peers(loop, dht, cfg, peer.peer_id, stop, start_barrier, merger.census)
        logger.info("[%s] %d of %d peers live; starting", short_id(peer.peer_id), live, cfg.startup.wait_for_peers)
    summary = learner.run()
    loop.run(learner.report.traffic.refresh_dht(dht), timeout=10)  # the DHT's final counts, not the last poll's
    summary.update(name=cfg.run.name, n_params=peer.n_params, **learner.report.bandwidth(),
                   guard=merger.guard_report(), hostile=cfg.emulate.hostile, census=merger.census.counts(),
                   state_serving=peer.state_sync.slots.report() if peer.state_sync else None)
    summary["dht_by_kind"] = dht_bytes_by_kind(learner.report.traffic.dht_by_key, cfg.swarm.run_id)
    write_json_atomic(run_dir / "peer_summary.json", summary)
    if not stop():  # a peer told to stop mid-round still has its last merged state in the checkpoints
        learner.checkpoint(wait=True)
    save_model(run_dir / "model.safetensors", learner)
    peer.finished = not stop()
    return summary


def leave_swarm(peer: Peer, heartbeat: Heartbeat) -> None:
    """Withdraw the peer record, saying where the peer finished if it trained to the end."""
    try:
        peer.loop.run(heartbeat.leave(peer.learner.c.step if peer.finished else None), timeout=5)
    except Exception as e:  # leaving: others will see the record expire instead
        logger.debug("withdrawing the peer record failed: %r", e)


def stop_metrics_server(loop: BackgroundLoop, server) -> None:
    try:
        loop.run(server.stop(), timeout=5)
    except Exception as e:  # shutting down: log, never raise
        logger.debug("stopping the metrics server: %r", e)


def finish_checkpoints(learner: Learner) -> None:
    try:  # a peer told to stop: the checkpoint being written is finished, not cut off at exit
        learner.checkpoints.close()
    except Exception as e:  # shutting down: log, never raise
        logger.error("writing the last checkpoint failed: %r", e)
