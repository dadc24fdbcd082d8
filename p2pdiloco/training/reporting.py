"""What a learner tells the world: its metrics lines, its heartbeat record and its end-of-run summary.

The learner owns the loop and updates `Counters`; a `Reporter` reads them (and the meters it keeps) to write
`metrics.jsonl`, fill the heartbeat, and add up throughput, MFU and bandwidth at the end.
"""

from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from p2pdiloco.config import Config
from p2pdiloco.network.merger import Merged, MergeStats
from p2pdiloco.network.peer_tag import PeerLog, short_id
from p2pdiloco.network.traffic import Traffic, bandwidth_report
from p2pdiloco.training.accel import compute_dtype, flops_per_token, mfu, peak_flops, peak_memory
from p2pdiloco.training.meters import Ema, RateMeter
from p2pdiloco.util.logfiles import CappedLog

logger = logging.getLogger(__name__)


class MetricsLog:
    """Append-only JSON lines, flushed per line so that a crash loses at most the line being written, rotated by
    size (util/logfiles.py: read them back whole with `read_jsonl`).

    Args:
        path: the file (`metrics.jsonl`); its older half is `metrics.jsonl.1`.
        max_bytes: the most the file and its rotation hold together (`run.max_log_mb`); 0: no cap.
    """

    def __init__(self, path: Path, max_bytes: int = 0):
        self._file = CappedLog(path, max_bytes)

    def write(self, **fields) -> None:
        self._file.write_line(json.dumps({"t": time.time(), **fields}))

    def close(self) -> None:
        self._file.close()


@dataclass
class Landed:
    """A merge as this learner applied it: what its counters and its metrics line are made of."""

    merged: Merged
    """What was applied: the group's merge, or this peer's own Δ when alone (`merger.merged_alone`)."""
    alone: bool = False
    """No group merge: the outer step was on this peer's own Δ."""
    failure: str = ""
    """Why a group merge was abandoned (and this peer merged alone instead); empty if none failed."""
    adopted_state: bool = False
    """The group's agreed global model was adopted (members' global models differed)."""
    state_refused: bool = False
    """The learner refused the group's agreed global model: too far from its own (see `GlobalModel.merge`)."""
    phase_shift_s: float = 0.0
    """How much the round in progress was moved to meet the mates' round ends (`Merger.take_round_shift`)."""

    @property
    def stats(self) -> MergeStats:
        return self.merged.stats


@dataclass
class Counters:
    """A learner's counts since it started (some survive a resume or are adopted from the swarm, as noted)."""

    step: int = 0
    round: int = 0
    tokens: int = 0
    tokens_in_round: int = 0
    steps_in_round: int = 0
    merges: int = 0
    merge_failures: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    pseudo_grad_bytes_sent: int = 0
    """Of `bytes_sent`, those of pseudo-gradient exchanges (see `MergeStats.pseudo_grad_bytes_sent`)."""
    pseudo_grad_bytes_received: int = 0
    """Of `bytes_received`, those of pseudo-gradient exchanges."""
    state_merges: int = 0
    """Merges that averaged (θg, momentum) too, because the members' global models differed."""
    state_merges_anchored: int = 0
    """Of `state_merges`, those sent as int8 differences from an anchor (the others: fp32)."""
    state_merges_caught_up: int = 0
    """Of `state_merges`, those where a majority of the members held one model and the others fetched it."""
    state_bytes_sent: int = 0
    """Of `bytes_sent`, those of (θg, momentum) agreements."""
    state_bytes_received: int = 0
    """Of `bytes_received`, those of (θg, momentum) agreements."""
    compute_s: float = 0.0
    """Wall seconds in inner steps, the padding of `emulate.min_step_s` and `slow_factor` included."""
    compute_cpu_s: float = 0.0
    """CPU seconds of the training thread inside inner steps (its own work only: not the padding's sleep, nor
    the network thread, the DHT process or p2pd; all of a step's CPU where torch runs one thread, as under
    `local`)."""
    merge_wait_s: float = 0.0
    land_waits: int = 0
    """Decoupled: waits for a merge just submitted to land (`outer.land_wait`); of them, `land_waits_landed` did."""
    land_waits_landed: int = 0
    global_tokens: float = 0.0
    """Tokens whose effect reached this peer's global model (its weight when global models are averaged)."""
    last_group_size: int = 1
    max_group_size: int = 1
    """Largest merge group this peer was part of: N of the data-parallel baseline in the bandwidth ratio."""
    last_merge_s: float = 0.0
    last_merge_time: float = 0.0
    """Wall-clock time (Unix seconds) when the last merge was applied; 0 before the first."""
    steps_run: int = 0
    """Inner steps this process ran (`step` is the position in the schedule, which a joiner adopts)."""
    tokens_run: int = 0
    """Tokens this learner unit trained on since this process started (`tokens` survives a resume)."""
    compute_in_round: float = 0.0
    rebase_dropped_s: float = 0.0
    """Inner-step seconds whose progress the last merge's rebase gave up: (1 − keep) of the steps taken while it
    was in flight (`outer.stale_share_kept`); goodput does not count them (bench/goodput.py)."""
    join_s: float | None = None
    """Seconds from process start to the first merge with other peers."""
    global_digest: str = ""
    """Digest of (θg, momentum) after the last merge or adoption ('' before either): in the heartbeat, so that a
    joiner can check a donor's state against what other live peers hold."""

    def add_step(self, tokens: int, compute_s: float, cpu_s: float = 0.0) -> None:
        """Count one inner step on `tokens` tokens that took `compute_s` wall seconds and `cpu_s` CPU seconds."""
        self.compute_s += compute_s
        self.compute_cpu_s += cpu_s
        self.compute_in_round += compute_s
        self.steps_run += 1
        self.step += 1
        self.steps_in_round += 1
        self.tokens += tokens
        self.tokens_in_round += tokens
        self.tokens_run += tokens

    def add_merge(self, landed: Landed) -> None:
        """Count an applied merge (a round completed)."""
        stats = landed.stats
        self.round += 1
        self.global_tokens += landed.merged.weight
        self.merges += 0 if landed.alone else 1
        self.merge_failures += 1 if landed.failure else 0
        self.bytes_sent += stats.bytes_sent
        self.bytes_received += stats.bytes_received
        self.pseudo_grad_bytes_sent += stats.pseudo_grad_bytes_sent
        self.pseudo_grad_bytes_received += stats.pseudo_grad_bytes_received
        self.state_merges += landed.adopted_state
        self.state_merges_anchored += landed.adopted_state and stats.state_anchored
        self.state_merges_caught_up += landed.adopted_state and stats.state_caught_up
        self.state_bytes_sent += stats.state_bytes_sent
        self.state_bytes_received += stats.state_bytes_received
        self.last_group_size = len(stats.group)
        self.max_group_size = max(self.max_group_size, len(stats.group))
        self.last_merge_s = stats.duration_s
        self.last_merge_time = time.time()


class Reporter:
    """A learner's metrics lines, heartbeat record and summary.

    Args:
        cfg: the run's config.
        counters: the learner's counters (the learner updates them, the reporter only reads them, but for
            `join_s`).
        metrics: where metrics lines go.
        peer_id: this peer's id.
        device: where inner steps run.
        n_params: the model's parameter count.
        t_process_start: time.monotonic() when the peer process started (for `process_s` and `join_s`);
            default now.
    """

    def __init__(self, cfg: Config, counters: Counters, metrics: MetricsLog, peer_id: str, device: torch.device,
                 n_params: int, t_process_start: float | None = None):
        self.cfg, self.c, self.metrics, self.peer_id, self.device = cfg, counters, metrics, peer_id, device
        self.tag = short_id(peer_id)
        self.log = PeerLog(logger, self.tag)
        self.n_params = n_params
        self.flops_per_token = flops_per_token(cfg.model, n_params)
        self.peak_flops = peak_flops(device, cfg.run.peak_flops)
        self.t_start = time.monotonic()
        self.t_process_start = t_process_start if t_process_start is not None else self.t_start
        self.traffic: Traffic | None = None
        """This peer's byte counters by kind (merges, state transfers, DHT), when it has a real network."""
        self.data_parallel = 1
        """Processes whose batches each inner step averages (for MFU)."""
        self.tokens_per_byte = 1.0
        """Validation tokens per byte of validation text (`TextData.tokens_per_byte`; 1 with byte tokens): eval
        loss per token times this is the loss per byte, which compares runs of different tokenizers."""
        self.loss_avg = Ema(span=20)
        self.throughput = RateMeter()
        self.eval_loss_initial = float("nan")
        self.eval_loss_final = float("nan")
        self.last_eval_loss = float("nan")
        self._loss_sum, self._loss_n, self._t_log, self._tokens_log = 0.0, 0, time.monotonic(), 0
        self._started = False
        self.first_step_s: float | None = None
        """Seconds from the process start to the first inner step (None before it)."""
        self.arrived_after_end = False
        """This peer started (or restarted) after the swarm had finished its run and trained nothing: its model is
        not the run's result (`app/joining.join_swarm_state`, `app/summary.summarize`)."""

    # ---- metrics lines ----

    def start(self, startup: dict[str, float] | None = None) -> None:
        """The metrics' `start` line, once, as early as the peer can write it (before a state download, so that
        everything from the process start on belongs to this incarnation when a metrics file holds several).

        Args:
            startup: seconds per start-up phase so far, for the record.
        """
        if not self._started:
            self._started = True
            self.metrics.write(kind="start", elapsed_s=self.elapsed(), step=self.c.step, round=self.c.round,
                               process_s=time.monotonic() - self.t_process_start, peer_id=self.peer_id,
                               **({"startup": startup} if startup else {}))

    def per_byte(self, eval_loss: float | None) -> float | None:
        """An eval loss in nats per token as nats per byte of validation text (None stays None)."""
        return None if eval_loss is None else eval_loss * self.tokens_per_byte

    def training_starts(self, eval_loss: float) -> None:
        """Before the first inner step: the global model's eval loss, the throughput meter's first point, and
        `first_step_s`, the whole start-up (its `process_s` field in this eval line)."""
        self.eval_loss_initial = self.last_eval_loss = eval_loss
        self.first_step_s = time.monotonic() - self.t_process_start
        self.metrics.write(kind="eval", elapsed_s=self.elapsed(), step=self.c.step, tokens=self.c.tokens,
                           eval_loss=eval_loss, eval_loss_per_byte=self.per_byte(eval_loss),
                           process_s=self.first_step_s)
        self.log.info("eval loss at start %.4f", eval_loss)
        # the last of the peer's progress lines (app/startup.py): `local` reads it as "training"
        self.log.info("start-up: first inner step after %.1f s", self.first_step_s)
        self.throughput.add(self.c.tokens)

    def training_ends(self, eval_loss: float) -> None:
        """After the last merge: the global model's final eval loss."""
        self.eval_loss_final = self.last_eval_loss = eval_loss
        self.metrics.write(kind="eval", elapsed_s=self.elapsed(), step=self.c.step, tokens=self.c.tokens,
                           eval_loss=eval_loss, eval_loss_per_byte=self.per_byte(eval_loss), final=True)

    def inner_step(self, loss: float, lr: float) -> None:
        """After an inner step (counters already updated): the meters, and a `train` line every `run.log_every`."""
        self.throughput.add(self.c.tokens)
        self.loss_avg.add(loss)
        self._loss_sum += loss
        self._loss_n += 1
        if self.c.step % self.cfg.run.log_every == 0:
            self._log_train(lr)

    def _log_train(self, lr: float) -> None:
        now = time.monotonic()
        tps = (self.c.tokens - self._tokens_log) / max(now - self._t_log, 1e-9)
        self.metrics.write(
            kind="train", elapsed_s=self.elapsed(), step=self.c.step, round=self.c.round, tokens=self.c.tokens,
            loss=self._loss_sum / max(self._loss_n, 1), lr=lr, tokens_per_s=tps,
            model_flops_per_s=tps * self.flops_per_token, mfu=self.mfu(tps),
            bytes_sent=self.bytes_io()[0], bytes_received=self.bytes_io()[1], merges=self.c.merges,
        )
        self._loss_sum, self._loss_n, self._t_log, self._tokens_log = 0.0, 0, now, self.c.tokens

    def merge(self, landed: Landed, round_compute_s: float, global_digest: str,
              eval_loss: float | None) -> None:
        """After a merge is applied: `join_s` on the first group merge, and the `merge` line (what goodput is
        computed from, bench/goodput.py: `round_compute_s`, `group_size`, `own_kept`, `adopted_state`,
        `state_refused` and `state_share`).

        Args:
            landed: the merge, as this learner applied it.
            round_compute_s: inner-step seconds that produced this peer's contribution.
            global_digest: the new global model's digest.
            eval_loss: the new global model's eval loss, if it was evaluated this round.
        """
        result = landed.stats
        if not landed.alone and self.c.join_s is None:
            self.c.join_s = time.monotonic() - self.t_process_start
        if eval_loss is not None:
            self.last_eval_loss = eval_loss
        self.metrics.write(
            kind="merge", elapsed_s=self.elapsed(), step=self.c.step, round=self.c.round, tokens=self.c.tokens,
            group_size=len(result.group), group_id=result.group_id, merges=self.c.merges, failure=landed.failure,
            merge_s=result.duration_s, match_s=result.match_s, marks=result.marks, alone_cause=result.alone_cause,
            bytes_sent=self.bytes_io()[0], bytes_received=self.bytes_io()[1],
            global_digest=global_digest, adopted_state=landed.adopted_state, state_refused=landed.state_refused,
            eval_loss=eval_loss,
            eval_loss_per_byte=self.per_byte(eval_loss),
            round_compute_s=round_compute_s, rebase_dropped_s=self.c.rebase_dropped_s, rejected=result.rejected,
            final=landed.merged.final,
            own_kept=result.own_kept, state_share=result.state_share, state_anchored=result.state_anchored,
            state_caught_up=result.state_caught_up,
            state_bytes_sent=result.state_bytes_sent, state_bytes_received=result.state_bytes_received,
            pseudo_grad_bytes_sent=result.pseudo_grad_bytes_sent,
            pseudo_grad_bytes_received=result.pseudo_grad_bytes_received, phase_shift_s=landed.phase_shift_s,
            **({"traffic": self.traffic.snapshot()} if self.traffic else {}),
        )
        self.log.info(
            "round %d: merged with %d peer(s) in %.2f s%s%s", self.c.round,
            len(result.group), result.duration_s, f" (failed: {landed.failure})" if landed.failure else "",
            f", eval loss {eval_loss:.4f}" if eval_loss is not None else "",
        )

    # ---- the heartbeat and the summary ----

    def record(self) -> dict:
        """What this peer tells the swarm in its heartbeat (called from the network thread).

        Losses in nats per token, `eval_loss_per_byte` in nats per byte (None until known; `loss` a moving average over about 20 inner steps, since one
        batch's loss is noisy), `tokens_per_s` over the last 30 s, byte counts since the start, `last_merge_s`
        the duration and `last_merge_time` the Unix time of the last applied merge.
        """
        return {
            "step": self.c.step, "round": self.c.round, "tokens": self.c.tokens, "loss": _finite(self.loss_avg.value),
            "eval_loss": _finite(self.last_eval_loss), "eval_loss_per_byte": self.per_byte(_finite(self.last_eval_loss)),
            "tokens_per_s": self.throughput.rate(),
            "global_tokens": self.c.global_tokens, "global_digest": self.c.global_digest, "merges": self.c.merges,
            "bytes_sent": self.bytes_io()[0], "bytes_received": self.bytes_io()[1],
            "last_group_size": self.c.last_group_size, "last_merge_s": self.c.last_merge_s,
            "last_merge_time": self.c.last_merge_time, "mfu": self.mfu(self.throughput.rate()),
        }

    def summary(self, train_s: float, global_digest: str, ended_with_swarm: bool) -> dict:
        """This peer's run in one dict (summary.json).

        Args:
            train_s: seconds from the first inner step to the end of the loop.
            global_digest: the final global model's digest.
            ended_with_swarm: the run ended on a group merge with a finishing peer.
        """
        return {
            "peer_id": self.peer_id, "inner_steps": self.c.steps_run, "step": self.c.step, "tokens": self.c.tokens,
            "first_step_s": self.first_step_s, "join_s": self.c.join_s, "ended_with_swarm": ended_with_swarm,
            "arrived_after_end": self.arrived_after_end,
            "rounds": self.c.round, "merges": self.c.merges, "merge_failures": self.c.merge_failures,
            "bytes_sent": self.bytes_io()[0], "bytes_received": self.bytes_io()[1],
            "pseudo_grad_bytes_sent": self.c.pseudo_grad_bytes_sent,
            "pseudo_grad_bytes_received": self.c.pseudo_grad_bytes_received, "state_merges": self.c.state_merges,
            "state_merges_anchored": self.c.state_merges_anchored,
            "state_merges_caught_up": self.c.state_merges_caught_up, "state_bytes_sent": self.c.state_bytes_sent,
            "state_bytes_received": self.c.state_bytes_received,
            "wall_s": self.elapsed(), "compute_s": self.c.compute_s,
            "compute_cpu_s": self.c.compute_cpu_s, "merge_wait_s": self.c.merge_wait_s,
            "land_waits": self.c.land_waits, "land_waits_landed": self.c.land_waits_landed,
            "train_s": train_s, "steps_per_s": self.c.steps_run / train_s if train_s > 0 else 0.0,
            "mode": "sync" if self.cfg.rounds.sync else "decoupled",
            "eval_loss_initial": self.eval_loss_initial, "eval_loss_final": self.eval_loss_final,
            "eval_loss_per_byte_initial": self.per_byte(self.eval_loss_initial),
            "eval_loss_per_byte_final": self.per_byte(self.eval_loss_final), "tokens_per_byte": self.tokens_per_byte,
            "global_digest": global_digest, "device": str(self.device),
            "codec": self.cfg.codec.name, **self.bandwidth(), **self.efficiency(),
        }

    def mfu(self, tokens_per_s: float) -> float | None:
        """Model FLOPs utilization at `tokens_per_s` (accel.mfu); None where the device's peak is unknown."""
        return mfu(tokens_per_s, self.flops_per_token, self.peak_flops, self.data_parallel)

    def efficiency(self) -> dict:
        """Throughput, MFU and peak memory over the whole run, for the summary."""
        tps = self.c.tokens_run / self.c.compute_s if self.c.compute_s > 0 else 0.0
        return {
            "tokens_per_s": tps, "model_flops_per_s": tps * self.flops_per_token, "mfu": self.mfu(tps),
            "peak_flops": self.peak_flops, "flops_per_token": self.flops_per_token,
            "precision": str(compute_dtype(self.device, self.cfg.run.precision)).removeprefix("torch."),
            "optimizer": self.cfg.inner.optimizer, "processes": self.data_parallel, **peak_memory(self.device),
        }

    def bandwidth(self) -> dict:
        """Traffic by kind and the ratio against data-parallel (see traffic.py); merges only without counters."""
        traffic = self.traffic
        if traffic is None:
            traffic = Traffic()
            traffic.merge.sent, traffic.merge.received = self.c.bytes_sent, self.c.bytes_received
        return {"traffic": traffic.snapshot(), "dht_by_rpc": traffic.dht_by_rpc,
                **bandwidth_report(traffic, self.c.steps_run, self.n_params, self.c.max_group_size)}

    def bytes_io(self) -> tuple[int, int]:
        """(sent, received) on p2pdiloco's protocols (merges and state transfers; merges alone without counters)."""
        if self.traffic is not None:
            return self.traffic.sent(), self.traffic.received()
        return self.c.bytes_sent, self.c.bytes_received

    def elapsed(self) -> float:
        """Seconds since the learner was built."""
        return time.monotonic() - self.t_start


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None
