"""`p2pdiloco bench bandwidth`: bytes a peer sends per inner step, each codec and H, beside data-parallel.

Every cell is a real run of `p2pdiloco local`: 2 peers and synchronous DiLoCo by default (so that both peers merge
every round and the runs differ only in codec and H), or `peers` decoupled peers (the default mode of a run, where
groups form from whoever is ready and members whose global models differ also average (θg, momentum)), the same
data, seeds and number of inner steps (equal tokens). Bytes are what the peers' counters saw (merges, state, and the DHT separately); the data-parallel
baseline is a ring all-reduce of fp32 gradients every step, 2·(N−1)/N · params · 4 bytes per peer. Eval loss
of each cell is compared with the uncompressed codec at the same H.
"""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path

from rich.console import Console

from p2pdiloco.app.local import run_local
from p2pdiloco.bench.common import BENCH_MODEL_SETS, machine, write_results
from p2pdiloco.config import CODECS, load_config, parse_set
from p2pdiloco.config.recipes import RECIPES

HS = (50, 100, 250, 500)
LOSS_TOLERANCE = 0.02
"""The bar a codec must clear: eval loss within 2% of uncompressed DiLoCo at the same H."""
TARGET_RATIO = 1000.0


def _cell(out: Path, codec: str, h: int, steps: int, quiet: Console, peers: int = 2, sync: bool = True) -> dict:
    sets = [s for s in BENCH_MODEL_SETS if not s.startswith(("run.total_steps", "emulate.min_step_s"))] + [
        f"run.total_steps={steps}", f"rounds.round_steps={h}", f"codec.name={codec}", f"rounds.sync={str(sync).lower()}",
        "merge.merge_window_s=60", "run.threads=1", "run.eval_every_rounds=0", "run.eval_batches=32",
        f"swarm.run_id=bench-bw-{codec}-{h}", *RECIPES.get(codec, []),
    ]
    cfg = load_config(None, [parse_set(sets)])
    t0 = time.monotonic()
    summary = run_local(peers, cfg, out / f"{codec}_H{h}", None, sets, console=quiet, reraise_interrupt=True)
    if summary["peers_finished"] != peers:
        raise RuntimeError(f"{codec} H={h}: only {summary['peers_finished']} of {peers} peers finished; see {out}")
    peers = summary["peers"]
    merges = sum(p["merges"] for p in peers)
    return {
        "codec": codec, "H": h, "steps": steps, "rounds": statistics.mean(p["rounds"] for p in peers),
        "merges": statistics.mean(p["merges"] for p in peers),
        "bytes_per_step": statistics.mean(p["bytes_sent_per_step"] for p in peers),
        "bytes_per_step_with_dht": statistics.mean(p["bytes_sent_per_step_with_dht"] for p in peers),
        # bytes a peer sent per group merge: all of it (Δ, (θg, momentum), matchmaking), and the Δ exchange alone
        "merge_bytes_per_merge": sum(p["bytes_sent"] for p in peers) / merges if merges else None,
        "pseudo_grad_bytes_per_merge": sum(p.get("pseudo_grad_bytes_sent", 0) for p in peers) / merges if merges else None,
        "state_merges": statistics.mean(p.get("state_merges", 0) for p in peers),
        "ddp_bytes_per_step": peers[0]["ddp_bytes_per_step"],
        "ratio_vs_ddp": summary["bandwidth_ratio_vs_ddp"],
        "ratio_vs_ddp_with_dht": summary["bandwidth_ratio_vs_ddp_with_dht"],
        "eval_loss": summary["eval_loss_final"], "n_params": peers[0]["n_params"],
        "identical": summary["global_models_identical"], "wall_s": time.monotonic() - t0,
    }


def pick_default(cells: list[dict]) -> str | None:
    """The codec with the fewest bytes whose eval loss stays within LOSS_TOLERANCE of uncompressed at every H."""
    ok = []
    for codec in CODECS:
        mine = [c for c in cells if c["codec"] == codec]
        if mine and all(c["loss_vs_none"] is not None and c["loss_vs_none"] <= 1 + LOSS_TOLERANCE for c in mine):
            ok.append((statistics.mean(c["bytes_per_step"] for c in mine), codec))
    return min(ok)[1] if ok else None


def bench_bandwidth(out: Path, steps: int = 1000, hs: tuple[int, ...] = HS, codecs: tuple[str, ...] = CODECS,
                    console: Console | None = None, peers: int = 2, sync: bool = True) -> dict:
    """Run every (codec, H) cell and print the table; results in out/bandwidth.json.

    Args:
        peers: peers of each run.
        sync: synchronous DiLoCo (every peer merges every round) or decoupled (the default mode of a run).
    """
    mode = "sync" if sync else "decoupled"
    console = console or Console(soft_wrap=True)
    out.mkdir(parents=True, exist_ok=True)
    quiet = Console(file=open(os.devnull, "w"))  # noqa: SIM115 - closed with the process
    if "none" not in codecs:
        codecs = ("none", *codecs)  # the baseline of every loss comparison
    cells = []
    for h in hs:
        for codec in codecs:
            console.print(f"codec {codec:5s} H={h:4d}: {peers} {mode} peers × {steps} steps ...")
            cells.append(_cell(out, codec, h, steps, quiet, peers, sync))
    for c in cells:
        base = next(b for b in cells if b["H"] == c["H"] and b["codec"] == "none")
        c["loss_vs_none"] = c["eval_loss"] / base["eval_loss"] if base["eval_loss"] else None
        for key in ("merge_bytes_per_merge", "pseudo_grad_bytes_per_merge"):  # fp32 ÷ ours, per group merge
            c[f"{key}_fp32_ratio"] = base[key] / c[key] if base[key] and c[key] else None
    meets = [c for c in cells if c["ratio_vs_ddp"] and c["ratio_vs_ddp"] >= TARGET_RATIO
             and c["loss_vs_none"] <= 1 + LOSS_TOLERANCE]
    results = {"machine": machine(), "steps": steps, "peers": peers, "mode": mode, "cells": cells, "default_pick": pick_default(cells),
               "meets_target": [f"{c['codec']} H={c['H']}" for c in meets]}
    path = write_results(out, "bandwidth", results)

    console.print(f"machine: {results['machine']}; model {cells[0]['n_params']} params; {peers} peers, {mode} DiLoCo, "
                  f"{steps} inner steps each (equal tokens)")
    console.print(f"data-parallel baseline: {cells[0]['ddp_bytes_per_step']:.0f} bytes/step per peer")
    console.print(f"{'codec':10s} {'H':>4s} {'bytes/step':>11s} {'DDP ÷ ours':>11s} {'(with DHT)':>11s} "
                  f"{'eval loss':>10s} {'÷ none@H':>9s} {'merges':>7s}")
    for c in cells:
        console.print(f"{c['codec']:10s} {c['H']:4d} {c['bytes_per_step']:11.1f} {c['ratio_vs_ddp']:11.1f} "
                      f"{c['ratio_vs_ddp_with_dht']:11.1f} {c['eval_loss']:10.4f} {c['loss_vs_none']:9.4f} "
                      f"{c['merges']:7.1f}")
    console.print("per group merge, bytes a peer sent ÷ fp32's at the same H (all merge traffic / the Δ exchange "
                  "alone), and merges that also averaged (θg, momentum) per peer:")
    for c in cells:
        console.print(f"{c['codec']:10s} H={c['H']:4d}: all {_x(c['merge_bytes_per_merge_fp32_ratio'])}, "
                      f"Δ {_x(c['pseudo_grad_bytes_per_merge_fp32_ratio'])}, state merges {c['state_merges']:.1f}")
    console.print(f"configurations with ≥ {TARGET_RATIO:.0f}× less traffic than data-parallel and eval loss within "
                  f"{LOSS_TOLERANCE:.0%} of uncompressed at the same H: {', '.join(results['meets_target']) or 'none'}")
    console.print(f"fewest bytes within {LOSS_TOLERANCE:.0%} of uncompressed at every H: {results['default_pick']}")
    console.print(f"wrote {path}")
    return results


def _x(ratio: float | None) -> str:
    return f"{ratio:.1f}×" if ratio else "n/a"
