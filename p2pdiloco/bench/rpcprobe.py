"""`p2pdiloco bench wanrpc`: what one libp2p request and one new connection cost on a WAN lab's links, in round trips.

Two homes of the lab (routers that only route), one p2p daemon each, as hivemind starts them for a peer. The
asking side dials the serving side once (a new connection: TCP, Noise, the muxer), then makes `samples` requests
of 4 bytes each on a new stream each (as every request of a merge does, `rpc.Rpc.call`), and `samples` more on one
stream kept open. Each figure is printed beside the link's round trip home to home (4 × the delay each way set at
a router), as a ratio: that ratio is what the request costs in round trips, and the merge's `k` is the sum of its
requests' (docs/architecture.md, Round trips). Then it sends `bulk_mb` MB over one plain TCP connection, the way
one member's part travels to one owner, with the lab's default congestion control (BBR here) and with Reno (a
loss-based one, as CUBIC is on most volunteers' hosts): what a merge's payload gets of the link.

Needs root, iproute2, iptables and, for delay and loss, the NetfilterQueue package (`p2pdiloco[lab]`).
"""

from __future__ import annotations

import asyncio
import json
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from p2pdiloco.bench.common import machine, report
from p2pdiloco.bench.netns import exec_in
from p2pdiloco.bench.wanlab import WanLab, check_can_run, profile_links

SAMPLES = 30
BULK_MB = 4.0
PORT = 41000
BULK_PORT = 41001
PROTOCOL = "p2pdiloco.probe.echo"
START_S = 60.0


async def _serve(addr: str, info: Path, seconds: float) -> None:
    """A p2p daemon on `addr` answering every 4 bytes with the same 4 bytes, its id and addresses in `info`."""
    from hivemind.p2p import P2P

    p2p = await P2P.create(host_maddrs=[f"/ip4/{addr}/tcp/{PORT}"])

    async def echo(_info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while data := await reader.read(4):
            writer.write(data)
            await writer.drain()
        writer.close()

    try:
        await p2p.add_binary_stream_handler(PROTOCOL, echo)
        maddrs = [str(m).split("/p2p/")[0] for m in await p2p.get_visible_maddrs()]
        info.write_text(json.dumps({"id": p2p.peer_id.to_base58(), "maddrs": maddrs}))
        await asyncio.sleep(seconds)
    finally:
        await p2p.shutdown()


async def _ask(info: Path, samples: int) -> dict:
    """Dial the serving side once, then time `samples` requests on new streams and `samples` on one stream (ms)."""
    from hivemind.p2p import P2P, PeerID
    from hivemind.utils.multiaddr import Multiaddr

    served = json.loads(info.read_text())
    p2p = await P2P.create(host_maddrs=["/ip4/0.0.0.0/tcp/0"])
    peer = PeerID.from_base58(served["id"])

    async def request(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"ping")
        await writer.drain()
        await reader.readexactly(4)

    try:
        t = time.monotonic()
        await p2p._client.connect(peer, [Multiaddr(m) for m in served["maddrs"]])
        figures = {"connect_ms": 1000 * (time.monotonic() - t), "new_stream_ms": [], "same_stream_ms": []}
        for _ in range(samples):
            t = time.monotonic()
            _, reader, writer = await p2p.call_binary_stream_handler(peer, PROTOCOL)
            await request(reader, writer)
            figures["new_stream_ms"].append(1000 * (time.monotonic() - t))
            writer.close()
        _, reader, writer = await p2p.call_binary_stream_handler(peer, PROTOCOL)
        await request(reader, writer)  # the stream's own opening is not counted
        for _ in range(samples):
            t = time.monotonic()
            await request(reader, writer)
            figures["same_stream_ms"].append(1000 * (time.monotonic() - t))
        writer.close()
        return figures
    finally:
        await p2p.shutdown()


def _bulk(sink: str, addr: str, source: str, megabytes: float) -> float:
    """Mbit/s of `megabytes` sent over one TCP connection from namespace `source` to a reader in `sink` at `addr`."""
    reader = subprocess.Popen(exec_in(sink) + [sys.executable, "-m", "p2pdiloco.bench.rpcprobe", "sink", addr],
                              stdout=subprocess.PIPE, text=True)
    try:
        if reader.stdout.readline().strip() != "ready":
            raise RuntimeError("the probe's reading side did not start")
        subprocess.run(exec_in(source) + [sys.executable, "-m", "p2pdiloco.bench.rpcprobe", "send", addr,
                                          str(megabytes)], timeout=600, check=True)
        received, seconds = reader.stdout.readline().split()
        reader.wait(30)
    finally:
        if reader.poll() is None:
            reader.kill()
            reader.wait(10)
    return int(received) * 8 / float(seconds) / 1e6


def _sink(addr: str) -> None:
    with socket.create_server((addr, BULK_PORT)) as server:
        server.settimeout(60)
        print("ready", flush=True)
        conn, _ = server.accept()
        conn.settimeout(600)
        received, t = 0, time.monotonic()
        while data := conn.recv(1 << 16):
            received += len(data)
        print(received, time.monotonic() - t, flush=True)


def _send(addr: str, megabytes: float) -> None:
    with socket.create_connection((addr, BULK_PORT), timeout=60) as conn:
        conn.settimeout(600)
        conn.sendall(b"\0" * int(megabytes * 1e6))


def probe(profile: str, samples: int = SAMPLES, work: Path | None = None, tcp: str = "",
          bulk_mb: float = BULK_MB) -> dict:
    """One lab of two homes on `profile`'s first link, with congestion control `tcp` ('': the lab's default):
    the request figures, the bulk transfer's rate and the link's round trip (ms)."""
    link = profile_links(profile, 1)[0]
    check_can_run("bench wanrpc", [link])
    work = work or Path("runs/bench-wanrpc")
    work.mkdir(parents=True, exist_ok=True)
    info = work / f"probe-{profile}.json"
    info.unlink(missing_ok=True)
    with WanLab([link, link], nat=[False, False], tag="rp", tcp=tcp) as lab:
        server = subprocess.Popen(exec_in(lab.homes[0].ns) + [
            sys.executable, "-m", "p2pdiloco.bench.rpcprobe", "serve", lab.homes[0].addr, str(info),
            str(START_S + 10 * samples)])
        try:
            deadline = time.monotonic() + START_S
            while not (info.exists() and info.stat().st_size) and server.poll() is None:
                if time.monotonic() > deadline:
                    raise RuntimeError("the probe's serving side did not start")
                time.sleep(0.2)  # polling for its file, with a deadline
            asked = subprocess.run(exec_in(lab.homes[1].ns) + [
                sys.executable, "-m", "p2pdiloco.bench.rpcprobe", "ask", str(info), str(samples)],
                capture_output=True, text=True, timeout=START_S + 10 * samples, check=True)
        finally:
            server.terminate()
            try:
                server.wait(10)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait(10)
        bulk = _bulk(lab.homes[0].ns, lab.homes[0].addr, lab.homes[1].ns, bulk_mb) if bulk_mb > 0 else None
    figures = json.loads(asked.stdout.strip().splitlines()[-1])
    return {"link": link.describe(), "rtt_set_ms": 4 * link.delay_ms, "tcp": tcp or "default", "bulk_mb": bulk_mb,
            "bulk_mbit_s": bulk, **figures}


def bench_wanrpc(out: Path, profiles: tuple[str, ...] = ("home",), samples: int = SAMPLES,
                 console: Console | None = None) -> dict:
    """`probe` on each profile, with the lab's default congestion control and with Reno; prints each figure beside
    the round trip set."""
    console = console or Console()
    results = {"machine": machine(), "samples": samples, "profiles": {}}
    for name in profiles:
        for tcp in ("", "reno"):
            console.print(f"{name}, TCP {tcp or 'default'}: a new connection, {samples} requests on new streams, "
                          f"{samples} on one, then {BULK_MB:g} MB over one connection ...")
            results["profiles"][f"{name} {tcp or 'default'}"] = probe(name, samples, out, tcp)
    return report(out, "wanrpc", results, print_wanrpc, console)


def _quantiles(values: list[float]) -> tuple[float, float, float]:
    ordered = sorted(values)
    return statistics.median(ordered), ordered[int(0.9 * (len(ordered) - 1))], ordered[-1]


def _in_rtts(ms: float, rtt_ms: float) -> str:
    return f" ({ms / rtt_ms:.2f})" if rtt_ms else ""


def print_wanrpc(results: dict, console: Console) -> None:
    """Per profile: each figure in ms and, beside it, in round trips of the link home to home."""
    console.print(f"machine: {results['machine']}")
    table = Table(title=f"bench wanrpc: one libp2p request, {results['samples']} samples (ms; in round trips)")
    for column in ("profile, TCP", "RTT set", "new connection", "request, new stream: p50 / p90 / max",
                   "request, kept stream: p50 / p90 / max", "one connection, Mbit/s"):
        table.add_column(column)
    for name, r in results["profiles"].items():
        rtt = r["rtt_set_ms"]
        cells = [" / ".join(f"{q:.0f}" for q in _quantiles(r[key])) + _in_rtts(_quantiles(r[key])[0], rtt)
                 for key in ("new_stream_ms", "same_stream_ms")]
        bulk = f"{r['bulk_mbit_s']:.1f}" if r.get("bulk_mbit_s") is not None else "-"
        table.add_row(name, f"{rtt:.0f}", f"{r['connect_ms']:.0f}{_in_rtts(r['connect_ms'], rtt)}", *cells, bulk)
    console.print(table)
    console.print(f"  links: {'; '.join(sorted({r['link'] for r in results['profiles'].values()}))}")


def main(argv: list[str]) -> None:
    """The sides, run inside the lab's homes: `serve ADDR INFO SECONDS`, `ask INFO SAMPLES`, `sink ADDR`, `send ADDR MB`."""
    if argv[0] == "serve":
        asyncio.run(_serve(argv[1], Path(argv[2]), float(argv[3])))
    elif argv[0] == "ask":
        print(json.dumps(asyncio.run(_ask(Path(argv[1]), int(argv[2])))))
    elif argv[0] == "sink":
        _sink(argv[1])
    else:
        _send(argv[1], float(argv[2]))


if __name__ == "__main__":
    main(sys.argv[1:])
