"""The network side of a peer: an asyncio event loop in a daemon thread (`BackgroundLoop`)."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Coroutine
from concurrent.futures import Future
from typing import Any

logger = logging.getLogger(__name__)


class BackgroundLoop:
    """An asyncio event loop in a daemon thread, for the network side of a peer.

    The training thread hands it coroutines with `submit` and gets concurrent futures back.
    """

    def __init__(self, name: str = "p2pdiloco-net"):
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def submit(self, coro: Coroutine) -> Future:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine, timeout: float | None = None) -> Any:
        return self.submit(coro).result(timeout)

    def close(self, timeout: float = 5.0) -> None:
        if not self.loop.is_running():
            return

        async def _cancel_all() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        try:
            self.run(_cancel_all(), timeout)
        except Exception as e:  # shutting down: log, never raise
            logger.debug("cancelling network tasks: %r", e)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout)
