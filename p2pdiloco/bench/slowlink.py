"""`p2pdiloco bench slowlink`: compute utilization of peers whose links are rate-limited (10 Mbit/s).

Each peer runs in its own network namespace, joined to a bridge in a hub namespace by a veth pair with a
`tbf` rate limit on both ends (so a peer has `rate` up and `rate` down, like a symmetric access link); the
bootstrap node runs in the hub. All addresses are in 10.77.0.0/24 and exist only inside namespaces this
benchmark creates and deletes: the host's own interfaces and qdiscs are never touched. Needs root (and
iproute2's `ip` and `tc`); without them it exits with a message that says so.

Compute utilization = time in inner steps ÷ wall time of the training loop (`compute_s / train_s` of each
peer's summary; start-up, the first and last evaluation and the final merge are outside both), measured
for decoupled merging and for `--sync` (which waits for every merge) in the same invocation.
"""

from __future__ import annotations

import logging
import os
import statistics
from pathlib import Path

from rich.console import Console

from p2pdiloco.bench import netns
from p2pdiloco.bench.common import BENCH_DATA, machine, report
from p2pdiloco.bench.netns import NamespacesUnavailable, sh
from p2pdiloco.bench.nsswarm import run_swarm
from p2pdiloco.config import Config, load_config, parse_set
from p2pdiloco.training.model import build_model, count_params

logger = logging.getLogger(__name__)

SUBNET = "10.77.0"
"""The /24 of the benchmark's private network (inside its namespaces only)."""
HUB_ADDR = f"{SUBNET}.1"
BOOTSTRAP_PORT = 31337
NS_PREFIX = "p2pdsl"
"""Namespace names are p2pdsl<pid>-hub and p2pdsl<pid>-p<i>; the pid tells a crashed run's leftovers."""

SLOWLINK_SETS = [
    *BENCH_DATA, "run.eval_batches=4", "run.eval_every_rounds=0", "run.log_every=25",
    "run.checkpoint_every=0",
]


SlowlinkUnavailable = NamespacesUnavailable


def check_can_run() -> None:
    """Raise SlowlinkUnavailable, saying what is missing, unless we are root on Linux with `ip` and `tc`."""
    netns.check_can_run("bench slowlink")


def remove_stale_namespaces() -> list[str]:
    """Delete namespaces left by earlier runs of this benchmark whose process is gone (e.g. SIGKILLed)."""
    return netns.remove_stale_namespaces(NS_PREFIX)


class SlowLinks(netns.Namespaces):
    """`n` peer namespaces, each joined to a bridge in a hub namespace by a veth pair rate-limited with tbf.

    Use as a context manager: everything created is deleted on exit, also after an error or Ctrl+C
    (deleting a namespace deletes its veth ends, the bridge and their qdiscs with it).

    Args:
        n: peer namespaces; peer i gets address 10.77.0.(i+2), the hub's bridge 10.77.0.1.
        rate_mbit: the tbf rate on both ends of every veth, in Mbit/s.
        tag: distinguishes namespaces of this process's SlowLinks (default: none).
    """

    def __init__(self, n: int, rate_mbit: float, tag: str = ""):
        base = f"{NS_PREFIX}{os.getpid()}{tag}"
        self.rate_mbit = rate_mbit
        self.hub = f"{base}-hub"
        self.peers = [f"{base}-p{i}" for i in range(n)]
        self.addresses = [f"{SUBNET}.{i + 2}" for i in range(n)]
        super().__init__()

    def _create(self) -> None:
        self._netns(self.hub)
        netns.add_bridge(self.hub, f"{HUB_ADDR}/24")
        for i, (ns, addr) in enumerate(zip(self.peers, self.addresses, strict=True)):
            self._netns(ns)
            # created inside the hub with its other end moved straight into the peer's namespace, so that no
            # interface ever appears in the host's namespace
            sh("ip", "-n", self.hub, "link", "add", f"v{i}", "type", "veth", "peer", "name", "eth0", "netns", ns)
            sh("ip", "-n", self.hub, "link", "set", f"v{i}", "master", "br0")
            sh("ip", "-n", self.hub, "link", "set", f"v{i}", "up")
            sh("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", "eth0")
            sh("ip", "-n", ns, "link", "set", "eth0", "up")
            netns.tbf(self.hub, f"v{i}", self.rate_mbit)  # what the peer downloads
            netns.tbf(ns, "eth0", self.rate_mbit)  # what the peer uploads

    exec_in = staticmethod(netns.exec_in)


def run_mode(links: SlowLinks, cfg: Config, sets: list[str], out: Path, timeout_s: float) -> dict:
    """One swarm: a bootstrap node in the hub, peer i in namespace i; returns the run's summary."""
    return run_swarm(links.hub, HUB_ADDR, list(zip(links.peers, links.addresses, strict=True)), cfg, sets, out,
                     timeout_s, BOOTSTRAP_PORT)


def bench_slowlink(out: Path, peers: int = 2, steps: int = 250, h: int = 25, step_s: float = 0.2,
                   rate_mbit: float = 10.0, console: Console | None = None) -> dict:
    """Decoupled and --sync swarms over `rate_mbit` links; prints each mode's compute utilization.

    Args:
        out: results folder (slowlink.json, one sub-folder per mode).
        peers: peers, one namespace each.
        steps: inner steps per peer.
        h: inner steps per round.
        step_s: emulated accelerator time per inner step (emulate.min_step_s), so a round takes h·step_s
            seconds whatever else the shared cores do.
        rate_mbit: tbf rate of every link, each direction.
        console: where the table is printed.
    """
    check_can_run()
    console = console or Console()
    out.mkdir(parents=True, exist_ok=True)
    common = SLOWLINK_SETS + [f"run.total_steps={steps}", f"rounds.round_steps={h}", f"emulate.min_step_s={step_s}"]
    n_params = count_params(build_model(load_config(None, [parse_set(common)]).model))
    payload = 2 * (peers - 1) / peers * n_params * 4  # bytes a peer sends (and receives) per merge: RS + AG
    results: dict = {
        "machine": machine(), "peers": peers, "steps": steps, "h": h, "step_s": step_s, "rate_mbit": rate_mbit,
        "n_params": n_params, "payload_bytes_per_merge": payload,
        "transfer_s_per_merge": payload * 8 / (rate_mbit * 1e6), "round_s": h * step_s, "runs": {},
    }
    for ns in remove_stale_namespaces():
        console.print(f"removed a namespace left by an earlier run: {ns}")
    modes = {"decoupled": [], "sync": ["rounds.sync=true", "merge.merge_window_s=60"]}
    with SlowLinks(peers, rate_mbit) as links:
        for mode, mode_sets in modes.items():
            sets = common + mode_sets + [f"swarm.run_id=bench-slowlink-{mode}"]
            cfg = load_config(None, [parse_set(sets)])
            console.print(f"[bold]{mode}[/bold]: {peers} peers in namespaces, {rate_mbit:g} Mbit/s links, "
                          f"{steps} steps, H = {h} ...")
            summary = run_mode(links, cfg, sets, out / mode, timeout_s=3 * steps * step_s + 300)
            p = summary["peers"]
            results["runs"][mode] = {
                "utilization": statistics.mean(x["compute_s"] / x["train_s"] for x in p),
                "per_peer_utilization": [x["compute_s"] / x["train_s"] for x in p],
                "compute_s": statistics.mean(x["compute_s"] for x in p),
                "train_s": statistics.mean(x["train_s"] for x in p),
                "merge_wait_s": statistics.mean(x["merge_wait_s"] for x in p),
                "merges": statistics.mean(x["merges"] for x in p), "rounds": statistics.mean(x["rounds"] for x in p),
                "bytes_sent": statistics.mean(x["bytes_sent"] for x in p), "merge_s_mean": summary["merge_s_mean"],
                "eval_loss": summary["eval_loss_final"],
                "round_compute_s": statistics.mean(x["compute_s"] for x in p) * h / steps,
            }
    r = results["runs"]
    results["decoupled_vs_sync"] = r["decoupled"]["utilization"] / r["sync"]["utilization"]
    return report(out, "slowlink", results, _print, console)


def _print(results: dict, console: Console) -> None:
    r = results["runs"]
    console.print(f"machine: {results['machine']}")
    console.print(f"{results['peers']} peers, {results['n_params']:,} parameters, links {results['rate_mbit']:g} Mbit/s "
                  f"each way; a merge moves {results['payload_bytes_per_merge'] / 1e6:.2f} MB each way per peer = "
                  f"{results['transfer_s_per_merge']:.2f} s at line rate; a round of {results['h']} steps is "
                  f"{results['round_s']:.1f} s of emulated compute (measured: decoupled {r['decoupled']['round_compute_s']:.1f} s, "
                  f"sync {r['sync']['round_compute_s']:.1f} s, the shared cores being slower than the emulation)")
    console.print("compute utilization (time in inner steps ÷ wall time of the training loop):")
    for mode in ("decoupled", "sync"):
        v = r[mode]
        merge = f"{v['merge_s_mean']:.2f} s" if v["merge_s_mean"] is not None else "-"
        console.print(f"  {mode:9s}: {v['compute_s']:.1f} s ÷ {v['train_s']:.1f} s = {v['utilization']:.3f}   "
                      f"({v['merges']:.0f} group merges of {v['rounds']:.0f} rounds, mean merge {merge} from submit "
                      f"to result, {v['merge_wait_s']:.1f} s blocked on merges incl. the final one, "
                      f"{v['bytes_sent'] / 1e6:.1f} MB sent)")
    console.print(f"decoupled ÷ sync utilization: {results['decoupled_vs_sync']:.3f}")

