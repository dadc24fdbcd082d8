"""The swarm's components as config models: joining it (`[swarm]`), the round cadence (`[rounds]`), forming
merge groups and merging (`[merge]`), how pseudo-gradients travel (`[codec]`), and waiting for peers at the start
(`[startup]`). The keys these tables had as one `[swarm]` table still work (`load.ALIASES`).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import ClassVar

from pydantic import Field

from p2pdiloco.algorithm.names import CODECS
from p2pdiloco.config.base import _Section

__all__ = ["CodecConfig", "MergeConfig", "RoundsConfig", "StartupConfig", "SwarmConfig"]


class SwarmConfig(_Section):
    """How a peer finds the swarm: its name, the DHT node, its address and key, and its peer record."""

    SECTION: ClassVar[str] = "swarm"

    run_id: str = "p2pdiloco"
    """Name of the swarm; prefixes every DHT key and protocol name."""
    initial_peers: list[str] = Field(default_factory=list)
    """Multiaddrs of a bootstrap node or any live peer; empty starts a new swarm."""
    host: str = "0.0.0.0"
    """Interface to listen on."""
    port: int = 0
    """TCP port to listen on (0 picks a free one)."""
    announce: list[str] = Field(default_factory=list)
    """Multiaddrs to announce instead of the listening ones (public address behind NAT)."""
    heartbeat_s: float = 5.0
    """Seconds between peer records in the DHT; a record expires after three of these."""
    join_timeout_s: float = 20.0
    """Give up on unreachable initial peers after this many seconds."""
    swarm_key: str = ""
    """File with the private swarm's secret key (`p2pdiloco keygen`); empty: a public swarm."""

    def checks(self) -> Iterator[tuple[bool, str]]:
        yield self.heartbeat_s > 0 and self.join_timeout_s > 0, "swarm.heartbeat_s and join_timeout_s must be > 0"


class RoundsConfig(_Section):
    """When a round ends, and whether the learner waits for its merge (the same on every peer of a swarm)."""

    SECTION: ClassVar[str] = "rounds"

    round_steps: int = 50
    """Inner steps per round (H in DiLoCo); used when round_seconds is 0."""
    round_seconds: float = 0.0
    """If > 0, timed rounds end at each multiple of this many seconds of DHT time (a slow peer runs fewer steps)."""
    sync: bool = False
    """Synchronous DiLoCo (the baseline): wait for the merge, and wait for every live peer to be ready."""

    def checks(self) -> Iterator[tuple[bool, str]]:
        yield self.round_steps >= 1 and self.round_seconds >= 0, "need rounds.round_steps >= 1 and round_seconds >= 0"


class MergeConfig(_Section):
    """How long a peer waits for others to merge with, how groups are drawn, and how long a merge may take."""

    SECTION: ClassVar[str] = "merge"

    merge_window_s: float = 15.0
    """Upper bound on the wait for other peers to become ready for a merge (the whole wait in sync mode)."""
    window_fraction: float = 0.25
    """Decoupled: wait for others at most this fraction of the recent round time, within [min_window_s, merge_window_s]."""
    min_window_s: float = 1.0
    """Lower bound of the adaptive merge window."""
    merge_timeout_s: float = 60.0
    """Longest one exchange phase of a merge (Δ, or (θg, momentum)) may take; past it the merge is not applied."""
    group_size: int = 8
    """Most members of one merge group: more ready peers split into groups of about equal size, redrawn each epoch."""
    epoch_s: float = 30.0
    """Seconds between redrawings of the groups, the same on every peer: make it many rounds (architecture.md)."""
    state_anchors: int = 8
    """Recent global models kept (8 bytes a parameter each): members whose models differ send int8 differences."""

    def checks(self) -> Iterator[tuple[bool, str]]:
        yield self.merge_window_s > 0 and self.merge_timeout_s > 0, "merge times must be positive"
        yield 0 < self.window_fraction <= 1, "merge.window_fraction must be in (0, 1]"
        yield 0 < self.min_window_s <= self.merge_window_s, "need 0 < merge.min_window_s <= merge_window_s"
        yield self.group_size >= 2 and self.epoch_s >= 1, "need merge.group_size >= 2 and merge.epoch_s >= 1"
        yield 0 <= self.state_anchors <= 32, "need merge.state_anchors in [0, 32]"


class CodecConfig(_Section):
    """How pseudo-gradients are encoded for merges (the same on every peer of a swarm)."""

    SECTION: ClassVar[str] = "codec"

    name: str = "int4"
    """none (fp32), fp16, bf16, int8, int4 (4-bit NF4 blockwise; the default), or sparseloco (the top
    `sparse_keep` of every 4096 values, 2 bits each, all-gathered in the group)."""
    sparse_keep: int = 48
    """sparseloco: values kept per chunk of 4096 (48: 1.17 %; SparseLoCo's 64 sent 94× fewer bytes than fp32 here)."""
    error_feedback: bool = True
    """Add each round's quantization residual to the next round's pseudo-gradient (lossy codecs only)."""
    error_feedback_decay: float = 1.0
    """β: the residual is scaled by β before it is added (SparseLoCo's decayed accumulator, arXiv 2508.15706)."""

    def checks(self) -> Iterator[tuple[bool, str]]:
        yield self.name in CODECS, f"codec.name must be one of {', '.join(CODECS)}, got {self.name!r}"
        yield 1 <= self.sparse_keep <= 4096 and 0 <= self.error_feedback_decay <= 1, \
            "need codec.sparse_keep in [1, 4096] and codec.error_feedback_decay in [0, 1]"


class StartupConfig(_Section):
    """What a peer waits for before its first inner step."""

    SECTION: ClassVar[str] = "startup"

    wait_for_peers: int = 0
    """Before the first inner step, wait until this many peers (this one included) are in the census; 0: no wait."""
    wait_for_peers_s: float = 120.0
    """Longest wait for `wait_for_peers`; after it the peer starts with whoever is there."""

    def checks(self) -> Iterator[tuple[bool, str]]:
        yield self.wait_for_peers >= 0 and self.wait_for_peers_s >= 0, "startup.wait_for_peers* must be >= 0"
