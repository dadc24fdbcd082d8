"""A peer's start-up: where its seconds go, a line per phase so that its first seconds are never a silent
screen, and the DHT started beside the data and model instead of after them.

A restart that takes long to train again costs goodput (docs/benchmarks.md, churn), so the `start` line of
metrics.jsonl splits the start-up into phases (`StartupClock.laps`), and the log says each one as it happens.
This module imports no torch or hivemind: `defer_unused_imports` must run before hivemind is first imported.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import sys
import threading
import time
import types
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

logger = logging.getLogger(__name__)

T = TypeVar("T")
A = TypeVar("A")

PREFIX = "start-up: "
"""Every progress line begins with it, so that `p2pdiloco local` can find them in a peer's log."""
STAGES = {
    "importing": "importing",
    "loading": "loading",
    "DHT up": "DHT up",
    "joining": "joining",
    "waiting": "waiting",
    "first inner step": "training",
}
"""How a progress line begins (after `PREFIX`) -> the stage `local` shows for the peer; other lines leave it."""


def say(line: str, *args, tag: str = "") -> None:
    """One progress line, logged at INFO; `line` should begin with a `STAGES` key where the stage changes.

    Args:
        line, args: the message, %-style, after `PREFIX`.
        tag: the peer's short id, once it has one (the DHT is up).
    """
    logger.info((f"[{tag}] " if tag else "") + PREFIX + line, *args)


def stage_of(log_line: str) -> str | None:
    """The stage a line of a peer's log says it reached (see `STAGES`), or None if it is no progress line."""
    at = log_line.find(PREFIX)
    if at < 0:
        return None
    text = log_line[at + len(PREFIX):]
    return next((stage for start, stage in STAGES.items() if text.startswith(start)), None)


class _LoadedOnFirstUse(types.ModuleType):
    """Stands in for a module in `sys.modules` until an attribute it lacks is read (a function, `__file__`): then
    imports the real module in its place and hands the attribute on.

    Not importlib's LazyLoader: its module loads on any attribute read, and every `import` statement reads
    `__spec__`, so the first `import scipy.optimize` would load it all the same.
    """

    def __getattr__(self, attr: str):
        name = self.__name__
        if sys.modules.get(name) is self:
            del sys.modules[name]
        real = importlib.import_module(name)
        parent, _, child = name.rpartition(".")
        setattr(sys.modules[parent], child, real)
        return getattr(real, attr)


def defer_unused_imports() -> None:
    """Put off importing `scipy.optimize` until it is used; call before hivemind is imported.

    hivemind's package imports it (0.3 s on an idle core, about 1 s with four peers starting on two) for the load
    balancing of its DecentralizedAverager, which p2pdiloco never runs (its merger is network/p2p_merger.py).
    Code that does use it gets the real module on its first attribute read.
    """
    name = "scipy.optimize"
    if name in sys.modules:
        return
    try:
        spec = importlib.util.find_spec(name)  # imports the `scipy` package itself (its submodules load lazily)
    except ImportError:  # no scipy: hivemind will say so when it is imported
        return
    if spec is None:
        return
    stand_in = _LoadedOnFirstUse(name)
    # what `import` and inspect.getmodule (torch calls it at import) read; no __path__: importing a submodule
    # loads the package first, as it should
    stand_in.__spec__, stand_in.__loader__, stand_in.__file__ = spec, spec.loader, spec.origin
    sys.modules[name] = stand_in
    sys.modules["scipy"].optimize = stand_in  # as the import system does for a submodule


REQUESTED_AT = "P2PDILOCO_REQUESTED_AT"
"""Set by `p2pdiloco local` for a peer it forks (app/prefork.py): when it asked for it, in Unix seconds."""


def process_started_monotonic(created: float) -> float:
    """time.monotonic() at this process's real start: `created` (its Unix create time), or the moment `local`
    asked for it if that was earlier (a forked peer's fork can wait on the fork server's own imports, which are
    this peer's start-up all the same)."""
    with contextlib.suppress(KeyError, ValueError):
        created = min(created, float(os.environ[REQUESTED_AT]))
    return time.monotonic() - max(0.0, time.time() - created)


class StartupClock:
    """Seconds per start-up phase, from the real start of the process (the `startup` field of the `start` line).

    Phases that run one after another are plain numbers; phases that run at the same time are one entry, a dict
    of each part's own seconds and `wall`, the seconds the phase as a whole took. The plain numbers and the
    `wall`s add up to the time from the process start to the last lap.

    Args:
        t_process_start: time.monotonic() when the process started (interpreter and imports included).
    """

    def __init__(self, t_process_start: float):
        self._t = time.monotonic()
        self.laps: dict[str, float | dict[str, float]] = {"interpreter_and_imports": self._t - t_process_start}

    def lap(self, phase: str) -> float:
        """End `phase` now; returns its seconds."""
        now = time.monotonic()
        self.laps[phase], self._t = now - self._t, now
        return self.laps[phase]

    def lap_parallel(self, phase: str, parts: dict[str, float]) -> float:
        """End `phase`, whose `parts` ran at the same time and took these seconds each; returns its wall seconds."""
        now = time.monotonic()
        wall, self._t = now - self._t, now
        self.laps[phase] = {"wall": wall, **parts}
        return wall

    def side_by_side(self, phase: str, background: tuple[str, Callable[[], A]], here: dict[str, Callable[[], Any]],
                     undo: Callable[[A], object]) -> tuple[A, dict[str, Any]]:
        """Run a part of a phase in a thread while this thread runs the others, one after another, and lap
        `phase` with each part's own seconds.

        Args:
            phase: the phase's name in `laps`.
            background: (name, function) run in a thread of its own: one that mostly waits, such as the DHT's start.
            here: {name: function} run in this thread, in order, once the background part has forked (see
                `start_in_thread`).
            undo: what to do with the background part's result if a part here fails: the error is raised only
                after the background part has finished and been undone.

        Returns:
            The background part's result, and each part's here by name.
        """
        t0 = time.monotonic()
        seconds: dict[str, float] = {}

        def timed() -> A:
            result = background[1]()
            seconds[background[0]] = time.monotonic() - t0
            return result

        pending = start_in_thread(timed, background[0])
        results = {}
        try:
            for name, part in here.items():
                t_part = time.monotonic()
                results[name] = part()
                seconds[name] = time.monotonic() - t_part
        except BaseException:
            with contextlib.suppress(Exception):  # a background part that failed has nothing to undo
                undo(pending.result())
            raise
        done = pending.result()
        self.lap_parallel(phase, {background[0]: seconds[background[0]], **{name: seconds[name] for name in here}})
        return done, results


_fork_count = 0
_forked = threading.Condition()


def _count_fork() -> None:
    global _fork_count
    with _forked:
        _fork_count += 1
        _forked.notify_all()


os.register_at_fork(after_in_parent=_count_fork)


def start_in_thread(fn: Callable[[], T], name: str) -> Future[T]:
    """Run `fn()` in a thread of its own; return once that thread has forked a child process, or `fn` has ended.

    hivemind's DHT forks its process as it starts. A fork copies only the thread that forks, with every lock as
    it was, so the caller's thread must not be in the middle of anything (an import, a torch call) at that moment:
    it goes on with its own work only after this returns.
    """
    future: Future[T] = Future()
    with _forked:
        seen = _fork_count

    def run() -> None:
        try:
            future.set_result(fn())
        except BaseException as e:  # handed to whoever waits on the future
            future.set_exception(e)
        finally:
            with _forked:
                _forked.notify_all()

    threading.Thread(target=run, name=name, daemon=True).start()
    with _forked:
        _forked.wait_for(lambda: _fork_count > seen or future.done())
    return future
