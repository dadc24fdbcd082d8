"""Who a donor serves its state to: a few download slots shared fairly among the peers that ask.

A donor serves `SERVING_SLOTS` downloads at once and cuts a download whose reader stalls (wire.py). Without
more, a key holder that opens downloads and never reads them, asking again every fraction of a second, takes
every slot the moment it is cut and starves honest joiners. So `StateSlots` decides each request:

1. a sender that stalled a download recently is refused ("backed off") for `BACKOFF_S`, doubling with each
   further stall up to `MAX_BACKOFF_S`; a download sent to the end forgets its stalls;
2. a sender holds one slot, and one state stream, at a time: a second request while its first download runs,
   or while its first stream waits for the sender to close it after the reply, is refused ("one at a time"), the
   latter at once, without waiting for its close. A state that fits in the transport's buffers is never stalled
   on, so rule 1 never sees a pinner re-asking for such a state; this rule keeps it to one of its places at
   this peer (admission.py), whatever the rate it asks at, so that its other streams (merge parts) still fit
   its per-sender budget;
3. a sender is served `DOWNLOADS_BURST` downloads back to back, then one each `DOWNLOAD_EVERY_S` ("served
   recently"): the bytes a donor sends one sender are bounded however fast it reads or how small the state is;
4. a free slot goes to the peers that were refused "busy" first, in the order they first asked (a queue of at
   most `MAX_WAITING` peers): a peer that asks while others wait ahead of it is refused and queued behind them.
   A waiter keeps its place while it comes back when told (its entry lapses `RETRY_GRACE_S` after that time),
   so one that left does not hold a freed slot for long.

Every refusal says when to come back (`retry_after_s`); a joiner's `StateSync.fetch` honours it. A pinner with
one id holds one slot (about `SEND_STALL_S` at a time, then it is backed off); with k ids it delays a joiner
that queued after them by about k / `SERVING_SLOTS` stalled downloads, once per id per back-off period.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from p2pdiloco.network.admission import TokenBucket

SERVING_SLOTS = 2
"""Downloads a donor serves at once: one slow joiner does not make every other one "busy"."""
BACKOFF_S = 30.0
"""How long a sender whose download was cut for stalling is refused; doubles with each further stall. An honest
joiner that was cut had a link too slow for the deadline, and other donors to try."""
MAX_BACKOFF_S = 600.0
"""The longest back-off; a sender's stalls are forgotten this long after its back-off ends."""
RETRY_POLL_S = 2.0
"""The longest a waiter is told to stay away: slots end when their downloads do, which the donor cannot know
in advance (an honest download of a few MB takes well under a second on a fast link)."""
MIN_RETRY_S = 0.5
"""The shortest `retry_after_s` a refusal says."""
RETRY_GRACE_S = 5.0
"""How long after its `retry_after_s` a waiter keeps its place in the queue."""
MAX_WAITING = 64
"""Peers queued at once; a request beyond is refused "busy" without a place."""
DOWNLOADS_BURST = 3
"""Downloads one sender is served back to back: a joiner's `StateSync.fetch` asks a donor once a pass, in 3 passes."""
DOWNLOAD_EVERY_S = 60.0
"""Then one more download each this long: a peer fetches the state once per start."""


@dataclass(frozen=True)
class Refusal:
    """Why a state request is not served now, and when to ask again."""

    reason: str
    """'busy', 'one at a time', 'backed off' or 'served recently'."""
    retry_after_s: float


@dataclass
class _Stalls:
    strikes: int
    until: float
    """Monotonic time the sender's back-off ends."""


class StateSlots:
    """The donor's download slots and the per-sender bookkeeping above (pure: no I/O; all times monotonic).

    Args:
        slots: downloads served at once.
        clock: the time source (tests pass a fake one).
    """

    def __init__(self, slots: int = SERVING_SLOTS, clock: Callable[[], float] = time.monotonic):
        self.slots, self.clock = slots, clock
        self.serving: dict[str, float] = {}
        """Senders being served, and when each download's deadline ends."""
        self.waiting: dict[str, float] = {}
        """Senders queued (insertion order is the order they first asked), and when each entry lapses."""
        self.stalls: dict[str, _Stalls] = {}
        self.downloads: dict[str, TokenBucket] = {}
        """Downloads each sender may still start now (rule 3); a full bucket is forgotten."""
        self.refused: dict[str, int] = {"busy": 0, "one at a time": 0, "backed off": 0, "served recently": 0}
        """Requests refused, by reason."""
        self.open: Counter[str] = Counter()
        """State streams each sender holds open here now (a download, or a reply waiting for its reader to close)."""
        self.served = 0
        """Downloads sent to the end."""
        self.cut = 0
        """Downloads cut because their reader stalled."""

    def ask(self, sender: str, hold_s: float) -> Refusal | None:
        """Whether `sender` may download now; if so (None) it holds a slot for at most `hold_s` until `release`."""
        now = self.clock()
        self._prune(now)
        if (stalls := self.stalls.get(sender)) is not None and stalls.until > now:
            return self._refuse("backed off", stalls.until - now)
        if sender in self.serving:
            return self._refuse("one at a time", max(MIN_RETRY_S, min(RETRY_POLL_S, self.serving[sender] - now)))
        budget = self.downloads.setdefault(sender, TokenBucket(1 / DOWNLOAD_EVERY_S, DOWNLOADS_BURST, now))
        if budget.refill(now) < 1.0:
            return self._refuse("served recently", (1.0 - budget.tokens) * DOWNLOAD_EVERY_S)
        free = self.slots - len(self.serving)
        ahead = 0
        for waiter in self.waiting:
            if waiter == sender:
                break
            ahead += 1
        if ahead < free:
            budget.take(now)
            self.waiting.pop(sender, None)
            self.serving[sender] = now + hold_s
            return None
        first_end = min(self.serving.values(), default=now)
        retry = max(MIN_RETRY_S, min(RETRY_POLL_S, first_end - now))
        if sender in self.waiting or len(self.waiting) < MAX_WAITING:
            self.waiting[sender] = now + retry + RETRY_GRACE_S  # keeps its place if already queued
        return self._refuse("busy", retry)

    def opened(self, sender: str) -> Refusal | None:
        """A state stream of `sender` opened (`closed` when it ends): refused "one at a time" if the sender holds
        another here. Such a refusal is answered without waiting for the sender to close its end, so that a sender
        that opens stream after stream and closes none holds one of this peer's places (admission.py) for its
        state requests, not one per request: its other requests, merge parts among them, still fit its budget."""
        self.open[sender] += 1
        return self._refuse("one at a time", RETRY_POLL_S) if self.open[sender] > 1 else None

    def closed(self, sender: str) -> None:
        """A state stream of `sender` ended."""
        self.open[sender] -= 1
        if self.open[sender] <= 0:
            del self.open[sender]

    def release(self, sender: str, stalled: bool, completed: bool = False) -> None:
        """`sender`'s download ended: cut because its reader stalled (`stalled`), sent to the end (`completed`: its
        stalls are forgotten), or neither (the stream broke: nothing is learned of the sender)."""
        self.serving.pop(sender, None)
        now = self.clock()
        self.served += completed
        self.cut += stalled
        if completed:
            self.stalls.pop(sender, None)
        if not stalled:
            return
        strikes = self.stalls[sender].strikes + 1 if sender in self.stalls else 1
        self.stalls[sender] = _Stalls(strikes, now + min(MAX_BACKOFF_S, BACKOFF_S * 2 ** (strikes - 1)))

    def report(self) -> dict:
        """What this donor did with the requests it was asked: {"served", "cut", "refused": {reason: count}}."""
        return {"served": self.served, "cut": self.cut, "refused": dict(self.refused)}

    def _refuse(self, reason: str, retry_after_s: float) -> Refusal:
        self.refused[reason] += 1
        return Refusal(reason, round(retry_after_s, 3))

    def _prune(self, now: float) -> None:
        self.waiting = {p: lapse for p, lapse in self.waiting.items() if lapse > now}
        self.stalls = {p: s for p, s in self.stalls.items() if s.until + MAX_BACKOFF_S > now}
        self.downloads = {p: b for p, b in self.downloads.items() if b.refill(now) < b.burst}
