"""The learner: inner AdamW steps on local data, a merge every round, the outer step, metrics.

Reads like DiLoCo's Algorithm 1 (arXiv 2311.08105), decoupled: H inner steps (or a timed round), hand the
pseudo-gradient to the merger and go on training at once; when the merge lands, take the outer step and
rebase the steps taken meanwhile onto the new global model (Async Local-SGD, arXiv 2401.09135). In sync
mode the learner waits for each merge instead (OpenDiLoCo's baseline). The network is reached only through
`Merger.submit`.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from pathlib import Path

import torch
from hivemind.utils.timed_storage import get_dht_time
from torch.nn.utils import parameters_to_vector

from p2pdiloco.algorithm.outer import cosine_lr, outer_step, pseudo_gradient, rebase, state_digest
from p2pdiloco.config import Config
from p2pdiloco.network.merger import Contribution, Merger, MergeResult
from p2pdiloco.network.state_sync import GlobalState
from p2pdiloco.network.traffic import Traffic, bandwidth_report
from p2pdiloco.observe.telemetry import Ema, RateMeter
from p2pdiloco.training.accel import (
    autocast_for,
    compute_dtype,
    flops_per_token,
    mfu,
    peak_flops,
    peak_memory,
)
from p2pdiloco.training.accel import pick_device as pick_device  # re-exported: callers found it here first
from p2pdiloco.training.checkpoint import load_optimizer_state, optimizer_state_tensors, save_checkpoint
from p2pdiloco.training.optim import build_inner_optimizer

logger = logging.getLogger(__name__)


@torch.no_grad()
def load_flat_(model: torch.nn.Module, flat: torch.Tensor) -> None:
    """Copy a flat fp32 vector into the model's parameters.

    Copies, unlike torch's vector_to_parameters, which on CPU would make the parameters views of `flat`
    so that inner steps would silently rewrite the global model.
    """
    offset = 0
    for p in model.parameters():
        n = p.numel()
        p.copy_(flat[offset : offset + n].view_as(p))
        offset += n
    if offset != flat.numel():
        raise ValueError(f"flat vector has {flat.numel()} values, model has {offset}")


@torch.no_grad()
def evaluate_model(model: torch.nn.Module, val_batches: list[tuple[torch.Tensor, torch.Tensor]],
                   device: torch.device, precision: str = "auto") -> float:
    """Mean validation loss (nats per byte) of `model` over `val_batches`; NaN if there are none.

    The one definition of eval loss, shared by the learner and the data-parallel baseline of `bench parity`,
    so that their figures are comparable.
    """
    model.eval()
    losses = []
    for x, y in val_batches:
        with autocast_for(device, precision):
            _, loss = model(x.to(device), y.to(device))
        losses.append(float(loss))
    model.train()
    return sum(losses) / len(losses) if losses else float("nan")


class MetricsLog:
    """Append-only JSON lines, flushed per line so that a crash loses at most the line being written."""

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = path.open("a", buffering=1)

    def write(self, **fields) -> None:
        self._file.write(json.dumps({"t": time.time(), **fields}) + "\n")

    def close(self) -> None:
        self._file.close()


@dataclass
class Counters:
    step: int = 0
    round: int = 0
    tokens: int = 0
    tokens_in_round: int = 0
    steps_in_round: int = 0
    merges: int = 0
    merge_failures: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    compute_s: float = 0.0
    merge_wait_s: float = 0.0
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
    join_s: float | None = None
    """Seconds from process start to the first merge with other peers."""


@dataclass
class InFlight:
    """A submitted round whose merge has not been applied yet."""

    future: Future
    local_at_submit: torch.Tensor
    contribution: Contribution
    submitted_at: float
    compute_s: float
    """Inner-step time that produced this contribution (what is lost if it never reaches a global model)."""


class Learner:
    """One peer's training loop.

    Args:
        cfg: the run's config.
        model: the model, already on `device`, with the swarm's initial weights.
        next_batch: returns (inputs, targets) on CPU, shape [batch, seq_len].
        val_batches: fixed validation batches (the same on every peer).
        merger: the network, behind `Merger.submit`.
        device: where inner steps run.
        metrics: where metrics lines go.
        should_stop: polled between steps; True ends the run early (Ctrl+C, SIGTERM).
        checkpoint_dir: where to save checkpoints every `run.checkpoint_every` rounds (None: never).
        faults: test hook, {(stage, round): action}; stage 'checkpoint' with action 'kill' dies mid-write.
        t_process_start: time.monotonic() when the peer process started (for join_s); default now.
    """

    def __init__(
        self,
        cfg: Config,
        model: torch.nn.Module,
        next_batch: Callable[[], tuple[torch.Tensor, torch.Tensor]],
        val_batches: list[tuple[torch.Tensor, torch.Tensor]],
        merger: Merger,
        device: torch.device,
        metrics: MetricsLog,
        should_stop: Callable[[], bool] = lambda: False,
        checkpoint_dir: Path | None = None,
        faults: dict | None = None,
        t_process_start: float | None = None,
    ):
        self.cfg, self.model, self.next_batch, self.val_batches = cfg, model, next_batch, val_batches
        self.merger, self.device, self.metrics, self.should_stop = merger, device, metrics, should_stop
        self.opt = build_inner_optimizer(model.parameters(), cfg.inner, device)
        self.train_model: torch.nn.Module = model
        """What inner steps run forward through: `model`, or its DDP wrapper in a multi-process unit."""
        self.unit = None
        """A multi-process learner unit's hook (distributed.py): `lead` before each inner step, `release` at the end."""
        self.data_parallel = 1
        """Processes whose batches each inner step averages (tokens per step = batch tokens × this)."""
        self.flops_per_token = flops_per_token(cfg.model, sum(p.numel() for p in model.parameters()))
        self.peak_flops = peak_flops(device, cfg.run.peak_flops)
        self.global_params = self._local_params()
        self.momentum = torch.zeros_like(self.global_params)
        self.c = Counters()
        self.t_start = time.monotonic()
        self.loss_avg = Ema(span=20)
        self.t_process_start = t_process_start if t_process_start is not None else self.t_start
        self.checkpoint_dir, self.faults = checkpoint_dir, faults or {}
        self.shared = self.snapshot()
        self.traffic: Traffic | None = None
        """This peer's byte counters by kind (merges, state transfers, DHT), when it has a real network."""
        self.eval_loss_initial = float("nan")
        self.eval_loss_final = float("nan")
        self.last_eval_loss = float("nan")
        self.throughput = RateMeter()
        self._loss_sum, self._loss_n, self._t_log, self._tokens_log = 0.0, 0, time.monotonic(), 0
        self.tag = merger.peer_id[-6:]
        self.in_flight: InFlight | None = None
        self.t_train = time.monotonic()
        self.train_s = 0.0
        self._round_deadline = 0.0
        self._round_started = time.monotonic()
        self._moments_fresh = True
        """The inner optimizer has no moments from earlier training (a new process, not a checkpoint)."""
        self._rewarm_from: int | None = None
        """The step at which this peer adopted the swarm's state with fresh moments (see `inner_lr`)."""
        self.ended_with_swarm = False
        """A group merge included another peer's last contribution: the run is over (see `MergeResult.final`)."""
        self._started = False

    # ---- the loop ----

    def log_start(self, startup: dict[str, float] | None = None) -> None:
        """The metrics' `start` line, once, as early as the peer can write it (before a state download, so that
        everything from the process start on belongs to this incarnation when a metrics file holds several).

        Args:
            startup: seconds per start-up phase so far, for the record.
        """
        if not self._started:
            self._started = True
            self.metrics.write(kind="start", elapsed_s=self.elapsed(), step=self.c.step, round=self.c.round,
                               process_s=time.monotonic() - self.t_process_start, peer_id=self.merger.peer_id,
                               **({"startup": startup} if startup else {}))

    def run(self) -> dict:
        """Train until `run.total_steps`, the time limit, a stop request, or a group merge with a peer that
        finished; returns this peer's summary."""
        self.log_start()
        self.eval_loss_initial = self.evaluate_global()
        self.metrics.write(kind="eval", elapsed_s=self.elapsed(), step=self.c.step, tokens=self.c.tokens,
                           eval_loss=self.eval_loss_initial)
        self.last_eval_loss = self.eval_loss_initial
        logger.info("[%s] eval loss at start %.4f", self.tag, self.eval_loss_initial)
        self.t_train = time.monotonic()
        self.throughput.add(self.c.tokens)
        self.start_round()
        while not self.at_end() and not self.should_stop():
            if self.unit is not None:  # the other processes of this unit step with us, from our θ
                self.unit.lead(self)
            self.inner_step()
            self.poll_merge()
            if self.round_done():
                self.submit_round(final=self.at_end())
                if self.cfg.swarm.sync:
                    self.wait_merge()
        self.train_s = time.monotonic() - self.t_train
        self.finish()
        if self.unit is not None:
            self.unit.release(self)
        self.eval_loss_final = self.last_eval_loss = self.evaluate_global()
        self.metrics.write(
            kind="eval", elapsed_s=self.elapsed(), step=self.c.step, tokens=self.c.tokens, eval_loss=self.eval_loss_final,
            final=True,
        )
        return self.summary()

    def inner_step(self) -> float:
        """One AdamW step on a local batch, with the run-wide warmup + cosine schedule."""
        t0 = time.monotonic()
        inner = self.cfg.inner
        lr = self.inner_lr()
        for group in self.opt.param_groups:
            group["lr"] = lr
        x, y = self.next_batch()
        x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
        with autocast_for(self.device, self.cfg.run.precision):
            _, loss = self.train_model(x, y)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        if inner.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), inner.grad_clip)
        self.opt.step()
        loss_value = float(loss.detach())
        self.pace(time.monotonic() - t0)
        self.c.compute_s += time.monotonic() - t0
        self.c.compute_in_round += time.monotonic() - t0
        self.c.steps_run += 1
        self.c.step += 1
        self.c.steps_in_round += 1
        self.c.tokens += x.numel() * self.data_parallel
        self.c.tokens_in_round += x.numel() * self.data_parallel
        self.c.tokens_run += x.numel() * self.data_parallel
        self.throughput.add(self.c.tokens)
        self.loss_avg.add(loss_value)
        self._loss_sum += loss_value
        self._loss_n += 1
        if self.c.step % self.cfg.run.log_every == 0:
            self.log_train(lr)
        return loss_value

    def inner_lr(self) -> float:
        """The run-wide schedule's lr at this step, re-warmed after joining a swarm with empty AdamW moments.

        A joiner adopts the swarm's step (deep into the schedule) but starts with zero moments; Adam's first
        bias-corrected updates are then ±lr on every coordinate, a shock to the model it just downloaded.
        It ramps the lr up linearly again over `inner.warmup_steps` from where it joined.
        """
        inner = self.cfg.inner
        lr = cosine_lr(self.c.step, inner.lr, inner.warmup_steps, self.cfg.run.total_steps, inner.min_lr_ratio)
        if self._rewarm_from is not None and inner.warmup_steps > 0:
            since = self.c.step - self._rewarm_from
            if since < inner.warmup_steps:
                return lr * (since + 1) / inner.warmup_steps
            self._rewarm_from = None
        return lr

    def pace(self, compute_s: float) -> None:
        """Emulate a slower accelerator (emulate.slow_factor) or a fixed step time (emulate.min_step_s) by sleeping."""
        emulate = self.cfg.emulate
        target = max(emulate.min_step_s, compute_s) * emulate.slow_factor
        if target > compute_s:
            time.sleep(target - compute_s)

    def start_round(self) -> None:
        self.c.steps_in_round = 0
        self._round_started = time.monotonic()
        T = self.cfg.swarm.round_seconds
        if T > 0:  # end on the swarm-wide cadence: the next multiple of T in DHT time
            self._round_deadline = (math.floor(get_dht_time() / T) + 1) * T

    def at_end(self) -> bool:
        """This peer's run is over: its step budget or time limit is reached, or it merged with a finishing peer."""
        return self.c.step >= self.cfg.run.total_steps or self.out_of_time() or self.ended_with_swarm

    def round_done(self) -> bool:
        """True when this round should be submitted; never while a merge is still in flight."""
        if self.in_flight is not None or self.c.steps_in_round == 0 or self.ended_with_swarm:
            return False
        if self.cfg.swarm.round_seconds > 0:
            return get_dht_time() >= self._round_deadline
        return self.c.steps_in_round >= self.cfg.swarm.round_steps

    def submit_round(self, final: bool = False) -> None:
        """Hand Δ to the merger and start the next round at once; the merge runs in the background.

        Args:
            final: this is the peer's last contribution of the run (see `Contribution.final`).
        """
        local = self._local_params()
        contribution = Contribution(
            pseudo_grad=pseudo_gradient(self.global_params, local),
            weight=float(self.c.tokens_in_round),
            global_params=self.global_params,
            momentum=self.momentum,
            state_digest=self.global_digest(),
            state_weight=self.c.global_tokens,
            round=self.c.round,
            round_s=time.monotonic() - self._round_started,
            final=final,
        )
        self.in_flight = InFlight(self.merger.submit(contribution), local, contribution, time.monotonic(),
                                  self.c.compute_in_round)
        self.c.tokens_in_round = 0
        self.c.compute_in_round = 0.0
        self.start_round()

    def poll_merge(self) -> None:
        """Apply the merge in flight if it has finished; never waits."""
        if self.in_flight is None:
            return
        if self.in_flight.future.done():
            self._apply_in_flight(self.in_flight.future.result())
        elif time.monotonic() - self.in_flight.submitted_at > self._merge_bound():
            self._apply_in_flight(self._hung_merge())

    def _merge_bound(self) -> float:
        """No merge can legitimately take longer: the window, two exchange phases, and slack."""
        return self.cfg.swarm.merge_window_s + 2 * self.cfg.swarm.merge_timeout_s + 30

    def _hung_merge(self) -> MergeResult:
        """A merger bug must not stop this peer from ever merging again: give up on it, keep our own update."""
        logger.error("[%s] merge did not finish in %.0f s; merging alone", self.tag, self._merge_bound())
        self.in_flight.future.cancel()
        c = self.in_flight.contribution
        return MergeResult(group=[self.merger.peer_id], pseudo_grad=c.pseudo_grad, total_weight=c.weight,
                           failure="merger hung")

    def wait_merge(self) -> bool:
        """Block until the merge in flight finishes and apply it; False if told to stop first (merge dropped)."""
        if self.in_flight is None:
            return True
        t0 = time.monotonic()
        while True:
            try:
                result = self.in_flight.future.result(timeout=0.2)
                break
            except FutureTimeout:
                if self.should_stop():
                    self.in_flight.future.cancel()
                    self.in_flight = None
                    return False
                if time.monotonic() - self.in_flight.submitted_at > self._merge_bound():
                    result = self._hung_merge()
                    break
        self.c.merge_wait_s += time.monotonic() - t0
        self._apply_in_flight(result)
        return True

    def finish(self) -> None:
        """End of training: land the merge in flight and the last partial round, unless told to stop."""
        if self.should_stop():
            if self.in_flight is not None:
                self.in_flight.future.cancel()
                self.in_flight = None
            return
        if self.wait_merge() and self.c.tokens_in_round > 0 and not self.should_stop() and not self.ended_with_swarm:
            self.submit_round(final=True)
            self.wait_merge()

    def _apply_in_flight(self, result: MergeResult) -> None:
        flight, self.in_flight = self.in_flight, None
        self.apply_merge(result, flight.local_at_submit)
        if result.final and not result.alone and not flight.contribution.final:
            self.ended_with_swarm = True  # the steps taken since this contribution are not in any global model
            logger.info("[%s] merged with a peer that finished its run: ending at step %d", self.tag, self.c.step)
        if not result.alone and self.c.join_s is None:
            self.c.join_s = time.monotonic() - self.t_process_start
        self.log_merge(result, flight.compute_s)
        every = self.cfg.run.checkpoint_every
        if self.checkpoint_dir is not None and every and self.c.round % every == 0:
            self.checkpoint()

    def apply_merge(self, result: MergeResult, local_at_submit: torch.Tensor | None = None) -> None:
        """Outer Nesterov step on the merged Δ̄, then move the local model onto the new θg.

        Args:
            result: the merge.
            local_at_submit: the local model when Δ was taken. Inner steps taken since then are kept:
                θ ← θg + (θ − θ_at_submit); in sync mode there are none, so θ ← θg exactly. None
                restarts from θg regardless.
        """
        n = self.global_params.numel()
        if result.global_state is not None:  # members disagreed: adopt the group's averaged global model
            self.global_params = result.global_state[:n].clone()
            self.momentum = result.global_state[n:].clone()
            self.c.global_tokens = max(self.c.global_tokens, result.state_weight)
        outer = self.cfg.outer
        self.global_params, self.momentum = outer_step(
            self.global_params, self.momentum, result.pseudo_grad, outer.lr, outer.momentum, outer.nesterov
        )
        if local_at_submit is None:
            load_flat_(self.model, self.global_params)
        else:
            load_flat_(self.model, rebase(self.global_params, self._local_params(), local_at_submit))
        self.c.round += 1
        self.c.global_tokens += result.total_weight
        self.c.merges += 0 if result.alone else 1
        self.c.merge_failures += 1 if result.failure else 0
        self.c.bytes_sent += result.bytes_sent
        self.c.bytes_received += result.bytes_received
        self.c.last_group_size = len(result.group)
        self.c.max_group_size = max(self.c.max_group_size, len(result.group))
        self.c.last_merge_s = result.duration_s
        self.c.last_merge_time = time.time()
        self.shared = self.snapshot()

    # ---- state: sharing with joiners, adopting the swarm's, checkpoints ----

    def snapshot(self) -> GlobalState:
        """This peer's global state as of its last merge (tensors are replaced, never mutated, so the
        network thread may read the returned object while training goes on)."""
        return GlobalState(self.global_params, self.momentum, self.c.round, self.c.step, self.c.global_tokens)

    def adopt_state(self, state: GlobalState) -> None:
        """Continue from the swarm's state (a joiner, or a resumed peer that finds the swarm ahead)."""
        if state.global_params.numel() != self.global_params.numel():
            raise ValueError("state does not fit this model")
        self.global_params, self.momentum = state.global_params.clone(), state.momentum.clone()
        load_flat_(self.model, self.global_params)
        self.c.round, self.c.step, self.c.global_tokens = state.round, state.step, state.global_tokens
        self.shared = self.snapshot()
        if self._moments_fresh and state.step > 0:
            self._rewarm_from = state.step

    def checkpoint(self) -> Path:
        """Save θg, outer momentum, inner AdamW state and counters (see checkpoint.py)."""
        tensors = {"global_params": self.global_params, "momentum": self.momentum,
                   **optimizer_state_tensors(self.opt, list(self.model.parameters()))}
        meta = {"round": self.c.round, "step": self.c.step, "tokens": self.c.tokens,
                "global_tokens": self.c.global_tokens, "config": self.cfg.to_dict()}
        kill = self.faults.get(("checkpoint", self.c.round)) == "kill"
        return save_checkpoint(self.checkpoint_dir, self.c.round, tensors, meta, kill_midway=kill)

    def restore(self, tensors: dict[str, torch.Tensor], meta: dict) -> None:
        """Continue from a checkpoint: the local model restarts from its global model."""
        self.adopt_state(GlobalState(tensors["global_params"], tensors["momentum"], int(meta["round"]),
                                     int(meta["step"]), float(meta["global_tokens"])))
        self.c.tokens = int(meta.get("tokens", 0))
        if load_optimizer_state(self.opt, list(self.model.parameters()), tensors):
            self._moments_fresh, self._rewarm_from = False, None

    def out_of_time(self) -> bool:
        limit = self.cfg.run.time_limit_s
        return limit > 0 and time.monotonic() - self.t_train >= limit

    # ---- measurements ----

    def evaluate(self) -> float:
        """Mean validation loss of the model as it is now."""
        return evaluate_model(self.model, self.val_batches, self.device, self.cfg.run.precision)

    def evaluate_global(self) -> float:
        """Validation loss of the global model θg (the local model may have moved on since the last merge)."""
        local = self._local_params()
        load_flat_(self.model, self.global_params)
        try:
            return self.evaluate()
        finally:
            load_flat_(self.model, local)

    def log_train(self, lr: float) -> None:
        now = time.monotonic()
        tps = (self.c.tokens - self._tokens_log) / max(now - self._t_log, 1e-9)
        self.metrics.write(
            kind="train", elapsed_s=self.elapsed(), step=self.c.step, round=self.c.round, tokens=self.c.tokens,
            loss=self._loss_sum / max(self._loss_n, 1), lr=lr, tokens_per_s=tps,
            model_flops_per_s=tps * self.flops_per_token, mfu=self.mfu(tps),
            bytes_sent=self.bytes_io()[0], bytes_received=self.bytes_io()[1], merges=self.c.merges,
        )
        self._loss_sum, self._loss_n, self._t_log, self._tokens_log = 0.0, 0, now, self.c.tokens

    def log_merge(self, result: MergeResult, round_compute_s: float = 0.0) -> None:
        every = self.cfg.run.eval_every_rounds
        eval_loss = self.evaluate_global() if every and self.c.round % every == 0 else None
        if eval_loss is not None:
            self.last_eval_loss = eval_loss
        self.metrics.write(
            kind="merge", elapsed_s=self.elapsed(), step=self.c.step, round=self.c.round, tokens=self.c.tokens,
            group_size=len(result.group), group_id=result.group_id, merges=self.c.merges, failure=result.failure,
            merge_s=result.duration_s, bytes_sent=self.bytes_io()[0], bytes_received=self.bytes_io()[1],
            global_digest=self.global_digest(), adopted_state=result.global_state is not None, eval_loss=eval_loss,
            round_compute_s=round_compute_s, rejected=result.rejected, final=result.final,
            **({"traffic": self.traffic.snapshot()} if self.traffic else {}),
        )
        logger.info(
            "[%s] round %d: merged with %d peer(s) in %.2f s%s%s", self.tag, self.c.round,
            len(result.group), result.duration_s, f" (failed: {result.failure})" if result.failure else "",
            f", eval loss {eval_loss:.4f}" if eval_loss is not None else "",
        )

    def bytes_io(self) -> tuple[int, int]:
        """(sent, received) on p2pdiloco's protocols (merges and state transfers; merges alone without counters)."""
        if self.traffic is not None:
            return self.traffic.sent(), self.traffic.received()
        return self.c.bytes_sent, self.c.bytes_received

    def elapsed(self) -> float:
        return time.monotonic() - self.t_start

    def global_digest(self) -> str:
        return state_digest(self.global_params, self.momentum)

    def record(self) -> dict:
        """What this peer tells the swarm in its heartbeat (called from the network thread).

        Losses in nats per byte (None until known; `loss` a moving average over about 20 inner steps, since one
        batch's loss is noisy), `tokens_per_s` over the last 30 s, byte counts since the start, `last_merge_s`
        the duration and `last_merge_time` the Unix time of the last applied merge.
        """
        return {
            "step": self.c.step, "round": self.c.round, "tokens": self.c.tokens, "loss": _finite(self.loss_avg.value),
            "eval_loss": _finite(self.last_eval_loss), "tokens_per_s": self.throughput.rate(),
            "global_tokens": self.c.global_tokens, "merges": self.c.merges,
            "bytes_sent": self.bytes_io()[0], "bytes_received": self.bytes_io()[1],
            "last_group_size": self.c.last_group_size, "last_merge_s": self.c.last_merge_s,
            "last_merge_time": self.c.last_merge_time, "mfu": self.mfu(self.throughput.rate()),
        }

    def summary(self) -> dict:
        return {
            "peer_id": self.merger.peer_id, "inner_steps": self.c.steps_run, "step": self.c.step, "tokens": self.c.tokens,
            "join_s": self.c.join_s, "ended_with_swarm": self.ended_with_swarm,
            "rounds": self.c.round, "merges": self.c.merges, "merge_failures": self.c.merge_failures,
            "bytes_sent": self.bytes_io()[0], "bytes_received": self.bytes_io()[1],
            "wall_s": self.elapsed(), "compute_s": self.c.compute_s, "merge_wait_s": self.c.merge_wait_s,
            "train_s": self.train_s, "steps_per_s": self.c.steps_run / self.train_s if self.train_s > 0 else 0.0,
            "mode": "sync" if self.cfg.swarm.sync else "decoupled",
            "eval_loss_initial": self.eval_loss_initial, "eval_loss_final": self.eval_loss_final,
            "global_digest": self.global_digest(), "device": str(self.device),
            "codec": self.cfg.swarm.codec, **self.bandwidth(), **self.efficiency(),
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
        n_params = self.global_params.numel()
        return {"traffic": traffic.snapshot(),
                **bandwidth_report(traffic, self.c.steps_run, n_params, self.c.max_group_size)}

    def _local_params(self) -> torch.Tensor:
        return parameters_to_vector(self.model.parameters()).detach().float().cpu().clone()


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None
