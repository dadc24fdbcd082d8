"""A WAN in network namespaces: a public hub, homes behind routers that route or NAT, shaped links.

Topology (every address in 10.88.0.0/16, and only inside namespaces the lab creates)::

    hub (the "internet": br0 10.88.0.1/24, the bootstrap node lives here)
     ├── router i (wan 10.88.0.(10+i))  ──  home i (eth0 10.88.(100+i).2, router's lan 10.88.(100+i).1)
     └── ...

The hub routes each home's /24 to its router. A router either only routes (a reachable home: anyone can dial
in) or does NAT like a home router without port forwards: iptables MASQUERADE out of its wan, and a stateful
firewall that forwards what the home dials and the answers to it, and drops every unsolicited packet from the
wan (dials in time out, as on the internet). A home's link is shaped at its router: `tbf` on the router's wan
(the home's uplink) and lan (its downlink), and, for delay, jitter and loss, an NFQUEUE rule on the router's
FORWARD chain served by `delayd`, a daemon the lab starts inside the router's namespace (this kernel has no
netem). A packet between two homes crosses both routers, so it gets both delays.

Everything is deleted when the lab closes: on a normal exit, an exception, Ctrl+C, and SIGTERM (turned into
KeyboardInterrupt while the lab is open, if nothing else handles it). A run killed outright (SIGKILL) leaves
namespaces named after its pid; the next lab removes them, and stops what still runs inside them, at its start
(`netns.remove_stale_namespaces`). The host's own interfaces, routes and iptables are never touched: every
command runs with `ip -n NS` or `ip netns exec NS`.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from itertools import cycle

from p2pdiloco.bench import netns
from p2pdiloco.bench.netns import NamespacesUnavailable, sh

logger = logging.getLogger(__name__)

NS_PREFIX = "p2pdwan"
"""Namespace names are p2pdwan<pid><tag>-hub, -r<i> (router i), -h<i> (home i)."""
HUB_ADDR = "10.88.0.1"
MAX_HOMES = 80
DAEMON_START_S = 10.0
"""How long a delay daemon may take to bind its queue and say `ready`."""
DAEMON_STOP_S = 5.0


@dataclass(frozen=True)
class Link:
    """What a home's access link does to its traffic, set at its router (None or 0: not limited)."""

    up_mbit: float | None = None
    """Rate from the home to the internet, Mbit/s."""
    down_mbit: float | None = None
    """Rate from the internet to the home, Mbit/s."""
    delay_ms: float = 0.0
    """Delay added each way, ms (a home-to-hub round trip gets twice this; home to home, four times)."""
    jitter_ms: float = 0.0
    """Standard deviation of a normal jitter added to the delay, ms (packets keep their order)."""
    loss: float = 0.0
    """Probability that a packet crossing the router is dropped, each way, 0..1."""
    name: str = field(default="custom", compare=False)
    """A short name for tables (the profile's link it is)."""

    @property
    def needs_daemon(self) -> bool:
        """Whether this link needs the NFQUEUE delay daemon (tbf alone does rates)."""
        return self.delay_ms > 0 or self.jitter_ms > 0 or self.loss > 0

    def describe(self) -> str:
        """One line for a table: rates, delay, jitter, loss."""
        if self == Link():
            return f"{self.name}: no shaping"
        rate = lambda r: f"{r:g}" if r else "∞"  # noqa: E731
        return (f"{self.name}: {rate(self.up_mbit)}/{rate(self.down_mbit)} Mbit/s up/down, {self.delay_ms:g} ms each way"
                + (f" ± {self.jitter_ms:g}" if self.jitter_ms else "") + f", {self.loss:.1%} loss")


LAN = Link(name="lan")
HOME = Link(up_mbit=20, down_mbit=100, delay_ms=40, loss=0.005, name="home")
INTERCONTINENTAL = Link(up_mbit=50, down_mbit=200, delay_ms=100, jitter_ms=5, loss=0.01, name="intercontinental")
FIBER = Link(up_mbit=100, down_mbit=100, delay_ms=10, jitter_ms=1, name="fiber")
WAN50 = Link(delay_ms=25, name="wan50")
"""25 ms each way at each home's router: 50 ms one way between two homes, no rate limit, no loss."""
PROFILES: dict[str, tuple[Link, ...]] = {
    "lan": (LAN,),
    "home": (HOME,),
    "intercontinental": (INTERCONTINENTAL,),
    "mixed": (HOME, INTERCONTINENTAL, FIBER),
    "wan50": (WAN50,),
}
"""Named profiles: the links of homes 0, 1, 2, ... in turn."""


def profile_links(profile: str, homes: int) -> list[Link]:
    """The link of each of `homes` homes under a named profile (ValueError naming the profiles otherwise)."""
    if profile not in PROFILES:
        raise ValueError(f"unknown profile {profile!r}; profiles: {', '.join(PROFILES)}")
    links = cycle(PROFILES[profile])
    return [next(links) for _ in range(homes)]


@dataclass(frozen=True)
class Home:
    """One home: its namespace, its router's, its address, whether its router does NAT, and its link."""

    index: int
    ns: str
    router: str
    addr: str
    router_wan: str
    nat: bool
    link: Link


def check_can_run(what: str, links: list[Link]) -> None:
    """Raise NamespacesUnavailable, saying what is missing, unless the lab can be built here.

    Args:
        what: the command that needs the lab, for the message.
        links: the links it will shape (the delay daemon's NetfilterQueue is needed only for delay or loss).
    """
    netns.check_can_run(what, ("ip", "tc", "iptables"))
    if any(link.needs_daemon for link in links):
        try:
            import netfilterqueue  # noqa: F401
        except ImportError as e:
            raise NamespacesUnavailable(
                f"{what} needs the NetfilterQueue package for delay and loss (pip install 'p2pdiloco[lab]'; it "
                f"builds against Debian's libnetfilter-queue-dev): {e}") from e


class WanLab(netns.Namespaces):
    """Hub, routers and homes as described in the module docstring; a context manager that deletes them on exit.

    Args:
        links: one per home, its access link.
        nat: one per home, whether its router does NAT (True) or only routes (False).
        tag: distinguishes this process's labs from each other (default: none).
        seed: seed of the delay daemons' loss and jitter draws (router i uses seed + i).
        tcp: the TCP congestion control of the hub and the homes ('' keeps a new namespace's, which is the
            host's: BBR on this machine, whose throughput hardly drops with random loss). Most volunteers' hosts
            run CUBIC (Linux, Windows, macOS), whose throughput falls as 1/(RTT·√loss); `reno` behaves alike and
            is the loss-based one a namespace may set here.
    """

    def __init__(self, links: list[Link], nat: list[bool], tag: str = "", seed: int = 0, tcp: str = ""):
        if len(links) != len(nat) or not 1 <= len(links) <= MAX_HOMES:
            raise ValueError(f"the lab takes 1 to {MAX_HOMES} homes, one link and one NAT flag each")
        base = f"{NS_PREFIX}{os.getpid()}{tag}"
        self.hub = f"{base}-hub"
        self.homes = [Home(i, f"{base}-h{i}", f"{base}-r{i}", f"10.88.{100 + i}.2", f"10.88.0.{10 + i}", n, link)
                      for i, (link, n) in enumerate(zip(links, nat, strict=True))]
        self.seed, self.tcp = seed, tcp
        self.daemons: dict[str, subprocess.Popen] = {}
        self._previous_sigterm = None
        super().__init__()

    @property
    def namespaces(self) -> list[str]:
        """Every namespace of this lab: the hub, then each router and home."""
        return [self.hub] + [ns for h in self.homes for ns in (h.router, h.ns)]

    def _stop_on_sigterm(self) -> None:
        # SIGTERM's default would end the process without running close(): while the lab is open, it raises
        # KeyboardInterrupt like Ctrl+C (only where nothing else handles it, and only the main thread can)
        if threading.current_thread() is threading.main_thread() and (
                signal.getsignal(signal.SIGTERM) == signal.SIG_DFL):
            self._previous_sigterm = signal.SIG_DFL

            def interrupt(*_):
                raise KeyboardInterrupt

            signal.signal(signal.SIGTERM, interrupt)

    def _create(self) -> None:
        self._stop_on_sigterm()
        netns.remove_stale_namespaces(NS_PREFIX)
        hub = self.hub
        self._netns(hub)
        netns.add_bridge(hub, f"{HUB_ADDR}/24")
        _sysctl(hub, "net.ipv4.ip_forward=1")
        _sysctl(hub, "net.ipv4.conf.all.send_redirects=0")  # routers keep sending via the hub: one path
        _sysctl(hub, "net.ipv4.conf.br0.send_redirects=0")
        if self.tcp:
            _sysctl(hub, f"net.ipv4.tcp_congestion_control={self.tcp}")
        for home in self.homes:
            self._create_home(home)

    def _create_home(self, home: Home) -> None:
        i, hub, router, ns = home.index, self.hub, home.router, home.ns
        lan_net = f"10.88.{100 + i}"
        self._netns(router)
        self._netns(ns)
        # each veth is created in one namespace with its other end moved straight into the next, so that no
        # interface ever appears in the host's namespace
        sh("ip", "-n", hub, "link", "add", f"r{i}", "type", "veth", "peer", "name", "wan", "netns", router)
        sh("ip", "-n", hub, "link", "set", f"r{i}", "master", "br0")
        sh("ip", "-n", hub, "link", "set", f"r{i}", "up")
        sh("ip", "-n", router, "link", "add", "lan", "type", "veth", "peer", "name", "eth0", "netns", ns)
        sh("ip", "-n", router, "addr", "add", f"{home.router_wan}/24", "dev", "wan")
        sh("ip", "-n", router, "addr", "add", f"{lan_net}.1/24", "dev", "lan")
        sh("ip", "-n", router, "link", "set", "wan", "up")
        sh("ip", "-n", router, "link", "set", "lan", "up")
        sh("ip", "-n", router, "route", "add", "default", "via", HUB_ADDR)
        _sysctl(router, "net.ipv4.ip_forward=1")
        if self.tcp:
            _sysctl(ns, f"net.ipv4.tcp_congestion_control={self.tcp}")
        sh("ip", "-n", ns, "addr", "add", f"{home.addr}/24", "dev", "eth0")
        sh("ip", "-n", ns, "link", "set", "eth0", "up")
        sh("ip", "-n", ns, "route", "add", "default", "via", f"{lan_net}.1")
        sh("ip", "-n", hub, "route", "add", f"{lan_net}.0/24", "via", home.router_wan)
        self._firewall(home)
        if home.link.up_mbit:
            netns.tbf(router, "wan", home.link.up_mbit, burst=_burst(home.link.up_mbit))
        if home.link.down_mbit:
            netns.tbf(router, "lan", home.link.down_mbit, burst=_burst(home.link.down_mbit))
        if home.link.needs_daemon:
            self._start_daemon(home)

    def _firewall(self, home: Home) -> None:
        """iptables in the router's namespace: NAT and a stateful firewall, or plain routing; and the queue."""
        def ipt(*args: str) -> None:
            sh("ip", "netns", "exec", home.router, "iptables", "-w", "5", *args)

        # what the router forwards goes through the delay daemon's queue (no bypass: a dead daemon cuts the
        # link, which every probe and peer notices, rather than silently unshaping it)
        target = ["NFQUEUE", "--queue-num", "0"] if home.link.needs_daemon else ["ACCEPT"]
        if not home.nat:
            ipt("-A", "FORWARD", "-j", *target)
            return
        ipt("-t", "nat", "-A", "POSTROUTING", "-o", "wan", "-j", "MASQUERADE")
        ipt("-P", "FORWARD", "DROP")
        ipt("-A", "FORWARD", "-i", "lan", "-o", "wan", "-j", *target)
        ipt("-A", "FORWARD", "-i", "wan", "-o", "lan", "-m", "conntrack", "--ctstate", "ESTABLISHED,RELATED",
            "-j", *target)
        # the router itself answers nobody on its wan either (a dial to its public address times out)
        ipt("-P", "INPUT", "DROP")
        ipt("-A", "INPUT", "-i", "lo", "-j", "ACCEPT")
        ipt("-A", "INPUT", "-i", "lan", "-j", "ACCEPT")
        ipt("-A", "INPUT", "-m", "conntrack", "--ctstate", "ESTABLISHED,RELATED", "-j", "ACCEPT")

    def _start_daemon(self, home: Home) -> None:
        link = home.link
        cmd = netns.exec_in(home.router) + [
            sys.executable, "-m", "p2pdiloco.bench.delayd", "--queue", "0", "--delay-ms", f"{link.delay_ms:g}",
            "--jitter-ms", f"{link.jitter_ms:g}", "--loss", f"{link.loss:g}", "--seed", str(self.seed + home.index)]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                                text=True)
        self.daemons[home.router] = proc  # before waiting: close() stops it whatever happens next
        netns.wait_ready(proc, DAEMON_START_S, f"the delay daemon in {home.router}")

    def daemons_alive(self) -> dict[str, bool]:
        """Whether each router's delay daemon still runs (a dead one has cut its home's link)."""
        return {router: proc.poll() is None for router, proc in self.daemons.items()}

    def close(self) -> None:
        """Stop the delay daemons (by pid), anything else still inside the lab, then delete every namespace."""
        for router, proc in self.daemons.items():
            if proc.poll() is None:
                proc.terminate()
            try:
                out, err = proc.communicate(timeout=DAEMON_STOP_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                out, err = proc.communicate(timeout=DAEMON_STOP_S)
            if proc.returncode not in (0, -signal.SIGTERM):
                logger.error("the delay daemon in %s exited with %s: %s", router, proc.returncode, err.strip()[-500:])
            else:
                logger.debug("delay daemon in %s: %s", router, out.strip().splitlines()[-1:] or "-")
        self.daemons.clear()
        super().close()
        if self._previous_sigterm is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._previous_sigterm)
            self._previous_sigterm = None


def _sysctl(ns: str, setting: str) -> None:
    sh("ip", "netns", "exec", ns, "sysctl", "-q", "-w", setting)


def _burst(rate_mbit: float) -> str:
    """tbf's bucket for a rate: 32 KB, or 4 ms of the rate if more (a bucket below rate ÷ timer frequency caps
    the rate below what was set)."""
    return f"{max(32, int(rate_mbit * 1e6 / 8 * 0.004 / 1024))}kb"

