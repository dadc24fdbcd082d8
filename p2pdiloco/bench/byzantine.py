"""`p2pdiloco bench byzantine`: what one hostile peer in five does to the swarm, with guards on and off.

For each hostile kind (nan, scale ×1000, noise, signflip) a 5-peer swarm runs with peer 0 hostile; the
figure is the honest peers' mean final eval loss ÷ that of a clean run (no hostile peer) with the same
guard setting. Rounds are step-based and synchronous (every round merges all live peers), so the loss
depends on the algorithm, not on how the shared CPU cores happened to schedule the peers.
"""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path

from rich.console import Console

from p2pdiloco.app.local import run_local
from p2pdiloco.bench.common import BENCH_EVAL, BENCH_MODEL, machine, write_results
from p2pdiloco.config import load_config, parse_set
from p2pdiloco.testing.hostile import KINDS

BYZANTINE_SETS = [
    *BENCH_MODEL, *BENCH_EVAL, "run.log_every=10",
    "inner.warmup_steps=10", "swarm.sync=true", "swarm.merge_window_s=30", "run.checkpoint_every=0",
    "swarm.merge_timeout_s=10",  # a merge of this model takes < 1 s; a failing one (guards off) should not take 60
]
HOSTILE_INDEX = 0


def _honest_loss(summary: dict, hostile: str) -> tuple[float, dict]:
    honest = [p for p in summary["peers"] if p.get("name") != f"peer{HOSTILE_INDEX}" or not hostile]
    rejected = {p["name"]: p.get("guard", {}).get("rejected", 0) for p in honest}
    banned = sorted({b[-8:] for p in honest for b in p.get("guard", {}).get("banned", [])})
    losses = [p["eval_loss_final"] for p in honest]
    finite = [x for x in losses if x is not None and x == x]
    loss = statistics.mean(finite) if len(finite) == len(losses) else float("nan")
    return loss, {"rejected": rejected, "banned": banned, "merges": statistics.mean(p["merges"] for p in honest)}


def bench_byzantine(out: Path, steps: int = 60, round_steps: int = 10, peers: int = 5,
                    kinds: tuple[str, ...] = KINDS, console: Console | None = None) -> dict:
    """Runs {clean, each kind} × {guards on, guards off}; returns and writes byzantine.json."""
    console = console or Console()
    out.mkdir(parents=True, exist_ok=True)
    quiet = Console(file=open(os.devnull, "w"))  # noqa: SIM115 - closed with the process
    results: dict = {"machine": machine(), "peers": peers, "steps": steps, "round_steps": round_steps,
                     "hostile_index": HOSTILE_INDEX, "runs": {}}
    for guards in ("on", "off"):
        for kind in ("clean", *kinds):
            name = f"{kind}_guards_{guards}"
            sets = BYZANTINE_SETS + [f"run.total_steps={steps}", f"swarm.round_steps={round_steps}",
                                     f"guard.enabled={'true' if guards == 'on' else 'false'}",
                                     f"swarm.run_id=bench-byz-{name}"]
            cfg = load_config(None, [parse_set(sets)])
            console.print(f"[bold]{name}[/bold]: {peers} peers, {steps} steps ...")
            t0 = time.monotonic()
            peer_sets = {HOSTILE_INDEX: [f"emulate.hostile={kind}"]} if kind != "clean" else None
            summary = run_local(peers, cfg, out / name, None, sets, console=quiet, reraise_interrupt=True, peer_sets=peer_sets)
            if summary["peers_finished"] != peers:
                raise RuntimeError(f"{name}: only {summary['peers_finished']} of {peers} peers finished; see {out / name}")
            loss, detail = _honest_loss(summary, "" if kind == "clean" else kind)
            results["runs"][name] = {"eval_loss": loss, "wall_s": time.monotonic() - t0, **detail}
    runs = results["runs"]
    for guards in ("on", "off"):
        clean = runs[f"clean_guards_{guards}"]["eval_loss"]
        for kind in kinds:
            runs[f"{kind}_guards_{guards}"]["ratio"] = runs[f"{kind}_guards_{guards}"]["eval_loss"] / clean
    results["clean_on_vs_off"] = runs["clean_guards_on"]["eval_loss"] / runs["clean_guards_off"]["eval_loss"]
    path = write_results(out, "byzantine", results)

    console.print(f"machine: {results['machine']}")
    console.print(f"honest peers' final eval loss with peer {HOSTILE_INDEX} hostile ÷ a clean run "
                  f"({peers} peers, {steps} steps, rounds of {round_steps} steps, sync):")
    for kind in kinds:
        on, off = runs[f"{kind}_guards_on"], runs[f"{kind}_guards_off"]
        console.print(f"  {kind:9s} guards on: {on['eval_loss']:.4f} ÷ {runs['clean_guards_on']['eval_loss']:.4f} = "
                      f"{on['ratio']:.3f} (rejected {sum(on['rejected'].values())}, banned by honest peers: "
                      f"{', '.join(on['banned']) or 'none'})   guards off: {off['eval_loss']:.4f} ÷ "
                      f"{runs['clean_guards_off']['eval_loss']:.4f} = {off['ratio']:.3f}")
    console.print(f"  clean run, guards on ÷ off: {runs['clean_guards_on']['eval_loss']:.4f} ÷ "
                  f"{runs['clean_guards_off']['eval_loss']:.4f} = {results['clean_on_vs_off']:.3f}")
    console.print(f"wrote {path}")
    return results
