"""What every peer of a swarm must agree on (`Config.fingerprint`), and comparing it across peers and versions.

The digest is a hash of the fingerprint's JSON with sorted keys: peers of different versions agree on it as
long as the fingerprint's keys and values are the same, whatever the models look like inside.

The wire protocol has a version, `PROTOCOL_VERSION`: what peers send each other (merge and invite messages, state
downloads, the records in the DHT) and how they agree on a merge's result. Peers of different protocol versions
never train together. The version travels in the fingerprint and in every invite, as ``"protocol": N``, except
version 1, which is written by leaving the key out: version 1 is the protocol of every peer that never named a
version, so its fingerprint, digest and invites stay byte for byte what those peers send and compare. A change to
what is sent, or to what a received message means, is a new version.

What a peer does with a peer of another version:

- at its start, one whose live peers' fingerprints name another version stops with an error that says which
  versions (`network/swarm.check_fingerprint`);
- it declines an invite from a leader of another version, and says so in its log once per leader
  (`network/matchmaking.Matchmaker.on_invite`); a version-1 peer declines a newer leader's invite because its
  fingerprint digest differs;
- the digest in its peer record differs, so a joiner reads the full fingerprints and stops as above before it
  downloads any state.
"""

from __future__ import annotations

import hashlib
import json
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from p2pdiloco.config.schema import Config

PROTOCOL_VERSION = 4
"""The wire protocol this code speaks (see the module's docstring): raise it with any change to what peers send.

2: the leader of a group is drawn from nonces committed in the census and revealed in ready words (leaders.py),
where version 1 ranked ready mates by the public hash alone (peers of the two versions drew different leaders).
3: peer records in `swarm.PEER_SHARDS` = 4 shards, where version 2 wrote and read 8 (a reader of one version misses
the records the other writes under the shards it does not read).
4: what does not change while a peer runs (name, version, addresses, device, start time, the dial-back's detail) is
in its config record (`network/peer_records.ABOUT_FIELDS`), not in every heartbeat, and a peer's records are refused
over `identity.MAX_RECORD_BYTES` (`status` of version 3 shows a version-4 peer without them)."""


def protocol_fields(version: int | None = None) -> dict[str, int]:
    """The ``"protocol"`` entry of a fingerprint or invite of `version` (default `PROTOCOL_VERSION`): none for
    version 1 (see the module's docstring)."""
    version = PROTOCOL_VERSION if version is None else version
    return {} if version == 1 else {"protocol": version}


def protocol_of(message: dict[str, Any]) -> int | None:
    """The protocol version a fingerprint or invite names: 1 if it names none, None if its entry is no version."""
    version = message.get("protocol", 1)
    return version if isinstance(version, int) and not isinstance(version, bool) and version >= 1 else None


def config_fingerprint(cfg: Config, tokenizer: str = "bytes") -> dict[str, Any]:
    """What must be equal on every peer of a swarm for their contributions to mean the same thing: the model,
    the tokenizer, how payloads are encoded, the outer optimizer, the round cadence, merge mode and epochs,
    and the rules that screen and combine contributions (every slice owner must apply the same ones).

    Args:
        cfg: this peer's config.
        tokenizer: the loaded tokenizer's digest (`Tokenizer.digest`): "bytes", or a hash of its file, which
            only the peer that loaded it knows (two machines may keep one tokenizer.json at different paths).
    """
    c, r, epoch_s = cfg.codec, cfg.rounds, cfg.merge.epoch_s
    # sparse parts are screened against the momentum; peers that screened them otherwise would reduce the same
    # parts to different averages
    sparse = {"sparse_keep": c.sparse_keep, "sparse_screen": "momentum"} if c.name == "sparseloco" else {}
    return {"model": cfg.model.fingerprint(), "tokenizer": tokenizer,
            "codec": {"codec": c.name, "error_feedback": c.error_feedback, **sparse},
            "outer": cfg.outer.model_dump(exclude={"eager", "alone_lr", "rebase_keep", "land_wait"}),
            "rounds": {"round_steps": r.round_steps, "round_seconds": r.round_seconds, "sync": r.sync}
            | ({"epoch_s": epoch_s} if epoch_s != 30 else {}),  # named only when not 30 s: unnamed means 30
            "guard": cfg.guard.model_dump(), "agreement": "catch-up",  # how members agree on (θg, momentum)
            **protocol_fields()}


def fingerprint_digest(fingerprint: dict[str, Any]) -> str:
    """A short hex digest of `fingerprint` (16 characters), the same for equal fingerprints on every peer."""
    return hashlib.sha256(json.dumps(fingerprint, sort_keys=True).encode()).hexdigest()[:16]


def fingerprint_diff(mine: dict[str, Any], theirs: dict[str, Any], prefix: str = "") -> list[str]:
    """Human-readable differences between two fingerprints, e.g. ``model.n_layer: 2 here, 4 in swarm``."""
    out = []
    for key in sorted(set(mine) | set(theirs)):
        a, b = mine.get(key), theirs.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            out += fingerprint_diff(a, b, f"{prefix}{key}.")
        elif a != b:
            out.append(f"{prefix}{key}: {a!r} here, {b!r} in the swarm")
    return out
