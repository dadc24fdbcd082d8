"""One search for a merge group: what a peer looking for a group knows while it looks (matchmaking.py)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from p2pdiloco.network.merger import Contribution


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
    part: str = ""
    """The digest of this peer's encoded sparse part (`group.part_digest`), given in its invite reply; '' with a
    sliced codec."""
    marks: dict[str, float] = field(default_factory=dict)
    """When (monotonic) this search passed each of its steps (see `Matchmaker.marks`)."""

    def mark(self, step: str) -> None:
        """Note that this search passed `step` now (the first time only)."""
        self.marks.setdefault(step, time.monotonic())
