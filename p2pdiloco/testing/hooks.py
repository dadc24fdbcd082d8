"""The one door from a peer process to the testing aids.

A peer process calls `peer_hooks(cfg)` once and passes what it returns on: the faults to inject (empty
unless P2PDILOCO_FAULTS names this peer) and a wrapper for the merger the learner talks to (the merger
itself unless `emulate.hostile` makes this peer corrupt what it submits). Nothing else in the production
code imports `p2pdiloco.testing`, so test doubles and fault injection stay out of its paths.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from p2pdiloco.config import Config
from p2pdiloco.network.merger import Merger
from p2pdiloco.testing.faults import Faults, faults_from_env
from p2pdiloco.testing.hostile import HostileMerger, poisoned_state, sybil_record, sybil_state
from p2pdiloco.testing.insiders import ground_identity

logger = logging.getLogger(__name__)


@dataclass
class PeerHooks:
    """What a test or benchmark asked of one peer process."""

    faults: Faults
    """{(stage, round): action} for the merger and the learner; empty: nothing is injected."""
    hostile: str = ""
    """A hostile kind (see hostile.py): every contribution this peer submits is corrupted; '' for none."""
    seed: int = 0
    """Seed of the hostile kind's noise."""

    def wrap_merger(self, merger: Merger) -> Merger:
        """The merger the learner submits to: `merger` itself, or a hostile wrapper around it (the real merger
        still counts the bytes)."""
        return HostileMerger(merger, self.hostile, self.seed) if self.hostile else merger

    def prepare_identity(self, cfg: Config, path: Path) -> None:
        """Before this peer's DHT starts: the grinder writes its ground key to `path`, its identity file."""
        if self.hostile == "grinder":
            ground_identity(cfg, path)

    def wrap_state(self, provider, n_params: int):
        """The state this peer serves to joiners: its own, or a poisoned one (hostile kinds `donor`, `sybil_donor`).

        Args:
            provider: this peer's own state (see `StateSync`).
            n_params: length of the flat parameter vector."""
        if self.hostile == "sybil_donor":
            return sybil_state(n_params)
        return poisoned_state(provider) if self.hostile == "donor" else provider

    def wrap_held(self, held):
        """The past states this peer serves to joiners that ask for one: its own, or none (hostile kinds `donor`
        and `sybil_donor` serve their forged state to every request)."""
        return None if self.hostile in ("donor", "sybil_donor") else held

    def wrap_record(self, record, n_params: int):
        """The source of this peer's heartbeat records: `record` itself, or one naming the forged state it serves
        (hostile kind `sybil_donor`)."""
        return sybil_record(record, n_params) if self.hostile == "sybil_donor" else record


def peer_hooks(cfg: Config) -> PeerHooks:
    """The hooks of the peer configured by `cfg` (named `cfg.run.name` in P2PDILOCO_FAULTS)."""
    return PeerHooks(faults=faults_from_env(cfg.run.name), hostile=cfg.emulate.hostile, seed=cfg.run.seed)
