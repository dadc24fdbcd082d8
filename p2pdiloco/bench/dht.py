"""`p2pdiloco bench dht`: a peer's DHT traffic as the swarm grows, p2pdiloco's record stores beside hivemind's.

For each N in --peers, N real DHT nodes (`start_dht`: p2p daemons, signing validators, loopback) run what a peer's
DHT does in steady state and nothing else: the `Heartbeat` (every `swarm.heartbeat_s`, with a record of the size
a training peer writes) and the matchmaking `Census` (a registration and a read every epoch). Twice per N:

- `hivemind`: every record written by hivemind's `DHT.store` (a lookup walk to the key's nearest nodes each time,
  beam of `DHT_BUCKET_SIZE`) and read by a walk with the same beam (`DHT.get`, the census too), `DHT_REPLICAS`
  replicas as now: the baseline, p2pdiloco before `store_near`;
- `store_near`: as peers write and read now (`network/dht_store.py`: stores straight to the nearest nodes, walks
  that fetch no records, an epoch's census read from its nearest node when that copy looks whole).

Figures per run, over `--seconds` after a settling period: DHT bytes/s per node, sent + received (the DHT
process's own counters, as in a peer's summary), mean and max; the same split by request kind (find, store) and
requests made per node per second; and whether a fresh reader sees every node's heartbeat (the stores must stay
findable). Printed: each run's figures, hivemind ÷ store_near at each N, and each N ÷ the smallest N.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from pathlib import Path

from hivemind.utils.timed_storage import get_dht_time
from rich.console import Console

from p2pdiloco.bench.common import machine, write_results
from p2pdiloco.config import SwarmConfig
from p2pdiloco.network import census as census_module
from p2pdiloco.network import swarm
from p2pdiloco.network.census import EPOCH_S, Census, epoch_of
from p2pdiloco.network.dht_store import DHT_BUCKET_SIZE, DHT_REPLICAS
from p2pdiloco.network.swarm import BackgroundLoop, start_dht
from p2pdiloco.network.traffic import Traffic

PEERS = (4, 16, 32)
SECONDS = 60.0
SETTLE_S = 10.0
"""Left out of the figures: start-up (every node's first walks, the first census reads)."""
RUN_ID = "bench-dht"


def _record() -> dict:
    """A heartbeat record with the fields and value sizes a training peer writes (reporting.record and peer.py)."""
    now = time.time()
    return {"fingerprint": "ab" * 8, "reachable": True,
            "step": random.randint(0, 10**5), "round": 3, "tokens": 10**6, "loss": 2.3,
            "eval_loss": 2.1, "eval_loss_per_byte": 0.6, "tokens_per_s": 1000.0, "global_tokens": 10**7,
            "global_digest": "cd" * 8, "merges": 5, "bytes_sent": 10**6, "bytes_received": 10**6,
            "last_group_size": 4, "last_merge_s": 0.5, "last_merge_time": now, "mfu": 0.01}


async def _census_reads(census: Census) -> None:
    while True:
        await census.members(epoch_of(get_dht_time()))
        await asyncio.sleep(EPOCH_S - get_dht_time() % EPOCH_S + random.uniform(0.5, 2.0))


async def _measure(dhts: list, seconds: float) -> dict:
    from p2pdiloco.app.heartbeat import Heartbeat

    traffic = [Traffic() for _ in dhts]
    tasks = []
    for dht in dhts:
        peer_id = dht.peer_id.to_base58()
        maddrs = [str(m) for m in dht.get_visible_maddrs()]
        beat = Heartbeat(dht, RUN_ID, peer_id, _record, SwarmConfig().heartbeat_s)
        census = Census(dht, RUN_ID, peer_id)
        about = {"name": "", "version": "0.1.0", "maddrs": maddrs, "device": "cpu", "started": time.time(),
                 "reach_detail": ""}
        tasks += [asyncio.ensure_future(beat.run({"bench": 1}, lambda a=about: a)),
                  asyncio.ensure_future(census.keep_registered(lambda: False)),
                  asyncio.ensure_future(_census_reads(census))]
    try:
        await asyncio.sleep(SETTLE_S)
        await asyncio.gather(*(t.refresh_dht(d) for t, d in zip(traffic, dhts, strict=True)))
        before = [(t.dht.sent + t.dht.received, {k: list(v) for k, v in t.dht_by_rpc.items()}) for t in traffic]
        t0 = time.monotonic()
        await asyncio.sleep(seconds)
        await asyncio.gather(*(t.refresh_dht(d) for t, d in zip(traffic, dhts, strict=True)))
        elapsed = time.monotonic() - t0
        seen = len(await swarm.read_peers(dhts[-1], RUN_ID))
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    rates = [(t.dht.sent + t.dht.received - b[0]) / elapsed for t, b in zip(traffic, before, strict=True)]
    by_rpc: dict[str, dict[str, float]] = {}
    for t, (_, old) in zip(traffic, before, strict=True):
        for rpc, (made, _served, moved) in t.dht_by_rpc.items():
            was = old.get(rpc, [0, 0, 0])
            row = by_rpc.setdefault(rpc, {"requests_per_s": 0.0, "bytes_per_s": 0.0})
            row["requests_per_s"] += (made - was[0]) / elapsed / len(dhts)
            row["bytes_per_s"] += (moved - was[2]) / elapsed / len(dhts)
    return {"bytes_per_s_mean": statistics.mean(rates), "bytes_per_s_max": max(rates), "by_rpc": by_rpc,
            "records_seen": seen, "seconds": elapsed}


def run_dht(n: int, seconds: float, baseline: bool) -> dict:
    """N nodes for SETTLE_S + `seconds`; `baseline`: writes by hivemind's `DHT.store`, reads with its beam."""
    cfg = SwarmConfig(run_id=RUN_ID, host="127.0.0.1")
    dhts, loop = [], BackgroundLoop("bench-dht")
    patched = swarm.store_near, swarm.DHT_READ_BEAM, census_module.read_near_subkeys
    if baseline:
        swarm.store_near = lambda dht, key, subkey, value, expiration, turn=None: dht.store(
            key, value, expiration, subkey=subkey, return_future=True)
        swarm.DHT_READ_BEAM = DHT_BUCKET_SIZE  # hivemind's default beam, the bucket size
        census_module.read_near_subkeys = swarm.read_subkeys  # the census read by a walk too
    try:
        dhts.append(start_dht(cfg))
        joined = SwarmConfig(**{**cfg.__dict__, "initial_peers": [str(m) for m in dhts[0].get_visible_maddrs()]})
        dhts += [start_dht(joined) for _ in range(n - 1)]
        return loop.run(_measure(dhts, seconds), timeout=SETTLE_S + seconds + 120)
    finally:
        swarm.store_near, swarm.DHT_READ_BEAM, census_module.read_near_subkeys = patched
        loop.close()
        for dht in dhts:
            dht.shutdown()


def bench_dht(out: Path, peers: tuple[int, ...] = PEERS, seconds: float = SECONDS,
              console: Console | None = None) -> dict:
    console = console or Console(soft_wrap=True)
    out.mkdir(parents=True, exist_ok=True)
    results: dict = {"machine": machine(), "seconds": seconds, "replicas": DHT_REPLICAS, "runs": {}}
    for n in peers:
        for name, baseline in (("hivemind", True), ("store_near", False)):
            console.print(f"[bold]{n} nodes, {name}[/bold]: {SETTLE_S:.0f} s settling, {seconds:.0f} s measured ...")
            r = run_dht(n, seconds, baseline)
            results["runs"][f"{n}_{name}"] = r
            rpcs = ", ".join(f"{k} {v['requests_per_s']:.2f}/s {v['bytes_per_s'] / 1e3:.2f} kB/s"
                             for k, v in sorted(r["by_rpc"].items()) if v["requests_per_s"] > 0)
            console.print(f"  DHT bytes/s per node: mean {r['bytes_per_s_mean'] / 1e3:.2f} kB/s, max "
                          f"{r['bytes_per_s_max'] / 1e3:.2f} kB/s ({rpcs}); heartbeats seen by a reader "
                          f"{r['records_seen']} of {n}")
        base, ours = results["runs"][f"{n}_hivemind"], results["runs"][f"{n}_store_near"]
        console.print(f"  {n} nodes: hivemind ÷ store_near, mean {base['bytes_per_s_mean'] / ours['bytes_per_s_mean']:.2f}x")
    smallest = results["runs"][f"{peers[0]}_store_near"]["bytes_per_s_mean"]
    for n in peers[1:]:
        mine = results["runs"][f"{n}_store_near"]["bytes_per_s_mean"]
        console.print(f"store_near at {n} nodes ÷ at {peers[0]}: {mine / smallest:.2f}x")
    path = write_results(out, "dht", results)
    console.print(f"wrote {path}")
    return results
