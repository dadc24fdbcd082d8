"""Shared fixtures: real hivemind DHTs on loopback, and reaping of every child process a test leaves."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from typing import Any

import hivemind
import psutil
import pytest

from p2pdiloco.config import Config, load_config
from p2pdiloco.network.sockets import remove_stale_sockets
from p2pdiloco.network.swarm import BackgroundLoop
from p2pdiloco.util.processes import stop_process

# What a marked test needs beyond `pip install -e ".[dev]"`, and how to get it. Such a test is skipped with that
# reason where it is missing; .ci/run installs each and runs the marked tests in a step of their own (-m hf, -m browser).
HF_EXTRA = ("datasets", "transformers")


def chromium() -> str | None:
    """The headless browser the dashboard's browser test drives, or None."""
    return next((p for p in ("/usr/bin/chromium", shutil.which("chromium"), shutil.which("chromium-browser"))
                 if p and os.access(p, os.X_OK)), None)


def lab_missing() -> str | None:
    """What the WAN lab (network namespaces, NAT, tbf, the NFQUEUE delay daemon) lacks here, or None."""
    if not sys.platform.startswith("linux") or os.geteuid() != 0:
        return "root on Linux"
    missing = [t for t in ("ip", "tc", "iptables") if shutil.which(t) is None]
    if missing:
        return f"{', '.join(missing)} on PATH (apt-get install iproute2 iptables)"
    if importlib.util.find_spec("netfilterqueue") is None:
        return "the NetfilterQueue package (apt-get install libnetfilter-queue-dev; pip install -e '.[lab]')"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    missing_hf = [m for m in HF_EXTRA if importlib.util.find_spec(m) is None]
    hf = pytest.mark.skip(reason=f"needs the hf extra ({', '.join(missing_hf)} not installed): pip install -e '.[hf]'")
    browser = pytest.mark.skip(reason="needs Chromium for the headless browser test: apt-get install chromium")
    lab = pytest.mark.skip(reason=f"the WAN lab needs root, iproute2, iptables and NetfilterQueue; here: {lab_missing()}")
    soak = pytest.mark.skip(reason="a soak of a few minutes: run it on its own with -m soak (.ci/run does)")
    soak_selected = "soak" in (config.getoption("markexpr", "") or "")
    for item in items:
        if missing_hf and item.get_closest_marker("hf"):
            item.add_marker(hf)
        if item.get_closest_marker("browser") and chromium() is None:
            item.add_marker(browser)
        if item.get_closest_marker("lab") and lab_missing() is not None:
            item.add_marker(lab)
        if item.get_closest_marker("soak") and not soak_selected:
            item.add_marker(soak)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Remove the socket files of the p2p daemons that tests killed with their whole process tree (their reaper
    died with them, so nobody else can), once the run is over, as the next DHT start would (network/sockets.py:
    only files no live socket in any network namespace has bound, so never another run's)."""
    if os.environ.get("PYTEST_XDIST_WORKER") is None:  # the controller, after its workers have ended
        remove_stale_sockets(grace_s=0)


def wait_for(condition, timeout: float, interval: float = 0.1, what: str = "condition"):
    """Poll `condition()` until it returns a truthy value or `timeout` seconds pass (then fail the test)."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)


def kill_quietly(procs) -> None:
    """SIGKILL each psutil process that still exists (psutil checks it is the same process, not a reused pid)."""
    for p in procs:
        try:
            p.kill()
        except psutil.Error:
            pass


def interrupt_and_reap(proc: subprocess.Popen, timeout: float = 40) -> None:
    """Cleanup for a p2pdiloco process a test started: Ctrl+C it, kill it if it does not exit in `timeout`
    seconds, and kill whatever it started that outlived it."""
    if proc is None or proc.poll() is not None:
        return
    try:
        descendants = psutil.Process(proc.pid).children(recursive=True)
    except psutil.Error:
        descendants = []
    stop_process(proc, timeout, signal.SIGINT)
    _, alive = psutil.wait_procs(descendants, timeout=10)
    kill_quietly(alive)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_local_dht(initial_peers=None, identity=None) -> hivemind.DHT:
    """A DHT node on loopback; `identity` (a `PeerIdentity`): run with that key, so with its peer id."""
    if identity is None:
        return hivemind.DHT(start=True, initial_peers=initial_peers, host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                            startup_timeout=15)
    from p2pdiloco.network.identity import write_temporary_identity

    path = write_temporary_identity(identity)
    try:
        return hivemind.DHT(start=True, initial_peers=initial_peers, host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                            identity_path=path, check_if_identity_free=False, startup_timeout=15)
    finally:
        os.unlink(path)


@pytest.fixture
def bootstrap_dht():
    dht = start_local_dht()
    try:
        yield dht
    finally:
        dht.shutdown()


@pytest.fixture
def net_loop():
    loop = BackgroundLoop("test-net")
    try:
        yield loop
    finally:
        loop.close()


SINGLETONS = ("torch_shm_manager", "multiprocessing.resource_tracker")
"""Per-process helpers started by the first use (torch's shared-memory manager; multiprocessing's resource tracker,
started by the first spawn) that outlive any one test by design and end with the test process."""


def _is_singleton(p: psutil.Process) -> bool:
    try:
        return any(s in p.name() or s in " ".join(p.cmdline()) for s in SINGLETONS)
    except psutil.Error:
        return False


def run_children() -> set[int]:
    """PIDs of this process's descendants, less the per-process singletons (`SINGLETONS`)."""
    return {p.pid for p in psutil.Process(os.getpid()).children(recursive=True) if not _is_singleton(p)}


@pytest.fixture(autouse=True)
def reap_children():
    """Every process a test started (DHTs, p2pd, peer subprocesses) must be gone after it; kill stragglers."""
    me = psutil.Process(os.getpid())
    before = {p.pid for p in me.children(recursive=True)}
    yield
    # the per-process singletons must outlive each test: waiting on them cost a test that started one 10 s
    leftover = [p for p in me.children(recursive=True) if p.pid not in before and not _is_singleton(p)]
    _, alive = psutil.wait_procs(leftover, timeout=10)
    kill_quietly(alive)
    psutil.wait_procs(alive, timeout=5)


@contextlib.contextmanager
def running_mergers(bootstrap: hivemind.DHT, net_loop: BackgroundLoop, n: int, cfg, n_params: int, identities=(),
                    **kwargs):
    """`n` P2PMergers on their own DHTs joined through `bootstrap`, each in the census of the current epoch (so
    that leaders know their group mates); closed and shut down afterwards. `identities`: the keys of the first
    of them (`start_local_dht`)."""
    from hivemind.utils.timed_storage import get_dht_time

    from p2pdiloco.network.census import epoch_of
    from p2pdiloco.network.p2p_merger import P2PMerger

    maddrs = [str(m) for m in bootstrap.get_visible_maddrs()]
    dhts = [start_local_dht(maddrs, identities[i] if i < len(identities) else None) for i in range(n)]
    mergers = []
    try:
        mergers = [P2PMerger(d, cfg, net_loop, n_params, **kwargs) for d in dhts]
        for m in mergers:  # as a peer's merger does in the background from its start
            net_loop.run(m.matchmaker.census.register(epoch_of(get_dht_time(), cfg.merge.epoch_s)), 10)
        yield mergers
    finally:
        for m in mergers:
            m.close()
        for d in dhts:
            d.shutdown()


def force_leader_order(monkeypatch, rank) -> None:
    """Make `rank(peer, epoch)` (bytes, lowest first) both the order groups are dealt in and the order ready mates
    lead in, whatever nonces they revealed: for tests that need a given peer to lead."""
    from p2pdiloco.network import census, leaders

    monkeypatch.setattr(census, "leader_rank", lambda run_id, peer, epoch: rank(peer, epoch))
    monkeypatch.setattr(leaders, "lead_rank", lambda run_id, peer, epoch, mix: rank(peer, epoch))


def flat(outcome):
    """A merge's outcome (`Merged` or `Alone`) as one flat record, for tests that look at many of its fields: the
    stats' fields, and `alone`, `failure`, `pseudo_grad` (None alone), `total_weight`, `global_state`,
    `state_weight`, `final` and `sent`."""
    from types import SimpleNamespace

    from p2pdiloco.network.merger import Alone

    fields = dict(vars(outcome.stats))
    if isinstance(outcome, Alone):
        return SimpleNamespace(**fields, alone=True, failure=outcome.reason, pseudo_grad=None, total_weight=0.0,
                               global_state=None, state_weight=0.0, final=False, sent=None)
    return SimpleNamespace(**fields, alone=False, failure="", pseudo_grad=outcome.average,
                           total_weight=outcome.weight, global_state=outcome.agreed_state,
                           state_weight=outcome.state_weight, final=outcome.final, sent=outcome.sent)


async def recv_msg(reader, max_payload: int, counter=None) -> tuple[dict, bytes]:
    """Read one frame as a requester does: `wire.recv_header` then `wire.recv_payload`."""
    from p2pdiloco.network.wire import recv_header, recv_payload

    header = await recv_header(reader, counter)
    return header, await recv_payload(reader, max_payload, counter)


def merge_config(**keys: Any) -> Config:
    """A run's config from keys of the swarm's components given as one table (`run_id`, `merge_timeout_s`,
    `codec`, `sync`, ...), as the old `[swarm]` table named them: each lands in the section that holds it now
    (`config.ALIASES`). What `P2PMerger` and `Matchmaker` take."""
    return load_config(None, [{"swarm": keys}])


def with_swarm(cfg: Config, **values: Any) -> Config:
    """`cfg` with the `[swarm]` values given (e.g. the initial peers of one that joins a running node)."""
    return cfg.model_copy(update={"swarm": cfg.swarm.model_copy(update=values)})
