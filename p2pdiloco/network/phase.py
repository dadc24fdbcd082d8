"""Where this peer's rounds end relative to its mates': the shift that brings its next round end to theirs.

With rounds of `rounds.round_steps` inner steps, a peer's rounds end wherever its own steps take them. Peers of
equal speed keep whatever phase they have, and a decoupled search waits only a fraction of a round
(`search.Window`): two halves of a swarm whose round ends drifted half a round apart never meet again. Each
half merges within itself, no merge is alone (so no window widens), and their global models drift apart until
the run's last merge. Without the shift the README's run did this in about one run of ten (docs/benchmarks.md,
"The README's run").

Round ends move instead of searches waiting longer (a longer window held merges up: docs/experiments.md, "A wider
search window"): a mate's
word that it is looking for a group (`ready`) arrives when its round ended, so its arrival time, taken modulo this
peer's round length, is the mate's phase relative to this peer's. When its merge is over, this peer takes the
median of its mates' phases and its own (0) and ends its current round that much later or earlier
(`RoundClock.shift`): two halves each move half-way and meet at the next round end; peers already together stay
put (a dead zone). Not earlier, at its round end: mates whose rounds ended a moment after its own would not have
been heard in this round yet, and an older word of theirs would place them a round off.

Only the time a mate's word arrived is used, on this peer's clock: nothing a peer claims. A liar can move the
median only with half the mates, and only the moment a round ends, never what is merged.
"""

from __future__ import annotations

import statistics
import time

DEAD_ZONE = 1 / 16
"""A median phase within this fraction of a round of this peer's is left alone: peers that meet already."""
ROUNDS_KEPT = 6
"""Round ends kept to measure this peer's round length (the median of the last 5)."""


def phase_of(heard_at: float, now: float, period: float) -> float:
    """A mate's phase relative to this peer's, in seconds in [-period/2, period/2): positive when its rounds end
    later than this peer's. `heard_at`: when its last `ready` arrived; `now`: when this peer's round ended."""
    return (heard_at - now + period / 2) % period - period / 2


class Phase:
    """When this peer last heard each mate say it is looking for a group, when its own rounds ended, and the shift
    that follows."""

    def __init__(self) -> None:
        self._heard: dict[str, float] = {}
        """Mate -> when (monotonic) its last `ready` saying it is looking arrived."""
        self._ends: list[float] = []
        """When this peer's last rounds ended (monotonic), oldest first."""

    def heard(self, peer: str, at: float | None = None) -> None:
        self._heard[peer] = time.monotonic() if at is None else at

    def period(self, fallback: float) -> float:
        """This peer's round length: the median of its last rounds' (a round it shifted is one of several), or
        `fallback` before it has two round ends."""
        gaps = [b - a for a, b in zip(self._ends, self._ends[1:], strict=False)]
        return statistics.median(gaps) if gaps else fallback

    def shift_s(self, round_s: float, now: float | None = None) -> float:
        """Seconds to end the round that starts now later (> 0) or earlier (< 0): the median of the phases of the
        mates heard within the last round and a half and of this peer's own (0), or 0 inside the dead zone.

        Args:
            round_s: the wall time of the round that just ended (the period until two round ends are known).
            now: when that round ended (monotonic; mates heard since count too); default now.
        """
        now = time.monotonic() if now is None else now
        self._ends = [*self._ends[-(ROUNDS_KEPT - 1):], now]
        period = self.period(round_s)
        self._heard = {p: t for p, t in self._heard.items() if now - t < 1.5 * period}
        if period <= 0:
            return 0.0
        median = statistics.median([0.0] + [phase_of(t, now, period) for t in self._heard.values()])
        return median if abs(median) > DEAD_ZONE * period else 0.0
