"""`p2pdiloco status`: who is training in a swarm, how fast, and whether the loss is falling.

Reads the peers' heartbeat records (``{run_id}_peers_{shard}`` in the DHT, see `app/heartbeat.Heartbeat`) and what
each says about itself in its config record (name, version, device, addresses: `network/peer_records.ABOUT_FIELDS`)
through a read-only DHT client, and turns them into one table: a row per live peer and the swarm's totals. The
dashboard shows the same rows (`swarm_status` is shared).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable

import hivemind
from hivemind.utils.timed_storage import get_dht_time

from p2pdiloco.config import SwarmConfig
from p2pdiloco.network.peer_records import read_with_about
from p2pdiloco.network.swarm import BackgroundLoop, SwarmError, live_records, start_dht
from p2pdiloco.util.memory import release_free_memory
from p2pdiloco.util.numbers import finite_number, number_or_none

NUMBER_FIELDS = ("step", "round", "tokens", "tokens_per_s", "merges", "bytes_sent", "bytes_received",
                 "last_group_size", "last_merge_s", "last_merge_time", "started", "time")
"""Numeric fields of a heartbeat record; anything else a peer sends in them is shown as 0."""


def _num(value: object) -> float:
    return value if finite_number(value) else 0.0


def _loss(value: object) -> float | None:
    return number_or_none(value)


def peer_row(peer_id: str, record: dict, now: float) -> dict:
    """One peer's record, with every field present and of the right type, plus `age_s` (seconds since
    the record was written). Records come from strangers: nothing in them is trusted to be well formed."""
    row = {k: _num(record.get(k)) for k in NUMBER_FIELDS}
    name, device, version = (record.get(k) for k in ("name", "device", "version"))
    maddrs = record.get("maddrs")
    row.update(
        peer_id=peer_id,
        name=name[:64] if isinstance(name, str) else "",
        device=device[:32] if isinstance(device, str) else "?",
        version=version[:32] if isinstance(version, str) else "?",
        loss=_loss(record.get("loss")),
        eval_loss=_loss(record.get("eval_loss")),
        mfu=_loss(record.get("mfu")),  # None where the peer's device peak is unknown (CPUs)
        maddrs=[m for m in maddrs[:8] if isinstance(m, str)] if isinstance(maddrs, list) else [],
        # what another node's dial-back told the peer (network/reachability.py): advice it reports, shown as such
        reachable=record.get("reachable") if isinstance(record.get("reachable"), bool) else None,
        reach_detail=record.get("reach_detail")[:200] if isinstance(record.get("reach_detail"), str) else "",
        age_s=max(0.0, now - row["time"]) if row["time"] else None,
    )
    return row


def _mean(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return sum(known) / len(known) if known else None


def swarm_status(records: dict[str, dict], run_id: str, now: float | None = None) -> dict:
    """The swarm as `status --json` prints it: live peers (sorted by name, then id) and their totals.

    Args:
        records: ``{peer_id: heartbeat record}`` as read from the DHT, with what each peer says about itself
            (`peer_records.with_about`); "left" records are skipped.
        run_id: the swarm's run id.
        now: DHT time (Unix seconds) of the reading.
    """
    now = get_dht_time() if now is None else now
    peers = sorted((peer_row(p, r, now) for p, r in live_records(records).items()),
                   key=lambda row: (row["name"] or "~", row["peer_id"]))
    totals = {
        "peers": len(peers),
        "tokens_per_s": sum(p["tokens_per_s"] for p in peers),
        "tokens": sum(p["tokens"] for p in peers),
        "round": max((p["round"] for p in peers), default=0),
        "loss": _mean([p["loss"] for p in peers]),
        "eval_loss": _mean([p["eval_loss"] for p in peers]),
        "bytes_sent": sum(p["bytes_sent"] for p in peers),
        "bytes_received": sum(p["bytes_received"] for p in peers),
    }
    return {"run_id": run_id, "time": now, "totals": totals, "peers": peers}


def human(value: float, unit: str = "") -> str:
    """1234567 -> '1.2M', with `unit` appended ('1.2 MB' for unit 'B')."""
    for factor, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= factor:
            text = f"{value / factor:.1f}{' ' if unit else ''}{prefix}"
            return text + unit
    text = f"{value:.0f}" if float(value).is_integer() or abs(value) >= 10 else f"{value:.1f}"
    return text + (" " + unit if unit else "")


def _ago(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds:.0f} s ago"


def format_status(status: dict) -> str:
    """A plain-text table (no colours, fixed columns) that reads the same in a terminal and in a log."""
    header = ("peer", "id", "device", "version", "reach", "round", "step", "tokens", "tok/s", "MFU", "loss", "eval",
              "sent", "recv", "last merge", "seen")
    rows = []
    now = status["time"]
    for p in status["peers"]:
        merge = "-"
        if p["last_merge_time"]:
            merge = f"{_ago(now - p['last_merge_time'])}, {p['last_group_size']:.0f} peers, {p['last_merge_s']:.1f} s"
        rows.append((
            p["name"] or "-", p["peer_id"][-8:], p["device"], p["version"], _fmt_reach(p.get("reachable")),
            f"{p['round']:.0f}", f"{p['step']:.0f}",
            human(p["tokens"]), human(p["tokens_per_s"]), _fmt_mfu(p.get("mfu")), _fmt_loss(p["loss"]), _fmt_loss(p["eval_loss"]),
            human(p["bytes_sent"], "B"), human(p["bytes_received"], "B"), merge, _ago(p["age_s"]),
        ))
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows, strict=True)]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(line, widths, strict=True)).rstrip()
             for line in (header, *rows)]
    t = status["totals"]
    lines.append("")
    lines.append(f"swarm {status['run_id']!r}: {t['peers']} peers, {human(t['tokens_per_s'])} tokens/s, "
                 f"{human(t['tokens'])} tokens, latest round {t['round']:.0f}, loss {_fmt_loss(t['loss'])}, "
                 f"eval loss {_fmt_loss(t['eval_loss'])}")
    unreachable = [p for p in status["peers"] if p.get("reachable") is False]
    if unreachable:
        lines.append(f"{len(unreachable)} peer(s) cannot be dialed by others (behind NAT or a firewall): they merge "
                     "only in groups led by peers others can dial (docs/operations.md, Behind a home router)")
        lines += [f"  {p['name'] or p['peer_id'][-8:]}: {p['reach_detail'] or 'no detail'}" for p in unreachable]
    return "\n".join(lines)


def _fmt_reach(value: bool | None) -> str:
    return "?" if value is None else ("yes" if value else "NO")


def _fmt_mfu(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def _fmt_loss(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def read_status(loop: BackgroundLoop, dht: hivemind.DHT, run_id: str, wait_s: float) -> dict:
    """Read the swarm's records, retrying for up to `wait_s` seconds while no live peer is seen yet (a fresh
    DHT client may need a moment to reach the nodes that hold them)."""
    deadline = time.monotonic() + wait_s
    while True:
        records = loop.run(read_with_about(dht, run_id, timeout=max(1.0, min(5.0, wait_s))), timeout=30)
        status = swarm_status(records, run_id)
        if status["peers"] or time.monotonic() >= deadline:
            return status
        time.sleep(0.5)  # polling the DHT, with a deadline


def fetch_status(initial_peers: list[str], run_id: str, wait_s: float, swarm_key: str = "") -> dict:
    """Join through `initial_peers` as a DHT client (it stores nothing and serves nobody), read the swarm's
    status, leave. A private swarm's records can be read only with its key file (`swarm_key`). Raises
    SwarmError if the initial peers cannot be reached."""
    cfg = SwarmConfig(run_id=run_id, initial_peers=initial_peers, join_timeout_s=wait_s, swarm_key=swarm_key)
    dht = start_dht(cfg, client_mode=True)
    loop = BackgroundLoop("p2pdiloco-status")
    try:
        return read_status(loop, dht, run_id, wait_s)
    finally:
        loop.close()
        dht.shutdown()


def watch_status(initial_peers: list[str], run_id: str, every_s: float, emit: Callable[[dict], None],
                 stop: threading.Event, wait_s: float = 15.0, swarm_key: str = "") -> None:
    """`status --watch`: one DHT client for as long as `stop` is not set, a reading every `every_s` seconds handed
    to `emit` (an empty swarm too: a watcher keeps watching).

    Raises:
        SwarmError: the initial peers cannot be reached, or the DHT process dies.
    """
    cfg = SwarmConfig(run_id=run_id, initial_peers=initial_peers, join_timeout_s=wait_s, swarm_key=swarm_key)
    dht = start_dht(cfg, client_mode=True)
    loop = BackgroundLoop("p2pdiloco-status")
    try:
        while not stop.is_set():
            t0 = time.monotonic()
            emit(swarm_status(loop.run(read_with_about(dht, run_id, timeout=max(1.0, min(5.0, every_s))), timeout=30),
                              run_id))
            if not dht.is_alive():
                raise SwarmError("the DHT process died; restart the status watcher")
            release_free_memory()  # what malloc keeps of the reading's freed buffers would grow for hours
            stop.wait(max(0.1, every_s - (time.monotonic() - t0)))
    finally:
        loop.close()
        dht.shutdown()


def to_json(status: dict) -> str:
    return json.dumps(status, indent=2)
