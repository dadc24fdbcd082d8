"""When a round ends and when a run runs out of time: the learner's clock.

A round is `rounds.round_steps` inner steps, or, with `rounds.round_seconds = T`, lasts until the next
multiple of T in DHT time, so that peers of different speeds reach their merges together (each with as
many steps as it managed: Async Local-SGD's dynamic local updates, arXiv 2401.09135). A round of steps can be
lengthened or shortened by `shift` so that its end meets the round ends of this peer's mates (network/phase.py).
"""

from __future__ import annotations

import math
import time

from hivemind.utils.timed_storage import get_dht_time

from p2pdiloco.config import RoundsConfig


class RoundClock:
    """Round boundaries and the run's time limit.

    Args:
        rounds: round length (`round_steps`, or `round_seconds` when > 0).
        time_limit_s: seconds of training after which the run ends (0: none).
    """

    def __init__(self, rounds: RoundsConfig, time_limit_s: float):
        self.rounds, self.time_limit_s = rounds, time_limit_s
        self.t_train = time.monotonic()
        self.round_started = time.monotonic()
        self._deadline = 0.0
        self._extra_steps = 0
        """Steps added to (or, < 0, taken from) the round in progress by `shift`."""
        self._step_s = 0.0
        """Seconds per inner step in the round in progress, as last seen by `round_over`."""

    def start_training(self) -> None:
        """The time limit counts from now."""
        self.t_train = time.monotonic()

    def start_round(self) -> None:
        self.round_started = time.monotonic()
        self._extra_steps = 0
        T = self.rounds.round_seconds
        if T > 0:  # end on the swarm-wide cadence: the next multiple of T in DHT time
            self._deadline = (math.floor(get_dht_time() / T) + 1) * T

    def round_over(self, steps_in_round: int) -> bool:
        """The round that has taken `steps_in_round` inner steps so far has reached its end."""
        if self.rounds.round_seconds > 0:
            return get_dht_time() >= self._deadline
        if steps_in_round > 0:
            self._step_s = self.round_s() / steps_in_round
        return steps_in_round >= self.rounds.round_steps + self._extra_steps

    def shift(self, seconds: float) -> None:
        """End the round in progress about `seconds` later (> 0) or earlier (< 0), by at most half a round of steps
        either way; rounds of a fixed step count only (timed rounds already end on a swarm-wide cadence)."""
        if self.rounds.round_seconds > 0 or self._step_s <= 0 or seconds == 0:
            return
        half = self.rounds.round_steps // 2
        self._extra_steps = max(-half, min(half, round(seconds / self._step_s)))

    def round_s(self) -> float:
        """Wall time since this round started."""
        return time.monotonic() - self.round_started

    def out_of_time(self) -> bool:
        return self.time_limit_s > 0 and time.monotonic() - self.t_train >= self.time_limit_s
