"""`p2pdiloco bench WHICH`: one subcommand per benchmark, each with its own flags (`BENCHES`), and running the one
the command line names."""

from __future__ import annotations

import argparse
from pathlib import Path

from p2pdiloco.app.commands import stop_on_signals
from p2pdiloco.bench.wanlab import PROFILES
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



FLAGS: dict[str, dict] = {
    "--seconds": {"type": float, "default": 60.0},
    "--minutes": {"type": float},
    "--kill-every": {"type": float, "default": 60.0},
    "--steps": {"type": int},
    "--h": {},
    "--peers": {},
    "--codecs": {"metavar": "C,C,..."},
    "--seeds": {"type": int, "default": 1},
    "--modes": {},
    "--rate-mbit": {"type": float, "default": 10.0},
    "--sizes": {"metavar": "N[,N...]"},
    "--hostile": {"type": int, "default": 2},
    "--kinds": {"metavar": "K[,K...]"},
    "--group-size": {"type": int},
    "--dht-seconds": {"type": float},
    "--profile": {"default": "home", "choices": list(PROFILES)},
    "--repeat": {"type": int, "default": 1},
    "--sync": {"action": "store_true"},
    "--joiner": {"action": "store_true"},
    "--tcp": {"default": "default", "choices": ["default", "reno"]},
    "--nat": {"type": int, "default": 4},
    "--samples": {"type": int, "default": 30},
    "--set": {"dest": "sets", "action": "append", "default": [], "metavar": "SECTION.KEY=VALUE"},
}
"""What each bench flag parses to, whichever bench takes it (what it means is each bench's, in `BENCHES`)."""

SEEDS_HELP = ("repeat every run with this many initial models (model.init_seed 1234, 1235, ...) and report each "
              "ratio's mean and spread (default 1)")

BENCHES: dict[str, tuple[str, str, dict[str, str | tuple[str, str]]]] = {
    "straggler": (
        "fast peers' steps/s with a 4x slower peer, vs --sync",
        "Fast peers' inner steps/s with one 4x slower peer ÷ without it, decoupled vs --sync, and eval loss at "
        "equal wall time (4 runs, about 7 minutes).",
        {"--seconds": "wall time of each of its 4 runs (default 60)"}),
    "overhead": (
        "a peer's steps/s in a swarm ÷ a plain torch loop",
        "A peer's inner-step throughput in a swarm ÷ a plain torch loop (about 3 minutes).",
        {"--steps": "inner steps measured (default 600)"}),
    "churn": (
        "goodput with a peer killed every minute, vs --sync and data-parallel",
        "Goodput with a peer killed every minute, decoupled vs --sync vs data-parallel (gloo ranks restarted from "
        "a checkpoint), and eval loss ÷ a run without churn (4 runs of about --minutes each, about 25 minutes by "
        "default).",
        {"--minutes": "length of each of its 4 runs (3 swarms and the data-parallel baseline; default 5)",
         "--kill-every": "seconds between kills (default 60)"}),
    "bandwidth": (
        "bytes per inner step ÷ data-parallel, for each codec and H",
        "Bytes per inner step ÷ data-parallel for each codec and H, with eval loss at equal tokens (20 runs of 2 "
        "peers).",
        {"--steps": "inner steps per peer per run (default 1000)",
         "--h": ("H[,H...]", "inner steps per round, each tried in turn (default 50,100,250,500)"),
         "--codecs": "codecs to try (default all)",
         "--peers": ("N", "peers (default 2)"),
         "--modes": ("M", "sync or decoupled (default sync)")}),
    "parity": (
        "eval loss at equal tokens ÷ data-parallel (gloo)",
        "Eval loss at equal tokens, decoupled and --sync DiLoCo ÷ data-parallel (gloo).",
        {"--steps": "inner steps per worker (default 3000)", "--h": ("H", "inner steps per round (default 50)"),
         "--peers": ("N", "workers (default 4)"), "--seeds": SEEDS_HELP}),
    "slowlink": (
        "compute utilization over 10 Mbit/s links, vs --sync (root)",
        "Compute utilization of peers in network namespaces over tbf-limited links, decoupled vs --sync (needs "
        "root).",
        {"--steps": "inner steps per peer (default 250)", "--h": ("H", "inner steps per round (default 25)"),
         "--peers": ("N", "peers (default 2)"), "--rate-mbit": "link rate each way (default 10)"}),
    "byzantine": (
        "honest peers' loss with 2 hostile peers ÷ a clean run",
        "Honest peers' eval loss with 2 hostile peers ÷ a clean run, per hostile kind, swarm size (5, 9) and mode "
        "(sync, decoupled), default guards (44 runs, over an hour; --sizes, --modes, --kinds pick fewer).",
        {"--steps": "inner steps of each run, in sync rounds of 5 (default 100)",
         "--sizes": "swarm sizes (default 5,9)", "--hostile": "hostile peers in each swarm (default 2)",
         "--modes": ("M[,M]", "sync, decoupled or both (default both)"),
         "--kinds": "hostile kinds (default honest_only, nan, scale, noise, signflip, takeover, final, leader, "
                    "sybil_donor, grinder, pinner, flood; honest_only is a clean run of the honest peers alone)",
         "--seeds": SEEDS_HELP,
         "--set": "override one config value of every run, e.g. --set data.tokenizer=tokenizer.json (repeatable)"}),
    "loader": (
        "the data loader's tokens/s ÷ the trainer's",
        "The data loader's tokens/s (cold tokenization, cached load, next_batch) beside the trainer's inner steps "
        "on CPU, as a ratio (target >= 10x; under a minute; --set picks tokenizer, data, model).",
        {"--set": "override one config value, e.g. --set data.tokenizer=tokenizer.json (repeatable)"}),
    "scale": (
        "a peer's bytes, merge time, memory and CPU per swarm size ÷ the smallest",
        "Per peer DHT bytes/s, merge bytes per round, merge time, group share, consensus, eval loss, start-up, host "
        "memory (PSS of its processes) and CPU outside inner steps, for swarms of --peers N (default 4, 8, 16, "
        "32), each ÷ the smallest swarm's (one run of about 2-3 minutes per N).",
        {"--steps": "inner steps per peer, padded to 0.3 s each (default 350, about 105 s of training)",
         "--peers": ("N[,N...]", "swarm sizes, one run each, the smallest the baseline (default 4,8,16,32)"),
         "--group-size": "merge.group_size, the largest merge group (default the config's, 8)",
         "--set": "override one config value, e.g. --set emulate.min_step_s=1 --set rounds.round_seconds=10 "
                  "(repeatable)"}),
    "dht": (
        "per node DHT bytes/s, p2pdiloco's record stores beside hivemind's",
        "Per node DHT bytes/s of N nodes running only the heartbeat and census loops, p2pdiloco's record stores "
        "beside hivemind's store (two runs of about --dht-seconds + 20 s per N; default N 4, 16, 32).",
        {"--peers": ("N[,N...]", "DHT nodes (default 4,16,32)"),
         "--dht-seconds": "seconds measured per run, after 10 s of settling (default 60)"}),
    "wan": (
        "peers behind NAT routers on shaped home links, beside lan (root)",
        "Peers in homes behind routers (the first --nat of them NAT with a stateful firewall, the rest reachable) "
        "over links shaped by --profile (tbf rates, delay and loss from an NFQUEUE daemon), beside the same on the "
        "lan profile: the lab's own measured RTT, rates and loss, then per peer the rounds merged in a group vs "
        "alone, the group merge time and whether the final global models are identical (two runs of about 2 "
        "minutes; needs root; docs/wanlab.md).",
        {"--steps": "inner steps per peer, padded to 0.3 s each (default 200)",
         "--peers": ("N", "peers, one home each (default 6)"),
         "--profile": "the links of the homes (default home: 20/100 Mbit/s, 40 ms each way, 0.5 % loss; wan50: 25 "
                      "ms each way at each home, 50 ms home to home; see docs/wanlab.md)",
         "--nat": "how many of the peers are behind NAT routers (default 4)",
         "--repeat": "runs of the profile, each in a fresh lab, after one run of lan; counts the clean ones (no "
                     "failed dial, no merge over 2x the median, no split) (default 1)",
         "--sync": "also run the profile with synchronous rounds of 10 steps (--sync), beside lan and decoupled",
         "--joiner": "in every run, start one more peer behind NAT at half the run, and time its state download and "
                     "first group merge",
         "--tcp": "TCP congestion control of the lab's hosts: default (the machine's, BBR here) or reno (loss-based, "
                  "as CUBIC on most volunteers' hosts)",
         "--set": "override one config value of the peers, e.g. --set data.tokenizer=tokenizer.json (repeatable)"}),
    "wanrpc": (
        "what a libp2p request and a new connection cost in round trips (root)",
        "One new connection, then --samples requests on new streams and --samples on one kept stream, between two "
        "homes of the WAN lab on the lan profile and on --profile, each beside the link's round trip (under a "
        "minute; needs root; docs/wanlab.md).",
        {"--profile": "the links of the two homes (default home)",
         "--samples": "requests of each kind (default 30)"}),
    "wancodec": (
        "int4 against --recipe sparseloco in time to a loss on home links, a 22M model (root)",
        "The default codec (int4) against --recipe sparseloco, each in a fresh WAN lab of the home profile (20/100 "
        "Mbit/s, 40 ms each way, 0.5 % loss), and int4 on lan, with a model whose int4 merge is 11.9 MB a peer "
        "(inner steps padded to 1 s, 10 s timed rounds): wall-clock time until the peers' mean eval loss reaches a "
        "target, merge time, bytes per merge, rounds in a group, compute utilization, final eval loss, each beside "
        "int4's as a ratio (three runs of about 7 minutes; needs root; docs/wanlab.md).",
        {"--steps": "inner steps per peer, padded to 1 s each (default 300)",
         "--peers": ("N", "peers, one home each (default 2)"),
         "--nat": "how many of the peers are behind NAT routers (default 0)",
         "--codecs": ("A,A[,...]", "the arms, each a codec or recipe with an optional @PROFILE (default home), the "
                                   "first the baseline (default int4,sparseloco,int4@lan)"),
         "--set": "override one config value of the peers of every arm, e.g. --set model.d_model=1280 "
                  "(repeatable)"}),
    "soak": (
        "a peer's memory, fds, threads, sockets, disk and DHT records over an hour of churn",
        "A swarm under churn (a peer SIGKILLed and restarted, one stopped with SIGTERM and resumed, a fresh peer "
        "joining, one event every twelfth of the run, none in its last 30 s) sampled every 30 s: per process of "
        "each peer PSS, USS, open fds, threads and child processes; socket files in /tmp, the run folder's bytes, "
        "the DHT records a node holds. Slopes after a warm-up beside their limits, one plot per figure, the share of group merges early "
        "and late, and whether the final models are identical.",
        {"--minutes": "length of the run (default 60; the warm-up is 10 minutes, a sixth of shorter runs)",
         "--peers": ("N", "peers at the start (default 4; peer0 is never disturbed)")}),
}
"""Each benchmark: (one-line help, description, {flag: help, or (metavar, help)}); each takes --out and -v too."""
BENCH_DEFAULTS: dict[str, dict] = {"wancodec": {"nat": 0}}
"""Where a bench's default differs from the one in `FLAGS`."""


def add_bench_parser(sub: argparse._SubParsersAction, epilog: str) -> None:
    """`p2pdiloco bench`, and under it one subcommand per benchmark with its own flags."""
    be = sub.add_parser("bench", help="measure a figure beside its baseline", epilog=epilog,
                        description="Run one benchmark: its figure beside its baseline, written into --out. "
                        "`p2pdiloco bench WHICH --help` says what each flag means for that benchmark.")
    which = be.add_subparsers(dest="which", required=True, metavar="WHICH")
    for name, (line, description, flags) in BENCHES.items():
        b = which.add_parser(name, help=line, description=description, epilog=epilog)
        b.add_argument("--out", metavar="DIR", help=f"output folder (default runs/bench-{name})")
        for flag, meaning in flags.items():
            metavar, text = meaning if isinstance(meaning, tuple) else (None, meaning)
            kwargs = {**FLAGS[flag], **({"metavar": metavar} if metavar else {})}
            b.add_argument(flag, help=text.replace("%", "%%"), **kwargs)
        b.add_argument("-v", "--verbose", action="store_true", help="debug logging")
        b.set_defaults(func=cmd_bench, **BENCH_DEFAULTS.get(name, {}))


def cmd_bench(args: argparse.Namespace) -> int:
    stop_on_signals()  # benches run local swarms (and slowlink its namespaces): stop and clean them up
    out = Path(args.out or f"runs/bench-{args.which}")
    if args.which == "straggler":
        from p2pdiloco.bench.straggler import bench_straggler

        bench_straggler(out, seconds=args.seconds)
    elif args.which == "churn":
        from p2pdiloco.bench.churn import bench_churn

        bench_churn(out, minutes=args.minutes or 5.0, kill_every=args.kill_every)
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
    elif args.which in ("wan", "wanrpc", "wancodec"):
        _wan_lab_bench(args, out)
    elif args.which == "soak":
        from p2pdiloco.bench.soak import bench_soak

        bench_soak(out, minutes=args.minutes or 60.0, peers=_one_int(args.peers, "--peers") or 4)
    else:
        from p2pdiloco.bench.overhead import bench_overhead

        bench_overhead(out, steps=args.steps or 600)
    return 0


def _wan_lab_bench(args: argparse.Namespace, out: Path) -> None:
    """The benches that build a WAN lab (root): wan, wanrpc, wancodec."""
    if args.which == "wan":
        from p2pdiloco.bench.wanbench import STEPS, bench_wan

        bench_wan(out, profile=args.profile, peers=_one_int(args.peers, "--peers") or 6, nat=args.nat,
                  steps=args.steps or STEPS, extra_sets=tuple(args.sets), repeat=args.repeat, sync=args.sync,
                  joiner=args.joiner, tcp="" if args.tcp == "default" else args.tcp)
    elif args.which == "wanrpc":
        from p2pdiloco.bench.rpcprobe import bench_wanrpc

        if args.samples < 1:
            raise ConfigError(f"--samples takes a positive integer, got {args.samples}")
        bench_wanrpc(out, profiles=tuple(dict.fromkeys(("lan", args.profile))), samples=args.samples)
    else:
        from p2pdiloco.bench.wancodec import bench_from_args

        bench_from_args(out, args)
