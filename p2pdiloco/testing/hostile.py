"""Hostile peers on demand (`p2pdiloco local --hostile INDEX:KIND`, config field emulate.hostile).

A hostile peer runs the ordinary code but lies in what it sends, as a broken accelerator or a peer with bad
intent would. It changes nothing in other peers' processes: what they see is only what it sends.

- nan, scale, noise, signflip: its pseudo-gradient is corrupted (see `corrupt`).
- takeover: it offers θg = −(its θg) with weights of 1e30, so that a group that averages global models adopts
  its model.
- final: every contribution says "this is my last", meant to end every member's run.
- leader: its ready records claim a deadline an hour away and it never invites anyone, meant to stop every
  group it would lead from forming.
- donor: it serves joiners θg = −(its θg) with counters claiming step 10⁹.
- sybil_donor: it serves joiners a forged state that every `sybil_donor` peer forges bit for bit alike (a model
  of init-like noise, no training) with counters claiming step 10⁹, and its heartbeat names that state as its
  global model with the same counters, so that its ids together pass any count of holders; it merges honestly.
- grinder, pinner, flood: key holders that attack the swarm's rules (insiders.py).

docs/security.md, "Insiders who lie about themselves", says how each is stopped.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from concurrent.futures import Future

import torch
from hivemind.utils.timed_storage import get_dht_time

from p2pdiloco.algorithm.outer import state_digest
from p2pdiloco.config import HOSTILE_KINDS as KINDS
from p2pdiloco.network.merger import Contribution, Merged, MergeOutcome, Merger
from p2pdiloco.network.peer_tag import PeerLog
from p2pdiloco.network.state_sync import GlobalState
from p2pdiloco.testing.insiders import InsiderTasks

logger = logging.getLogger(__name__)

SCALE = 1000.0
"""The `scale` kind multiplies Δ by this."""

CORRUPTING = ("nan", "scale", "noise", "signflip")
"""Kinds that corrupt the pseudo-gradient."""

CLAIM = 1e30
"""What a lying peer claims: tokens, steps."""

SYBIL_CLAIM = 10**9
"""The round, step and tokens that `sybil_donor` peers claim for their forged state."""
SYBIL_SEED = 4747
"""Seed of the forged state that every `sybil_donor` peer serves (so that all serve the same bits)."""


def corrupt(pseudo_grad: torch.Tensor, kind: str, generator: torch.Generator | None = None) -> torch.Tensor:
    """A corrupted copy of Δ.

    Kinds: nan (every value NaN), scale (Δ × 1000), noise (Gaussian noise with Δ's norm: no signal, so only
    its direction gives it away), signflip (−Δ: gradient ascent, same norm).
    """
    if kind == "nan":
        return torch.full_like(pseudo_grad, float("nan"))
    if kind == "scale":
        return pseudo_grad * SCALE
    if kind == "noise":
        noise = torch.randn(pseudo_grad.shape, generator=generator, dtype=pseudo_grad.dtype)
        norm = torch.linalg.vector_norm(noise)
        return noise * (torch.linalg.vector_norm(pseudo_grad) / norm) if norm > 0 else noise
    if kind == "signflip":
        return -pseudo_grad
    raise ValueError(f"unknown hostile kind {kind!r} (known: {', '.join(KINDS)})")


class HostileMerger:
    """Wraps this peer's merger and lies in every contribution it submits.

    Args:
        inner: the real merger.
        kind: one of `KINDS`.
        seed: seed of the noise kind.
    """

    def __init__(self, inner: Merger, kind: str, seed: int = 0):
        if kind not in KINDS:
            raise ValueError(f"unknown hostile kind {kind!r}")
        self.inner, self.kind = inner, kind
        self.peer_id = inner.peer_id
        self.log = PeerLog(logger, self.peer_id)
        self._gen = torch.Generator().manual_seed(seed)
        if kind in ("leader", "grinder"):
            silent_leader(inner, far=kind == "leader")
        self._insider = InsiderTasks(inner, kind) if kind in ("pinner", "flood") else None
        self.log.warning("HOSTILE peer: %s", kind)

    def submit(self, contribution: Contribution) -> Future[MergeOutcome]:
        c = contribution
        if self.kind in CORRUPTING:
            # the lie is what is sent, with the learner's error-feedback residual on top as for an honest Δ; the
            # learner's residual is then the lie's less what the group took of it (`_residual_of_lie`)
            bad = corrupt(c.pseudo_grad, self.kind, self._gen)
            lie = bad if c.compensated is None or c.compensated is c.pseudo_grad else bad + (c.compensated - c.pseudo_grad)
            told = Contribution(**{**c.__dict__, "pseudo_grad": bad, "compensated": lie})
            truth = c.pseudo_grad if c.compensated is None else c.compensated
            return _residual_of_lie(self.inner.submit(told), truth - lie)
        if self.kind == "takeover":
            c = Contribution(**{**c.__dict__, "global_params": -c.global_params, "weight": CLAIM, "state_weight": CLAIM,
                                "state_digest": "takeover-" + c.state_digest})
        elif self.kind == "final":
            c = Contribution(**{**c.__dict__, "final": True})
        return self.inner.submit(c)

    def take_round_shift(self) -> float:
        return self.inner.take_round_shift()

    def stop_looking(self) -> None:
        self.inner.stop_looking()

    def close(self) -> None:
        if self._insider is not None:
            self._insider.close()
        self.inner.close()


def _residual_of_lie(future: Future[MergeOutcome], offset: torch.Tensor) -> Future[MergeOutcome]:
    """`future`, with `Merged.sent` moved by `offset` (what the learner offered less what was sent), so that the
    learner's error feedback keeps the lie's residual, as a merger that compensated the lie itself would."""
    out: Future[MergeOutcome] = Future()

    def landed(f: Future[MergeOutcome]) -> None:
        if f.cancelled():
            out.cancel()
            return
        outcome = f.result()
        if isinstance(outcome, Merged) and outcome.sent is not None:
            outcome = dataclasses.replace(outcome, sent=outcome.sent + offset)
        if out.set_running_or_notify_cancel():
            out.set_result(outcome)

    future.add_done_callback(landed)
    out.add_done_callback(lambda f: future.cancel() if f.cancelled() else None)
    return out


def silent_leader(merger, far: bool = True) -> None:
    """Make a P2PMerger's matchmaker never invite anyone, and (`far`) claim a far deadline whenever it tells its
    mates it is looking (else its honest deadline, which mates believe)."""
    mm = merger.matchmaker
    request = mm.rpc.request

    async def far_ready(peer: str, op: str, header: dict) -> dict | None:
        if op == "ready" and header.get("looking"):
            header = {**header, "deadline": header["deadline"] + 3600.0}
        return await request(peer, op, header)

    async def never_lead(search, candidates):  # looks until its real deadline, declining invites as leaders do
        search.leading = True
        await asyncio.sleep(max(0.0, search.deadline - get_dht_time()))
        return None

    mm._lead = never_lead
    if far:
        mm.rpc.request = far_ready


def equivocating_leader(merger) -> None:
    """Make a P2PMerger's matchmaker, whenever it leads three members or more, send its first member a notice unlike
    the others': the second member's weight doubled, within the cap, so that the notice passes every check the
    first member can make alone."""
    mm = merger.matchmaker
    request = mm.rpc.request

    async def equivocate(peer: str, op: str, header: dict) -> dict | None:
        if op == "group" and len(header.get("members", ())) > 2 and peer == header["members"][1]:
            w = header["weights"]
            header = {**header, "weights": [*w[:2], 2 * w[2], *w[3:]]}
        return await request(peer, op, header)

    mm.rpc.request = equivocate


def poisoned_state(provider):
    """A state provider serving −θg with counters claiming step 10⁹ (the `donor` kind)."""
    def serve() -> GlobalState | None:
        state = provider()
        if state is None:
            return None
        return GlobalState(-state.global_params, state.momentum, int(CLAIM), int(CLAIM), CLAIM)
    return serve


def forged_state(n_params: int) -> GlobalState:
    """The `sybil_donor` kind's state: the same bits on every peer of that kind (init-like noise, zero momentum,
    counters claiming `SYBIL_CLAIM`)."""
    params = torch.randn(n_params, generator=torch.Generator().manual_seed(SYBIL_SEED)) * 0.02
    return GlobalState(params, torch.zeros(n_params), SYBIL_CLAIM, SYBIL_CLAIM, float(SYBIL_CLAIM))


def sybil_state(n_params: int):
    """A state provider serving `forged_state` (made once)."""
    state = forged_state(n_params)
    return lambda: state


def sybil_record(record, n_params: int):
    """A heartbeat record source whose record names `forged_state` as this peer's global model, with its claims."""
    forged = forged_state(n_params)
    claims = {"global_digest": state_digest(forged.global_params, forged.momentum), "round": forged.round,
              "step": forged.step, "global_tokens": forged.global_tokens}
    return lambda: {**record(), **claims}
