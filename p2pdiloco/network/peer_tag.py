"""How a peer is named in logs and messages: the last 6 characters of its peer id, written once here.

Peer ids share a long common prefix (the multihash's), so their tails tell peers apart at a glance; every log
line of a peer starts with its own tag in brackets (`PeerLog`), and other peers are named by theirs (`short_id`).
"""

from __future__ import annotations

import logging
from collections.abc import MutableMapping
from typing import Any

TAG_CHARS = 6
"""Characters of a peer id's tail that name the peer."""


def short_id(peer_id: str) -> str:
    """The tag of the peer `peer_id` (its id's last `TAG_CHARS` characters)."""
    return peer_id[-TAG_CHARS:]


class PeerLog(logging.LoggerAdapter):
    """A logger whose every line starts with this peer's tag: ``[abc123] merge of round 4 failed ...``.

    Args:
        logger: the module's logger.
        peer_id: this peer's full id (or its tag).
    """

    def __init__(self, logger: logging.Logger, peer_id: str):
        super().__init__(logger, {})
        self.tag = short_id(peer_id)

    def process(self, msg: Any, kwargs: MutableMapping[str, Any]) -> tuple[Any, MutableMapping[str, Any]]:
        return f"[{self.tag}] {msg}", kwargs
