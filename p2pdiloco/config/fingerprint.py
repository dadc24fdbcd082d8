"""What every peer of a swarm must agree on (`Config.fingerprint`), and comparing it across peers and versions.

The digest is a hash of the fingerprint's JSON with sorted keys: peers of different versions agree on it as
long as the fingerprint's keys and values are the same, whatever the models look like inside.
"""

from __future__ import annotations

import hashlib
import json
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from p2pdiloco.config.schema import Config


def config_fingerprint(cfg: Config, tokenizer: str = "bytes") -> dict[str, Any]:
    """What must be equal on every peer of a swarm for their contributions to mean the same thing: the model,
    the tokenizer, how payloads are encoded, the outer optimizer, the round cadence, merge mode and epochs,
    and the rules that screen and combine contributions (every slice owner must apply the same ones).

    Args:
        cfg: this peer's config.
        tokenizer: the loaded tokenizer's digest (`Tokenizer.digest`): "bytes", or a hash of its file, which
            only the peer that loaded it knows (two machines may keep one tokenizer.json at different paths).
    """
    s = cfg.swarm  # sparse parts are screened against the momentum; peers that screened them otherwise would
    # reduce the same parts to different averages
    sparse = {"sparse_keep": s.sparse_keep, "sparse_screen": "momentum"} if s.codec == "sparseloco" else {}
    return {"model": cfg.model.fingerprint(), "tokenizer": tokenizer,
            "codec": {"codec": s.codec, "error_feedback": s.error_feedback, **sparse},
            "outer": cfg.outer.model_dump(exclude={"eager", "alone_lr", "rebase_keep", "land_wait"}),
            "rounds": {"round_steps": s.round_steps, "round_seconds": s.round_seconds, "sync": s.sync}
            | ({"epoch_s": s.epoch_s} if s.epoch_s != 30 else {}),  # named only when not 30 s: unnamed means 30
            "guard": cfg.guard.model_dump(), "agreement": "catch-up"}  # how members agree on (θg, momentum)


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
