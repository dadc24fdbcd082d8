"""`p2pdiloco simulate`: parse, build the scenario, simulate, print and write (see p2pdiloco/cli.py for the flags)."""

from __future__ import annotations

import argparse
import copy
import json
import math
import tomllib
from pathlib import Path

from rich.console import Console

from p2pdiloco.config import ConfigError
from p2pdiloco.sim.presets import preset
from p2pdiloco.sim.report import plot_sweeps, print_calibration, print_results, print_seeds
from p2pdiloco.sim.scenario import Scenario, load_scenario, scenario_from_dict
from p2pdiloco.sim.simulate import simulate, sweep
from p2pdiloco.util.files import write_atomic


def parse_sets(sets: list[str]) -> dict:
    """["run.learners=100", ...] -> {"run": {"learners": 100}}; values are TOML (bare words are strings)."""
    out: dict = {}
    for item in sets:
        key, sep, text = item.partition("=")
        table, dot, name = key.strip().partition(".")
        if not sep or not dot or not table or not name:
            raise ConfigError(f"--set takes TABLE.KEY=VALUE, got {item!r}")
        try:
            value = tomllib.loads(f"v = {text}")["v"]
        except tomllib.TOMLDecodeError:
            value = text
        out.setdefault(table, {})[name] = value
    return out


def build_scenario(args: argparse.Namespace) -> Scenario:
    scn = preset(args.preset) if args.preset else Scenario()
    if args.config:
        scn = load_scenario(args.config, scn)
    scn = scenario_from_dict(parse_sets(args.sets), scn)
    if args.learners is not None:
        scn.run.learners = args.learners
    if args.seed is not None:
        scn.run.seed = args.seed
    return scn.validate()


def _finite(x):
    """JSON has no infinity: an infinite MTBF is written as null."""
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_finite(v) for v in x]
    return None if isinstance(x, float) and not math.isfinite(x) else x


def _write(path: Path, data: dict) -> None:
    write_atomic(path, json.dumps(_finite(data), indent=2, sort_keys=True, allow_nan=False) + "\n")


def cmd_simulate(args: argparse.Namespace) -> int:
    console = Console(soft_wrap=True)
    out = Path(args.out or "runs/simulate")
    if args.calibrate:
        if args.preset or args.config:
            raise ConfigError("--calibrate takes its settings from the run; leave out --preset and --config")
        from p2pdiloco.sim.calibrate import calibrate

        run_dir = Path(args.calibrate)
        if not run_dir.is_dir():
            raise ConfigError(f"--calibrate: no folder {run_dir}")
        cal = calibrate(run_dir)
        print_calibration(cal, console)
        out.mkdir(parents=True, exist_ok=True)
        _write(out / "calibration.json", cal)
        console.print(f"wrote {out / 'calibration.json'}")
        return 0
    scn = build_scenario(args)
    out.mkdir(parents=True, exist_ok=True)
    results, timing = simulate(scn)
    print_results(results, timing, console)
    if args.preset == "seeds":
        s16 = copy.deepcopy(scn)
        s16.run.learners, s16.failures.mtbf_s, s16.run.algorithms = 16, 2 * scn.failures.mtbf_s, ["decoupled"]
        g16 = simulate(s16)[0]["algorithms"]["decoupled"]["goodput"]  # the same chips as 16 learners
        results["seeds_16_learners_goodput"] = g16
        print_seeds(results, g16, console)
    _write(out / "simulate.json", results)
    _write(out / "timing.json", timing)
    written = [out / "simulate.json", out / "timing.json"]
    if not args.no_sweep:
        m = scn.failures.mtbf_s if math.isfinite(scn.failures.mtbf_s) else 10 * scn.duration
        by_rate = sweep(scn, "failures", "mtbf_s", [m * k for k in (8, 4, 2, 1, 0.5, 0.25)])
        n = scn.run.learners
        by_n = sweep(scn, "run", "learners", sorted({max(2, n // 8), max(2, n // 4), max(2, n // 2), n, 2 * n}))
        results["sweeps"] = {"mtbf_s": by_rate, "learners": by_n}
        _write(out / "simulate.json", results)
        written += plot_sweeps(by_rate, "mtbf_s", by_n, out)
    console.print("wrote " + ", ".join(str(p) for p in written))
    return 0
