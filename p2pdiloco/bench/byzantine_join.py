"""`bench byzantine`'s kinds that act only on joiners (`sybil_donor`, `pinner`): their runs need a joiner.

In such a run the last peer is killed once the swarm has merged for a while and started again as a fresh peer
(same id, no checkpoint), so it joins the running swarm and downloads its state; its baseline is `clean_join`, a
clean run with the same restart. Beside the honest peers' eval loss the figures say what the joiner took: the
state of a hostile donor or of an honest one, or none (its `join` or `join_refused` metrics line); how long after
its process started it held that state (its `start` line's `process_s` and the `join` line's time), beside
`clean_join`'s, against one donor slot's time (the longest a stalled download holds a slot, `wire.send_deadline` of
the state's bytes); and what the honest donors did with the state requests they were asked (their summaries'
`state_serving`: served, cut for stalling, refused by reason).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from p2pdiloco.app.local import PeerProc
from p2pdiloco.network.wire import send_deadline
from p2pdiloco.util.logfiles import read_jsonl

logger = logging.getLogger(__name__)

JOINER_KINDS = ("sybil_donor", "pinner")
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


def joiner_outcome(run_dir: Path, joiner: str, hostile_ids: set[str], names: dict[str, str] | None = None) -> dict:
    """What the joiner's last start took, from its metrics: {"joined": "hostile" | "honest" | "none" | "no
    attempt", its step after the join, states its own check refused, "donor": the donor's name (from `names`,
    {peer id: name}) or id, "join_s": seconds from that process's start until it held the state, "download_s": of
    those, the download's (its `join` line's)}."""
    rows = list(read_jsonl(run_dir / "peers" / joiner / "metrics.jsonl"))
    starts = [i for i, r in enumerate(rows) if r.get("kind") == "start"]
    start = rows[starts[-1]] if starts else {}
    rows = rows[starts[-1]:] if starts else rows
    join = next((r for r in rows if r.get("kind") == "join"), None)
    refused = next((r for r in rows if r.get("kind") == "join_refused"), None)
    if join is not None:
        took = "hostile" if join.get("donor") in hostile_ids else "honest"
        times = (start.get("process_s"), start.get("t"), join.get("t"))
        join_s = times[0] + times[2] - times[1] if all(isinstance(x, int | float) for x in times) else None
        return {"joined": took, "join_step": join.get("step"), "refused_states": join.get("refused_states", 0),
                "donor": (names or {}).get(join.get("donor"), join.get("donor")), "join_s": join_s,
                "download_s": join.get("download_s")}
    if refused is not None:
        return {"joined": "none", "join_step": None, "refused_states": refused.get("refused_states", 0)}
    return {"joined": "no attempt", "join_step": None, "refused_states": 0}


def donors_serving(summary: dict, donors: set[str]) -> dict[str, dict]:
    """{name: its `state_serving`} of the peers named in `donors` (those whose summary has one)."""
    return {p["name"]: p["state_serving"] for p in summary["peers"]
            if p.get("name") in donors and p.get("state_serving") is not None}


def slot_s(summary: dict) -> float | None:
    """One donor slot's time: the longest a download of the swarm's state (θg and momentum, fp32) may hold a slot."""
    n_params = next((p["n_params"] for p in summary["peers"] if isinstance(p.get("n_params"), int)), None)
    return None if n_params is None else send_deadline(2 * n_params * 4)


def join_against(run: dict, base: dict) -> dict:
    """The joiner's time to the swarm's state in `run` beside the same in `base` (the `clean_join` run): their
    ratio, the extra seconds, and whether those are within one donor slot's time (`slot_s`). Empty if either
    joiner was not served."""
    took, clean = run.get("joiner", {}).get("join_s"), base.get("joiner", {}).get("join_s")
    if took is None or clean is None:
        return {}
    slot = run.get("slot_s")
    return {"join_s": took, "clean_join_s": clean, "ratio": took / clean if clean > 0 else float("nan"),
            "extra_s": took - clean, "slot_s": slot, "within_slot": slot is not None and took - clean <= slot}
