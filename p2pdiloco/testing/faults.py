"""Deterministic fault injection, keyed by (stage, round): the one hook tests use to break a peer on purpose.

Production code never builds one: the merger and the learner take a `Faults` as an optional argument (as
torchft's `Manager` takes an `EventInjector`), and with none nothing is injected.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal

from hivemind.p2p.p2p_daemon_bindings.utils import ControlFailure

logger = logging.getLogger(__name__)

STALL_S = 3600.0
"""How long a 'stall' freezes: longer than any merge is waited for, so the merge is abandoned first."""


class Faults(dict[tuple[str, int | str], str]):
    """{(stage, round): action}; a round written "R+" means the first time the stage is reached from round R on
    (a merge alone reaches no 'serve_part', so a fault planned for one round can miss in a loaded run).

    Stages: 'exchange' (the merger, before this peer sends its slices), 'serve_part' (the merger, inside the
    reducer, on each part received from another member: a kill or stall acts on the first), 'checkpoint' (the learner reads
    `faults.get(("checkpoint", round))` itself and dies mid-write). Actions: 'stall' freezes this peer's side
    of the merge (as SIGSTOP would) until the merge is abandoned; 'kill' SIGKILLs this process on the spot;
    'dial_fails' raises what the p2p daemon raises when a dial to a group mate times out (behind NAT).
    """

    async def fire(self, stage: str, round_: int, peer: str = "") -> None:
        """Do what is planned for `stage` of round `round_`, if anything.

        Args:
            stage: where the caller is (see the class docstring).
            round_: the caller's round counter.
            peer: this peer's short id, for the log line.
        """
        action = self.get((stage, round_)) or self._onward(stage, round_)
        if action:
            logger.warning("[%s] injected fault: %s at %s of round %d", peer, action, stage, round_)
        if action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif action == "stall":
            await asyncio.sleep(STALL_S)
        elif action == "dial_fails":
            raise ControlFailure("Connect failed. msg=failed to dial: dial tcp4 10.0.0.2:4001: i/o timeout")

    def _onward(self, stage: str, round_: int) -> str:
        for (s, r), action in list(self.items()):
            if s == stage and isinstance(r, str) and round_ >= int(r.rstrip("+")):
                del self[(s, r)]  # once
                return action
        return ""


def faults_from_env(name: str) -> Faults:
    """The faults planned for the peer called `name`.

    P2PDILOCO_FAULTS="peer2@serve_part:3:kill,peer1@exchange:5+:stall" injects faults into the merges of the
    peers so named (the second at the first merge from round 5 on that reaches it); an empty name before '@' is
    an unnamed peer.
    """
    faults = Faults()
    for item in filter(None, os.environ.get("P2PDILOCO_FAULTS", "").split(",")):
        who, _, spec = item.partition("@")
        stage, round_, action = spec.split(":")
        if who == name:
            faults[(stage, round_ if round_.endswith("+") else int(round_))] = action
    if faults:
        logger.warning("fault injection enabled for %s: %s", name, faults)
    return faults
