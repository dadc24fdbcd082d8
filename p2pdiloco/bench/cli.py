"""`p2pdiloco bench WHICH`: run one benchmark with the flags the command line gave (see p2pdiloco/cli.py)."""

from __future__ import annotations

import argparse
from pathlib import Path

from p2pdiloco.app.commands import stop_on_signals
from p2pdiloco.config import CODECS, ConfigError


def _positive_ints(text: str | None, flag: str) -> tuple[int, ...]:
    """--h "50,100" -> (50, 100); ConfigError naming `flag` on anything but positive integers."""
    if not text:
        return ()
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        values = ()
    if not values or any(v < 1 for v in values):
        raise ConfigError(f"{flag} takes positive integers separated by commas, got {text!r}")
    return values


def _one_int(text: str | None, flag: str) -> int | None:
    values = _positive_ints(text, flag)
    if len(values) > 1:
        raise ConfigError(f"this benchmark takes one {flag}")
    return values[0] if values else None


def _names(text: str | None, allowed: tuple[str, ...], flag: str) -> tuple[str, ...]:
    """--kinds "nan,final" -> ("nan", "final"); ConfigError naming the allowed values otherwise."""
    if not text:
        return allowed
    names = tuple(text.split(","))
    if any(n not in allowed for n in names):
        raise ConfigError(f"{flag} takes a comma-separated list of {', '.join(allowed)}, got {text!r}")
    return names


def cmd_bench(args: argparse.Namespace) -> int:
    stop_on_signals()  # benches run local swarms (and slowlink its namespaces): stop and clean them up
    out = Path(args.out or f"runs/bench-{args.which}")
    if args.which == "straggler":
        from p2pdiloco.bench.straggler import bench_straggler

        bench_straggler(out, seconds=args.seconds)
    elif args.which == "churn":
        from p2pdiloco.bench.churn import bench_churn

        bench_churn(out, minutes=args.minutes, kill_every=args.kill_every)
    elif args.which == "bandwidth":
        from p2pdiloco.bench.bandwidth import HS, bench_bandwidth

        codecs = tuple(args.codecs.split(",")) if args.codecs else CODECS
        if any(c not in CODECS for c in codecs):
            raise ConfigError(f"--codecs takes a comma-separated list of {', '.join(CODECS)}")
        modes = _names(args.modes, ("sync", "decoupled"), "--modes") if args.modes else ("sync",)
        if len(modes) != 1:
            raise ConfigError("bandwidth: --modes takes one of sync, decoupled")
        bench_bandwidth(out, steps=args.steps or 1000, hs=_positive_ints(args.h, "--h") or HS, codecs=codecs,
                        peers=_one_int(args.peers, "--peers") or 2, sync=modes[0] == "sync")
    elif args.which == "parity":
        from p2pdiloco.bench.parity import bench_parity

        bench_parity(out, steps=args.steps or 3000, h=_one_int(args.h, "--h") or 50,
                     peers=_one_int(args.peers, "--peers") or 4, seeds=args.seeds)
    elif args.which == "slowlink":
        from p2pdiloco.bench.slowlink import bench_slowlink

        bench_slowlink(out, steps=args.steps or 250, h=_one_int(args.h, "--h") or 25,
                       peers=_one_int(args.peers, "--peers") or 2,
                       rate_mbit=args.rate_mbit)
    elif args.which == "loader":
        from p2pdiloco.bench.loader import bench_loader

        bench_loader(out, sets=args.sets)
    elif args.which == "byzantine":
        from p2pdiloco.bench.byzantine import KINDS, MODES, SIZES, bench_byzantine

        kinds = _names(args.kinds, KINDS, "--kinds")
        modes = _names(args.modes, MODES, "--modes")
        sizes = _positive_ints(args.sizes, "--sizes") or SIZES
        if args.hostile < 1 or any(n < args.hostile + 3 for n in sizes):
            raise ConfigError("byzantine needs --hostile >= 1 and at least 3 honest peers in every --sizes swarm")
        bench_byzantine(out, steps=args.steps or 100, sizes=sizes, hostile_count=args.hostile, modes=modes,
                        kinds=kinds, extra_sets=tuple(args.sets), seeds=args.seeds)
    elif args.which == "scale":
        from p2pdiloco.bench.scale import PEERS, STEPS, bench_scale

        bench_scale(out, peers=_positive_ints(args.peers, "--peers") or PEERS, steps=args.steps or STEPS,
                    group_size=args.group_size, extra_sets=tuple(args.sets))
    elif args.which == "dht":
        from p2pdiloco.bench.dht import PEERS, SECONDS, bench_dht

        bench_dht(out, peers=_positive_ints(args.peers, "--peers") or PEERS, seconds=args.dht_seconds or SECONDS)
    elif args.which == "wan":
        from p2pdiloco.bench.wanbench import STEPS, bench_wan

        bench_wan(out, profile=args.profile, peers=_one_int(args.peers, "--peers") or 6, nat=args.nat,
                  steps=args.steps or STEPS, extra_sets=tuple(args.sets))
    else:
        from p2pdiloco.bench.overhead import bench_overhead

        bench_overhead(out, steps=args.steps or 600)
    return 0
