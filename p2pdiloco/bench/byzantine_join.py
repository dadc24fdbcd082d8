"""`bench byzantine`'s kinds that lie only to joiners (`sybil_donor`): their runs need a joiner.

In such a run the last peer is killed once the swarm has merged for a while and started again as a fresh peer
(same id, no checkpoint), so it joins the running swarm and downloads its state; its baseline is `clean_join`, a
clean run with the same restart. Beside the honest peers' eval loss the figures say what the joiner took: the
state of a hostile donor or of an honest one, or none (its `join` or `join_refused` metrics line).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from p2pdiloco.app.local import PeerProc
from p2pdiloco.util.logfiles import read_jsonl

logger = logging.getLogger(__name__)

JOINER_KINDS = ("sybil_donor",)
"""Hostile kinds whose runs have a joiner."""
CLEAN_JOIN = "clean_join"
"""Not a hostile kind: a clean run with the joiner's restart, the baseline of `JOINER_KINDS`."""
KILL_AFTER_S = 8.0
"""The joiner is killed this long after every peer trains (the swarm has merged several times by then)..."""
RESTART_AFTER_S = 2.0
"""... and started again this long after."""


def baselines(kinds: tuple[str, ...]) -> tuple[str, ...]:
    """The extra clean runs that `kinds` need beside `clean`."""
    return (CLEAN_JOIN,) if any(k in JOINER_KINDS for k in kinds) else ()


def baseline_of(kind: str) -> str:
    """The clean run `kind`'s ratio divides by."""
    return CLEAN_JOIN if kind in JOINER_KINDS else "clean"


class JoinerRestart:
    """Kill one peer once every peer trains and `KILL_AFTER_S` has passed, and start it again `RESTART_AFTER_S`
    later as a fresh peer (the `chaos` of `run_local`).

    Args:
        index: the peer to restart (an honest one).
    """

    def __init__(self, index: int):
        self.index = index
        self.kill_at: float | None = None
        self.done = False

    def tick(self, peers: list[PeerProc]) -> None:
        now = time.monotonic()
        peer = peers[self.index]
        if peer.restart_at is not None and now >= peer.restart_at:
            peer.restart_at = None
            peer.start(resume=True)  # no checkpoint (run.checkpoint_every=0): it starts fresh and joins
            logger.info("byzantine: restarted %s to join", peer.name)
        if self.done:
            return
        if self.kill_at is None:
            if all(p.stage == "training" for p in peers):
                self.kill_at = now + KILL_AFTER_S
            return
        if now >= self.kill_at and peer.proc.poll() is None:
            peer.kill_tree()
            peer.restart_at, self.done = now + RESTART_AFTER_S, True
            logger.info("byzantine: killed %s", peer.name)


def joiner_outcome(run_dir: Path, joiner: str, hostile_ids: set[str]) -> dict:
    """What the joiner took, from its metrics: {"joined": "hostile" | "honest" | "none" | "no attempt", its step
    after the join, states its own check refused}."""
    rows = list(read_jsonl(run_dir / "peers" / joiner / "metrics.jsonl"))
    join = next((r for r in rows if r.get("kind") == "join"), None)
    refused = next((r for r in rows if r.get("kind") == "join_refused"), None)
    if join is not None:
        took = "hostile" if join.get("donor") in hostile_ids else "honest"
        return {"joined": took, "join_step": join.get("step"), "refused_states": join.get("refused_states", 0)}
    if refused is not None:
        return {"joined": "none", "join_step": None, "refused_states": refused.get("refused_states", 0)}
    return {"joined": "no attempt", "join_step": None, "refused_states": 0}
