"""One search for a merge group: what a peer looking for a group knows while it looks (matchmaking.py)."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

from p2pdiloco.config import Config
from p2pdiloco.network.merger import Contribution

FORM_WINDOWS = 4
"""A decoupled window is at least this many of this peer's recent group formation times (see `Window.length`)."""


DECLINES = ("not_looking", "leading", "taken", "banned", "over_budget", "distrusted", "protocol", "config", "closing")
"""Why an invite is declined, the word its reply gives (`why`): the invitee was not searching, led a group of its
own, had accepted another leader's invite; the leader is banned, was refused streams at the invitee persistently
(`StreamGate.refusing`), told members of its last group there different groups (`Leaders.distrust`), speaks another
wire protocol or config; or the invitee, about its last merges, follows only a leader that is too. A leader whose invites were all declined merges
alone with the cause `declined:` and the words (plus `unreachable` for an invite unanswered, `stale` for a member
left out as too far behind)."""

OTHER_PROTOCOLS = 64
"""Leaders of another wire protocol whose invites are declined with a warning, once each (each invites every round);
invites of further ones are declined without one, so that ids made up by the thousand take no memory."""

ALONE_CAUSES = ("declined", "not_invited", "no_notice", "no_mate_ready", "no_mate", "no_leader", "closed")
"""Why a search ended without a group (`Matchmaker.alone_cause`): its invites were all declined (see `DECLINES`); the
mate it followed as leader never invited it; the leader whose invite it accepted never sent the group's notice; it
led, and no mate was ready by its deadline; it had no live mate in its epoch's group; nobody ready could lead (this
peer cannot be dialed); or the merger closed."""


def decline_reason(search: Search | None) -> str:
    """The word of `DECLINES` an invite gets from a peer whose search is `search`, if nothing else declines it."""
    if search is None:
        return "not_looking"
    return "leading" if search.leading else "taken"


def leader_refusal(banned: bool, over_budget: bool, distrusted: bool) -> tuple[str, str] | None:
    """The word of `DECLINES` and the error an invite gets for who its leader is, if that declines it: banned; over
    its stream budget at the invitee persistently (its parts would be refused there too); or distrusted for telling
    members of its last group there different groups."""
    if banned:
        return "banned", "banned"
    if over_budget:
        return "over_budget", "over its stream budget at this peer"
    if distrusted:
        return "distrusted", "it told members of its last group here different groups"
    return None


@dataclass
class Search:
    """This peer's current search for a group (matchmaking.py)."""

    contribution: Contribution
    deadline: float
    leading: bool = False
    accepted_gid: str = ""
    leader: str = ""
    epoch: int = 0
    """The epoch whose groups this search is dealt (`my_group`): the current one."""
    told: set[str] = field(default_factory=set)
    """Mates told that this peer is looking."""
    earlier: set[str] = field(default_factory=set)
    """Mates told in an earlier epoch of this search (told again, with the new epoch's nonce, if still mates)."""
    unreachable: set[str] = field(default_factory=set)
    """Mates that could not be told: not waited for."""
    acked: dict[str, float] = field(default_factory=dict)
    """Mates that answered this search's word that it is looking: peer id -> when first (DHT time)."""
    followed_deadline: float = 0.0
    """The deadline the mate this search waits for an invite from announced (`Matchmaker._follow`)."""
    part: str = ""
    """The digest of this peer's encoded sparse part (`group.part_digest`), given in its invite reply; '' with a
    sliced codec."""
    marks: dict[str, float] = field(default_factory=dict)
    """When (monotonic) this search passed each of its steps (see `Matchmaker.marks`)."""

    @staticmethod
    def overtaken(header: dict, held: float) -> bool:
        """Whether a mate's ready word `header` that says it stopped looking is of an earlier search than the one whose
        word that it is looking this peer holds (until deadline `held`): the words of its next search overtook it on the
        way, and it is looking still. Taken as a stop, it made a leader wait to its deadline for a mate it counted as
        live but not ready."""
        return header.get("looking") is not True and header.get("deadline") != held

    def mark(self, step: str) -> None:
        """Note that this search passed `step` now (the first time only)."""
        self.marks.setdefault(step, time.monotonic())


class Window:
    """How long this peer's searches wait for others to become ready (`length`).

    Sync mode waits up to merge_window_s, for everyone. Decoupled mode waits a fraction of this peer's recent
    round time (an EMA of the rounds' wall times as the learner reports them, else of the time between submits), in
    the spirit of Decoupled DiLoCo's grace window: long enough that peers finishing their round at about the same
    time meet, short enough that nobody's merges are held up by a slow or vanished peer. No constant to retune per
    model or link: where round trips are long against rounds (400 ms against 3 s), the window is at least
    `FORM_WINDOWS` of this peer's recent group formation times, for a group forms in about three round trips
    (ready, invite, notice) after its last member is ready. With timed rounds, until this peer's first group merge a
    window also spans one more cadence point (`rounds.round_seconds` on top): peers that started apart end their
    first rounds on adjacent cadence points, which a quarter of a round never bridges.
    """

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.round_ema: float | None = None
        """EMA of this peer's round time (s)."""
        self.form_ema: float | None = None
        """EMA of its group merges' formation time: from its `ready` to its `grouped` mark, about a round trip to
        the slowest mate (the leader awaits every invite's answer; a member awaits the notice sent after them)."""
        self.alone_streak = 0
        self.grouped = False
        """Whether one of this peer's merges was in a group yet."""
        self._last_submit = time.monotonic()

    def record(self, alone: bool, marks: dict[str, float]) -> None:
        """The outcome of this peer's last merge and its search's marks: merges alone in a row widen the window
        until a group forms."""
        self.alone_streak = self.alone_streak + 1 if alone else 0
        self.grouped = self.grouped or not alone
        if not alone and (form := marks.get("grouped", 0.0) - marks.get("ready", math.inf)) >= 0:
            self.form_ema = form if self.form_ema is None else 0.5 * self.form_ema + 0.5 * form

    def length(self, round_s: float) -> float:
        """The window of a search starting now, for a round of `round_s` (0: time it from the last submit)."""
        now = time.monotonic()
        interval = round_s if round_s > 0 else now - self._last_submit
        self._last_submit = now
        self.round_ema = interval if self.round_ema is None else 0.5 * self.round_ema + 0.5 * interval
        merge = self.cfg.merge
        if self.cfg.rounds.sync:
            return merge.merge_window_s
        # Peers whose rounds drifted apart by more than the window would never meet again: after each
        # merge alone the window doubles (up to merge_window_s) until a group forms, then it resets.
        base = max(merge.min_window_s, merge.window_fraction * self.round_ema, FORM_WINDOWS * (self.form_ema or 0.0))
        if not self.grouped:  # a first round may end a cadence point after its mates' (see the class docstring)
            base += self.cfg.rounds.round_seconds
        return min(merge.merge_window_s, base * 2 ** min(self.alone_streak, 8))
