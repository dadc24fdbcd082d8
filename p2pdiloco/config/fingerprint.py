"""Comparing what every peer of a swarm must agree on (`Config.fingerprint`) across peers and versions.

The digest is a hash of the fingerprint's JSON with sorted keys: peers of different versions agree on it as
long as the fingerprint's keys and values are the same, whatever the models look like inside.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any


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
