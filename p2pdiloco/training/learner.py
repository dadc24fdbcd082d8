"""The learner: inner AdamW steps on local data, a merge every round, the outer step.

Reads like DiLoCo's Algorithm 1 (arXiv 2311.08105), decoupled: H inner steps (or a timed round), hand the
pseudo-gradient to the merger and go on training at once; when the merge lands, take the outer step and
rebase the steps taken meanwhile onto the new global model (Async Local-SGD, arXiv 2401.09135). In sync
mode the learner waits for each merge instead (OpenDiLoCo's baseline). The network is reached only through
`Merger.submit`. Metrics, the heartbeat and the summary are the `Reporter`'s (reporting.py); the checkpoint
format is checkpoint.py's.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path

import torch

from p2pdiloco.algorithm.codecs import get_codec
from p2pdiloco.algorithm.feedback import ErrorFeedback
from p2pdiloco.algorithm.outer import eager_step, outer_round, pseudo_gradient
from p2pdiloco.config import Config
from p2pdiloco.network.merger import Alone, Contribution, Merged, MergeOutcome, Merger, merged_alone
from p2pdiloco.network.peer_tag import PeerLog, short_id
from p2pdiloco.network.state_sync import GlobalState
from p2pdiloco.training.accel import autocast_for, compile_for_training
from p2pdiloco.training.checkpoint import (
    CheckpointWriter,
    feedback_residual,
    learner_checkpoint,
    learner_state,
    load_optimizer_state,
)
from p2pdiloco.training.evaluation import evaluate_flat
from p2pdiloco.training.flat import flat_params, load_flat_
from p2pdiloco.training.global_model import GlobalModel, HeldStates
from p2pdiloco.training.in_flight import InFlight, LandWait
from p2pdiloco.training.optim import InnerSchedule, build_inner_optimizer
from p2pdiloco.training.reporting import Counters, Landed, MetricsLog, Reporter
from p2pdiloco.training.rounds import RoundClock
from p2pdiloco.util.memory import release_free_memory

logger = logging.getLogger(__name__)


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

    def __init__(self, cfg: Config, model: torch.nn.Module, next_batch: Callable[[], tuple[torch.Tensor, torch.Tensor]],
                 val_batches: list[tuple[torch.Tensor, torch.Tensor]], merger: Merger, device: torch.device,
                 metrics: MetricsLog, should_stop: Callable[[], bool] = lambda: False, checkpoint_dir: Path | None = None,
                 faults: dict | None = None, t_process_start: float | None = None):
        self.cfg, self.model, self.next_batch, self.val_batches = cfg, model, next_batch, val_batches
        self.merger, self.device, self.metrics, self.should_stop = merger, device, metrics, should_stop
        self.opt = build_inner_optimizer(model.parameters(), cfg.inner, device)
        self.schedule = InnerSchedule(cfg.inner, cfg.run.total_steps)
        self.train_model: Callable[..., tuple[torch.Tensor, torch.Tensor | None]] = model
        """What inner steps run forward through: `model`, its torch.compile'd form (`run.compile`), or its DDP
        wrapper in a multi-process unit."""
        self.unit = None  # a multi-process unit's hook (distributed.py): `lead` before each step, `release` at the end
        self.model_moved = 0
        """Moves of the local model outside a merge (eager updates): a unit's other ranks follow them too."""
        self.g = GlobalModel(self._local_params(), cfg.outer, cfg.merge.state_anchors)
        s = cfg.codec
        self.feedback = ErrorFeedback(s.error_feedback and get_codec(s.name, s.sparse_keep).lossy, s.error_feedback_decay)
        """The residual of past rounds' quantization, added to the next Δ a group merge sends (feedback.py); checkpoints
        hold it."""
        self.c = Counters()
        self.report = Reporter(cfg, self.c, metrics, merger.peer_id, device, self.g.params.numel(), t_process_start)
        """Metrics lines, the heartbeat record, the summary and the bandwidth report (reporting.py)."""
        self.checkpoint_dir, self.faults = checkpoint_dir, faults or {}
        self.checkpoint_meta: Callable[[], dict] = dict  # more for its checkpoints (peer.py: its guards' trust)
        self.checkpoints = CheckpointWriter()  # written in the background; `checkpoint(wait=True)` waits
        self.held = HeldStates(self.g)  # the last states this peer held, by digest, for joiners asking for one
        self.shared = self.snapshot()
        self.tag = short_id(merger.peer_id)
        self.log = PeerLog(logger, self.tag)
        if cfg.run.compile:
            self.train_model = compile_for_training(model, self.tag)
        self.in_flight: InFlight | None = None
        self.land = LandWait(cfg.outer.land_wait)
        self.clock, self.train_s = RoundClock(cfg.rounds, cfg.run.time_limit_s), 0.0
        self.ended_with_swarm = False
        """A group merge included another peer's last contribution: the run is over (see `Merged.final`)."""
        self.last_eval: tuple[str, float] | None = None  # (digest of θg, its eval loss): see `evaluate_global`
        self.last_round_steps, self.last_round_s = 0, 0.0  # of the last round submitted (what `near_end` counts in)

    def run(self) -> dict:
        """Train until `run.total_steps`, the time limit, a stop request, or a group merge with a peer that
        finished; returns this peer's summary."""
        self.log_start()
        self.report.training_starts(eval_loss=self.evaluate_global())
        self.clock.start_training()
        self.start_round()
        while not self.at_end() and not self.should_stop():
            if self.unit is not None:  # the other processes of this unit step with us, from our θ
                self.unit.lead(self)
            self.inner_step()
            self.poll_merge()
            if self.round_done():
                self.submit_round(final=self.at_end())
                if self.cfg.rounds.sync:
                    self.wait_merge()
                else:
                    self.await_landing()
        self.train_s = time.monotonic() - self.clock.t_train
        self.finish()
        self.checkpoints.wait()  # the run's checkpoints are on disk when it returns
        if self.unit is not None:
            self.unit.release(self)
        self.report.training_ends(eval_loss=self.evaluate_global())
        return self.summary()

    def inner_step(self) -> float:
        """One AdamW step on a local batch, with the run-wide warmup + cosine schedule."""
        t0, cpu0 = time.monotonic(), time.thread_time()
        lr = self.inner_lr()
        for group in self.opt.param_groups:
            group["lr"] = lr
        x, y = self.next_batch()
        x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
        with autocast_for(self.device, self.cfg.run.precision):
            _, loss = self.train_model(x, y)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        if self.cfg.inner.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.inner.grad_clip)
        self.opt.step()
        loss_value = float(loss.detach())
        cpu_s = time.thread_time() - cpu0
        self.pace(time.monotonic() - t0)
        self.c.add_step(tokens=x.numel() * self.report.data_parallel, compute_s=time.monotonic() - t0, cpu_s=cpu_s)
        self.report.inner_step(loss_value, lr)
        return loss_value

    def inner_lr(self) -> float:
        """The lr of this inner step (see `InnerSchedule`)."""
        return self.schedule.lr(self.c.step)

    def pace(self, compute_s: float) -> None:
        """Emulate a slower accelerator (emulate.slow_factor) or a fixed step time (emulate.min_step_s) by sleeping."""
        emulate = self.cfg.emulate
        target = max(emulate.min_step_s, compute_s) * emulate.slow_factor
        if target > compute_s:
            time.sleep(target - compute_s)

    def start_round(self) -> None:
        self.c.steps_in_round = 0
        self.clock.start_round()

    def at_end(self) -> bool:
        """This peer's run is over: its step budget or time limit is reached, or it merged with a finishing peer."""
        return self.c.step >= self.cfg.run.total_steps or self.clock.out_of_time() or self.ended_with_swarm

    def near_end(self) -> bool:
        """Within about a round of this peer's own end (its step budget or time limit), by its own counters: 1.5×
        the steps, or seconds, its last submitted round took (rounds cut by time vary by a few steps, so a peer a
        little over one round from its end when its mates finish would go on alone, and its last merges alone would
        leave it on a model of its own). Only then does a group member's "final" end this peer's run: peers that
        finish together end on the same global model, and a member that says "final" at any other time, as a hostile
        peer may in every contribution, ends nobody's run."""
        if self.cfg.run.total_steps - self.c.step <= max(1, 1.5 * self.last_round_steps):
            return True
        limit = self.clock.time_limit_s
        return limit > 0 and limit - (time.monotonic() - self.clock.t_train) <= 1.5 * self.last_round_s

    def round_done(self) -> bool:
        """True when this round should be submitted; never while a merge is still in flight."""
        if self.in_flight is not None or self.c.steps_in_round == 0 or self.ended_with_swarm:
            return False
        return self.clock.round_over(self.c.steps_in_round)

    # ---- merge scheduling: submit, poll, wait; the outer step when a merge lands ----

    def submit_round(self, final: bool = False) -> None:
        """Hand Δ to the merger and start the next round at once; the merge runs in the background.

        Args:
            final: this is the peer's last contribution of the run (see `Contribution.final`).
        """
        local = self._local_params()
        delta = pseudo_gradient(self.g.params, local)
        contribution = Contribution(
            pseudo_grad=delta, weight=float(self.c.tokens_in_round),
            global_params=self.g.params, momentum=self.g.momentum, state_digest=self.g.digest(),
            state_weight=self.c.global_tokens, anchors=self.g.anchors(), round=self.c.round, round_s=self.clock.round_s(), final=final,
            closing=self.near_end(), compensated=self.feedback.compensate(delta))
        future = self.merger.submit(contribution)
        if self.cfg.outer.eager and not self.cfg.rounds.sync:
            local = self._eager(contribution.pseudo_grad)
        self.in_flight = InFlight(future, local, contribution, time.monotonic(), self.c.compute_in_round,
                                  self.merger.peer_id, self.merge_bound())
        self.last_round_steps, self.last_round_s = self.c.steps_in_round, self.clock.round_s()
        self.c.tokens_in_round = 0
        self.c.compute_in_round = 0.0
        self.start_round()

    def _eager(self, own_delta: torch.Tensor) -> torch.Tensor:
        """Eager update: go on from the outer step on this peer's own Δ (`outer.eager_step`); returns that
        θ_at_submit."""
        eager = eager_step(self.g.params, self.g.momentum, own_delta, self.cfg.outer)
        load_flat_(self.model, eager)
        self.model_moved += 1  # a unit's other ranks take the new θ before their next step (distributed.py)
        return eager

    def poll_merge(self) -> None:
        """Apply the merge in flight if it has finished (or hung); never waits."""
        result = self.in_flight.result() if self.in_flight is not None else None
        if result is not None:
            self._apply_in_flight(result)

    def await_landing(self) -> None:
        """Decoupled: wait up to `outer.land_wait` of a round for the merge just submitted, where merges can land
        within it (`LandWait`): one that lands in time leaves no step in flight."""
        if self.in_flight is None or not self.land.due(self.last_round_s):
            return
        self.c.merge_wait_s += self.in_flight.wait_up_to(self.land.bound_s(self.last_round_s))
        landed = self.in_flight.future.done()
        self.c.land_waits += 1
        self.c.land_waits_landed += landed
        self.poll_merge()

    def merge_bound(self) -> float:
        """No merge can legitimately take longer: the window, two exchange phases, and slack."""
        return self.cfg.merge.merge_window_s + 2 * self.cfg.merge.merge_timeout_s + 30

    def wait_merge(self) -> bool:
        """Block until the merge in flight finishes and apply it; False if told to stop first (merge dropped)."""
        if self.in_flight is None:
            return True
        t0 = time.monotonic()
        result = self.in_flight.wait(self.should_stop)
        if result is None:
            self.in_flight = None
            return False
        self.c.merge_wait_s += time.monotonic() - t0
        self._apply_in_flight(result)
        return True

    def finish(self) -> None:
        """End of training: land the merge in flight and the last partial round (told to stop: `InFlight.at_stop`)."""
        if self.should_stop():
            if self.in_flight and (m := self.in_flight.at_stop(self.merger, self.cfg.merge.merge_timeout_s)):
                self._apply_in_flight(m)
            self.in_flight = None
            return
        if self.wait_merge() and self.c.tokens_in_round > 0 and not self.should_stop() and not self.ended_with_swarm:
            self.submit_round(final=True)
            self.wait_merge()

    def _apply_in_flight(self, outcome: MergeOutcome) -> None:
        flight, self.in_flight = self.in_flight, None
        self.land.record(outcome)
        if isinstance(outcome, Merged):  # a merge alone sent nothing: the residual goes out with the next group merge
            target = flight.contribution.compensated  # what the merge was handed to send
            self.feedback.commit(target, target if outcome.sent is None else outcome.sent)
        landed = self.apply_merge(outcome, flight.local_at_submit, flight.contribution)
        landed.phase_shift_s = self.merger.take_round_shift()
        self.clock.shift(landed.phase_shift_s)  # toward the mates' round ends (network/phase.py)
        if landed.merged.final and not landed.alone and not flight.contribution.final:
            if self.near_end():
                self.ended_with_swarm = True  # the steps taken since this contribution are not in any global model
                self.log.info("merged with a peer that finished its run: ending at step %d", self.c.step)
            else:  # a claim from another peer, which may lie; only this peer's own counters end its run
                self.log.warning("a member of group %s said the run is over, but this peer is at step %d of %d: "
                                 "going on", landed.stats.group_id, self.c.step, self.cfg.run.total_steps)
        self.report.merge(landed, flight.compute_s, self.c.global_digest, self.scheduled_eval())
        if self.checkpoint_due():
            self.checkpoint()
        release_free_memory()  # the round's freed buffers: kept by malloc between rounds, they look like growth

    def apply_merge(self, outcome: MergeOutcome, local_at_submit: torch.Tensor | None = None,
                    contribution: Contribution | None = None) -> Landed:
        """Outer Nesterov step on the merged Δ̄, then move the local model onto the new θg.

        Args:
            outcome: the merge.
            local_at_submit: the local model when Δ was taken. `outer.rebase_keep` of the inner steps taken
                since then is kept: θ ← θg + keep·(θ − θ_at_submit); in sync mode there are none, so θ ← θg
                exactly. None restarts from θg regardless.
            contribution: what was submitted (a merge alone steps on its Δ).

        Returns:
            the merge as applied, for the counters and the metrics.
        """
        alone = isinstance(outcome, Alone)
        merged = merged_alone(contribution, outcome.stats) if alone else outcome
        landed = Landed(merged, alone, outcome.reason if alone else "")
        done = outer_round(self.g.params, self.g.momentum, merged.average, self.cfg.outer, alone=alone,
                           agreed_state=merged.agreed_state, own_weight=self.c.global_tokens,
                           longest_recent=self.g.longest_recent, local_now=self._local_params(),
                           local_at_submit=local_at_submit)
        self.g.take(done)
        if done.adopted:
            if merged.agreed_state is not None:  # members disagreed: the group's agreed global model was adopted
                self.c.global_tokens = max(self.c.global_tokens, merged.state_weight)
                landed.adopted_state = True
        else:
            self.log.warning("refused group %s's averaged global model: farther from ours than any honest "
                             "divergence (see algorithm/outer.py, state_within_reach)", merged.stats.group_id)
            landed.state_refused = True
        load_flat_(self.model, done.local)
        self.c.rebase_dropped_s = self.c.compute_in_round * (1.0 - done.keep)  # of the steps taken since the submit
        self.c.add_merge(landed)
        self.c.global_digest = self.g.digest()
        self.shared = self.snapshot()
        return landed

    # ---- state: sharing with joiners, adopting the swarm's, checkpoints ----

    def snapshot(self) -> GlobalState:
        """This peer's global state as of its last merge (tensors are replaced, never mutated, so the
        network thread may read the returned object while training goes on)."""
        return self.held.note(GlobalState(self.g.params, self.g.momentum, self.c.round, self.c.step,
                                          self.c.global_tokens))

    def adopt_state(self, state: GlobalState) -> None:
        """Continue from the swarm's state (a joiner, or a resumed peer that finds the swarm ahead)."""
        self.g.adopt(state.global_params, state.momentum)
        load_flat_(self.model, self.g.params)
        self.c.round, self.c.step, self.c.global_tokens = state.round, state.step, state.global_tokens
        self.c.global_digest = self.g.digest()
        self.shared = self.snapshot()
        self.schedule.joined_at(state.step)

    def checkpoint_due(self) -> bool:
        """A checkpoint is due after this round's merge (every `run.checkpoint_every` rounds)."""
        every = self.cfg.run.checkpoint_every
        return self.checkpoint_dir is not None and bool(every) and self.c.round % every == 0

    def checkpoint(self, wait: bool = False) -> Path | None:
        """θg, momentum, optimizer state and counters (checkpoint.py), written in the background; `wait`: on disk."""
        kill = self.faults.get(("checkpoint", self.c.round)) == "kill"
        tensors, meta = learner_checkpoint(self.snapshot(), self.c.tokens, self.opt, list(self.model.parameters()),
                                           self.cfg.to_dict(), extra={**self.checkpoint_meta(), "eval": self.last_eval},
                                           residual=self.feedback.residual)
        self.checkpoints.submit(self.checkpoint_dir, self.c.round, tensors, meta, kill_midway=kill)
        return self.checkpoints.wait() if wait else None

    def restore(self, tensors: dict[str, torch.Tensor], meta: dict) -> None:
        """Continue from a checkpoint: the local model restarts from its global model."""
        state, tokens = learner_state(tensors, meta)
        self.adopt_state(state)
        self.c.tokens, self.last_eval = tokens, tuple(meta["eval"]) if meta.get("eval") else None  # θg's, if measured
        self.feedback.residual = feedback_residual(tensors, self.g.params.numel())
        if load_optimizer_state(self.opt, list(self.model.parameters()), tensors):
            self.schedule.moments_restored()

    def _local_params(self) -> torch.Tensor:
        return flat_params(self.model)

    # ---- evaluation ----

    def evaluate_global(self) -> float:
        """Validation loss of the global model θg (the local model may have moved on since the last merge), measured
        once a state of θg: `last_eval` holds the last one (peer.py sets it to the built model's, which is θg)."""
        if self.last_eval is None or self.last_eval[0] != self.g.digest():
            loss = evaluate_flat(self.model, self.g.params, self.val_batches, self.device, self.cfg.run.precision)
            self.last_eval = (self.g.digest(), loss)
        return self.last_eval[1]

    def scheduled_eval(self) -> float | None:
        """`evaluate_global` every `run.eval_every_rounds` rounds, else None."""
        every = self.cfg.run.eval_every_rounds
        return self.evaluate_global() if every and self.c.round % every == 0 else None

    # ---- reporting (reporting.py) ----

    def log_start(self, startup: dict[str, float] | None = None) -> None:
        """The metrics' `start` line, once (see `Reporter.start`)."""
        self.report.start(startup)

    def summary(self) -> dict:
        """This peer's run in one dict (see `Reporter.summary`)."""
        return self.report.summary(self.train_s, self.g.digest(), self.ended_with_swarm)

    @property
    def global_params(self) -> torch.Tensor:
        """Flat fp32 θg as of the last merge (read-only: `g` steps it)."""
        return self.g.params

    @property
    def momentum(self) -> torch.Tensor:
        """Flat fp32 outer momentum as of the last merge."""
        return self.g.momentum
