"""The one narrow interface between the learner and the network: submit a contribution, get `Merged` or `Alone`.

The learner never sees a DHT or a socket. `P2PMerger` (in `p2p_merger.py`) implements this over hivemind;
`p2pdiloco.testing.inmemory.InMemoryMerger` implements it for tests of the learner loop.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Protocol

import torch


@dataclass
class Contribution:
    """What a peer offers to a merge at the end of a round."""

    pseudo_grad: torch.Tensor
    """Flat fp32 CPU Δ = θg − θ."""
    weight: float
    """Tokens processed in this round: the contribution's weight in the average."""
    global_params: torch.Tensor
    """Flat fp32 CPU θg the pseudo-gradient was taken against (averaged only when members disagree)."""
    momentum: torch.Tensor
    """Flat fp32 CPU outer momentum buffer (travels with θg when members disagree)."""
    state_digest: str
    """Hash of (θg, momentum): members compare digests to see whether their global models agree."""
    state_weight: float
    """Tokens already merged into θg: how much a member's θg counts when global models are averaged."""
    anchors: dict[str, torch.Tensor] = field(default_factory=dict)
    """Recent states this peer holds exactly, (θg, momentum) concatenated, by digest, newest first: members whose
    global models differ average their differences from the newest one all of them hold, compressed."""
    round: int = 0
    """This peer's round counter, for logs."""
    round_s: float = 0.0
    """Wall time of the round that produced this contribution (sizes the merge window); 0 if unknown."""
    final: bool = False
    """This peer's last contribution of the run: it waits the whole merge window for every live peer, and
    whoever merges with it ends the run on the same global model (see `Merged.final`)."""
    closing: bool = False
    """This peer is within about a round of its end, by its own counters (`Learner.near_end`): its search is dealt
    like a final one, so that peers whose last rounds are a little out of phase still meet (`Matchmaker.find_group`)."""
    compensated: torch.Tensor | None = None
    """Δ plus this peer's error-feedback residual (`feedback.ErrorFeedback.compensate`): what a group merge sends; None: Δ."""

    def last_merges(self) -> bool:
        """Whether this is one of the peer's last merges (`final` or `closing`): its search is dealt the whole census
        and waits the whole window."""
        return self.final or self.closing


@dataclass
class MergeStats:
    """How a merge went, for the learner's metrics: its math never reads these."""

    group: list[str] = field(default_factory=list)
    """Peer ids of the merge group in group order; just this peer when it merged alone."""
    group_id: str = ""
    """Identifier of the merge group ('' when alone)."""
    bytes_sent: int = 0
    """Bytes this peer sent for this merge."""
    bytes_received: int = 0
    """Bytes this peer received for this merge."""
    pseudo_grad_bytes_sent: int = 0
    """Of `bytes_sent`, those of the pseudo-gradient exchange (not matchmaking, not the (θg, momentum) average)."""
    pseudo_grad_bytes_received: int = 0
    """Of `bytes_received`, those of the pseudo-gradient exchange."""
    state_bytes_sent: int = 0
    """Of `bytes_sent`, those of the (θg, momentum) agreement (0 if there was none)."""
    state_bytes_received: int = 0
    """Of `bytes_received`, those of the (θg, momentum) agreement (0 if there was none)."""
    state_anchored: bool = False
    """The agreement travelled as int8 differences from an anchor all members held (else fp32, or none)."""
    state_caught_up: bool = False
    """The agreement was the model a majority of the members held, fetched by the others (catch_up.py)."""
    duration_s: float = 0.0
    """Seconds from submit to result."""
    match_s: float = 0.0
    """Of `duration_s`, the seconds until the group was formed (matchmaking; all of it when no group formed): the
    rest is the exchange, so a slow merge says whether it waited for mates or for its bytes and CPU."""
    marks: dict[str, float] = field(default_factory=dict)
    """The merge's timeline: seconds from submit at which it passed each step it reached, in order: matchmaking's
    (`Matchmaker.marks`: census, ready, invited, grouped), then `exchanged` (the Δ average held) and `agreed` (the
    (θg, momentum) agreement done, where there was one). Divided by a link's round trip, the differences are
    what each step costs in round trips (docs/architecture.md, Round trips)."""
    alone_cause: str = ""
    """Why its search found no group, one word of `search.ALONE_CAUSES` ('' for a group merge or a failed one)."""
    rejected: int = 0
    """Contributions this peer's guards rejected during this merge (see guards.py)."""
    own_kept: float = 1.0
    """Fraction of this peer's Δ (by values) that entered the group's average: a slice whose owner's guards left
    this peer's part out carries none of it (1 when alone). Goodput counts a round reached only by this much."""
    state_share: float = 0.0
    """When global models were averaged: this peer's θg's share of the agreed θg, its state weight ÷ the state
    weights combined (as the group counted them), averaged over the values; 0 where its part was left out."""


@dataclass
class Merged:
    """A group merge: what the learner applies."""

    average: torch.Tensor
    """Weighted average Δ̄ over the group."""
    weight: float
    """Sum of the members' weights (tokens)."""
    agreed_state: torch.Tensor | None = None
    """When members' global models disagreed: the group's (θg, momentum) concatenated, else None."""
    state_weight: float = 0.0
    """With `agreed_state`: the tokens the agreed θg stands for (the lower median of the members' claims)."""
    final: bool = False
    """A member's contribution was its last of the run: the run is over for every member of this group, so
    that the peers still training end on the global model the finishing ones leave with, instead of each
    drifting off alone after the others have gone."""
    sent: torch.Tensor | None = None
    """This peer's `Contribution.compensated` as the group's average took it (what error feedback counts as sent,
    `ErrorFeedback.commit`); None: all of it."""
    stats: MergeStats = field(default_factory=MergeStats)


@dataclass
class Alone:
    """No group merge: this peer applies its own Δ alone (DiLoCo with one replica still helps), see `merged_alone`."""

    reason: str = ""
    """Why a group merge was abandoned; '' when nobody was there to merge with."""
    stats: MergeStats = field(default_factory=MergeStats)


MergeOutcome = Merged | Alone


def merged_alone(contribution: Contribution, stats: MergeStats | None = None) -> Merged:
    """What a merge alone applies: this peer's own Δ (not compensated: error feedback keeps its residual for the
    next group merge), with its own weight and its own `final`."""
    return Merged(average=contribution.pseudo_grad, weight=contribution.weight, final=contribution.final,
                  stats=stats or MergeStats())


class Merger(Protocol):
    """What the learner needs from the network."""

    peer_id: str

    def submit(self, contribution: Contribution) -> Future[MergeOutcome]:
        """Start merging `contribution` with whichever peers are ready; the future never raises."""
        ...

    def take_round_shift(self) -> float:
        """How much later (> 0) or earlier the round in progress should end to meet the mates' round ends, as the
        last merge measured it (phase.py; rounds of a fixed step count only); 0 once taken."""
        ...

    def stop_looking(self) -> None:
        """This peer is stopping: searches for a group end alone now; a merge whose group formed goes on."""
        ...

    def close(self) -> None:
        """Stop taking part in merges (results of merges still in flight are not applied)."""
        ...


class FaultHook(Protocol):
    """Where a test breaks a merge on purpose (`p2pdiloco.testing.faults.Faults` is one); production passes none."""

    async def fire(self, stage: str, round_: int, peer: str = "") -> None:
        """Do what is planned for `stage` of round `round_` (stall, kill), if anything."""
        ...
