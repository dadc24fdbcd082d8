"""The `p2pdiloco` command: bootstrap, peer, local. Each entry point parses, builds, runs and closes."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
from pathlib import Path

from p2pdiloco import __version__
from p2pdiloco.config import CODECS, HOSTILE_KINDS, Config, ConfigError, SwarmConfig, load_config, parse_set

logger = logging.getLogger("p2pdiloco")

EPILOG = "Docs: README.md, docs/architecture.md, docs/operations.md."


def setup_logging(verbose: bool) -> None:
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    logging.getLogger("p2pdiloco").setLevel(logging.DEBUG if verbose else logging.INFO)
    # hivemind logs every retried RPC at WARNING; they are expected in a swarm where peers come and go
    if not verbose:
        logging.getLogger("hivemind").setLevel(logging.ERROR)


def add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", metavar="FILE", help="TOML config (see peers/tiny.toml); flags override it")
    p.add_argument("--preset", metavar="NAME",
                   help="a shipped config instead of --config: tiny (CPU), small (~125M, one GPU), medium (~1B, 24 GB GPU)")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override one config value, e.g. --set model.n_layer=4 (repeatable)")
    p.add_argument("--run-dir", metavar="DIR", help="folder for metrics, summary, checkpoint and plots")
    p.add_argument("--run-id", metavar="NAME", help="swarm name; all peers of one run use the same")
    p.add_argument("--data", nargs="+", metavar="PATH", help="text files or folders (default: Python's stdlib sources)")
    p.add_argument("--device", metavar="DEV", help="auto (default), cpu, cuda, cuda:N, mps, xpu")
    p.add_argument("--sync", action="store_true",
                   help="synchronous DiLoCo baseline: wait for every merge and for every live peer")
    p.add_argument("--swarm-key", metavar="FILE", help="private swarm: its key file (p2pdiloco keygen; swarm.swarm_key)")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")


def config_path(args: argparse.Namespace) -> str | None:
    """The TOML file that --config or --preset names, if any."""
    if args.preset:
        from p2pdiloco.config.presets import preset_path

        if args.config:
            raise ConfigError("give --config or --preset, not both")
        return str(preset_path(args.preset))
    return args.config


def config_from_args(args: argparse.Namespace, extra: dict | None = None) -> Config:
    flags: dict[str, dict] = {}
    if args.run_dir:
        flags.setdefault("run", {})["run_dir"] = args.run_dir
    if args.run_id:
        flags.setdefault("swarm", {})["run_id"] = args.run_id
    if args.data:
        flags.setdefault("data", {})["paths"] = args.data
    if args.device:
        flags.setdefault("run", {})["device"] = args.device
    if args.sync:
        flags.setdefault("swarm", {})["sync"] = True
    if args.swarm_key:
        flags.setdefault("swarm", {})["swarm_key"] = str(Path(args.swarm_key).resolve())
    for section, values in (extra or {}).items():
        flags.setdefault(section, {}).update(values)
    return load_config(config_path(args), [flags, parse_set(args.sets)])


def cmd_bootstrap(args: argparse.Namespace) -> int:
    from p2pdiloco.app.bootstrap import run_bootstrap

    run_bootstrap(args.host, args.port, Path(args.identity), args.announce or [],
                  Path(args.maddr_file) if args.maddr_file else None, print_fn=lambda line: print(line, flush=True),
                  swarm_key=args.swarm_key or "")
    return 0


def cmd_peer(args: argparse.Namespace) -> int:
    from p2pdiloco.app.local import summarize
    from p2pdiloco.app.peer import StopFlag, run_peer

    if args.nproc > 1 and "RANK" not in os.environ:  # under torchrun, RANK is set and this process is one rank
        from p2pdiloco.training.distributed import launch_unit, strip_nproc

        return launch_unit(args.nproc, strip_nproc(args.argv))
    extra: dict[str, dict] = {"swarm": {}, "run": {}}
    if args.initial_peers:
        extra["swarm"]["initial_peers"] = args.initial_peers
    if args.host:
        extra["swarm"]["host"] = args.host
    if args.port is not None:
        extra["swarm"]["port"] = args.port
    if args.announce:
        extra["swarm"]["announce"] = args.announce
    if args.name:
        extra["run"]["name"] = args.name
    if args.resume:
        extra["run"]["resume"] = True
    if args.steps is not None:
        extra["run"]["total_steps"] = args.steps
    if args.metrics_port is not None:
        extra["run"]["metrics_port"] = args.metrics_port
    cfg = config_from_args(args, extra)
    stop = StopFlag()
    stop.install()
    summary = run_peer(cfg, stop, announce=lambda line: print(line, flush=True))
    if summary is None:  # a follower rank of a learner unit: rank 0 writes the results
        return 0
    run_dir = Path(cfg.run.run_dir)
    if not args.in_local:  # a peer of `local` leaves the run's summary and plot to it
        summarize(run_dir, [run_dir], cfg.to_dict(), summary["wall_s"])
        try:
            from p2pdiloco.observe.plot import plot_run

            plot_run(run_dir)
        except Exception as e:  # a plot must not lose the run's results
            logger.warning("plotting failed: %r", e)
    print(json.dumps({k: summary[k] for k in ("inner_steps", "rounds", "merges", "eval_loss_initial",
                                               "eval_loss_final")}), flush=True)
    return 0


def parse_slow(items: list[str], n_peers: int) -> dict[int, float]:
    """``["3:4"]`` -> ``{3: 4.0}``: peer 3 runs 4x slower."""
    slow = {}
    for item in items:
        index, sep, factor = item.partition(":")
        try:
            i, f = int(index), float(factor)
        except ValueError:
            raise ConfigError(f"--slow expects INDEX:FACTOR, e.g. 3:4, got {item!r}") from None
        if not sep or not 0 <= i < n_peers or f < 1:
            raise ConfigError(f"--slow {item!r}: need 0 <= INDEX < --peers and FACTOR >= 1")
        slow[i] = f
    return slow


def parse_hostile(items: list[str], n_peers: int) -> dict[int, str]:
    """``["2:nan"]`` -> ``{2: "nan"}``: peer 2 corrupts its contributions with NaNs (see hostile.py)."""
    hostile = {}
    for item in items:
        index, _, kind = item.partition(":")
        if not index.isdigit() or not 0 <= int(index) < n_peers or kind not in HOSTILE_KINDS:
            raise ConfigError(f"--hostile {item!r}: expected INDEX:KIND with 0 <= INDEX < --peers and KIND one of "
                              f"{', '.join(HOSTILE_KINDS)}")
        hostile[int(index)] = kind
    return hostile


def cmd_keygen(args: argparse.Namespace) -> int:
    from p2pdiloco.network.swarm_key import SwarmKeyError, write_new_key

    try:
        path = write_new_key(args.file)
    except SwarmKeyError as e:
        raise ConfigError(str(e)) from None
    print(f"wrote a new swarm key to {path} (mode 0600); give it to every peer of the run over a private "
          f"channel and start them with --swarm-key {path}")
    return 0


def _stop_on_signals() -> None:
    """SIGINT and SIGTERM stop `local` and the benches as Ctrl+C does (peers stopped and reaped).

    SIGINT gets an explicit handler too: a process started in the background by a non-interactive shell (nohup,
    `cmd &`, many CI runners) inherits SIGINT *ignored*, and Python then installs no KeyboardInterrupt handler,
    so `kill -INT` would leave the swarm running. Forked children (the DHT process) keep the default behaviour.
    """
    owner = os.getpid()

    def on_signal(signum, _frame):
        if os.getpid() != owner:
            if signum == signal.SIGINT:
                raise KeyboardInterrupt  # what the default handler would have done in the child
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        raise KeyboardInterrupt

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)


def cmd_local(args: argparse.Namespace) -> int:
    from p2pdiloco.app.local import Chaos, run_local

    if args.peers < 1:
        raise ConfigError("--peers must be >= 1")
    extra = {"run": {"total_steps": args.steps}} if args.steps is not None else {}
    cfg = config_from_args(args, extra)
    sets = list(args.sets)
    if args.data:
        sets.append("data.paths=" + ",".join(str(Path(p).resolve()) for p in args.data))
    if args.device:
        sets.append(f"run.device={args.device}")
    if args.sync:
        sets.append("swarm.sync=true")
    if args.swarm_key:
        sets.append(f"swarm.swarm_key={cfg.swarm.swarm_key}")
    slow = parse_slow(args.slow or [], args.peers)
    peer_sets = {i: [f"emulate.hostile={kind}"] for i, kind in parse_hostile(args.hostile or [], args.peers).items()}
    run_dir = Path(cfg.run.run_dir)
    _stop_on_signals()
    chaos = None
    if args.chaos:
        if args.kill_every <= 0 or args.restart_delay < 0:
            raise ConfigError("--kill-every must be > 0 and --restart-delay >= 0")
        chaos = Chaos(args.kill_every, args.restart_delay, log=run_dir / "chaos.jsonl")
        (run_dir / "chaos.jsonl").unlink(missing_ok=True)
    summary = run_local(args.peers, cfg, run_dir, config_path(args), sets, slow=slow, chaos=chaos, peer_sets=peer_sets,
                        dashboard_port=args.dashboard_port if args.dashboard else None)
    ok = summary["peers_finished"] == args.peers
    print(f"summary: {run_dir / 'summary.json'}")
    if summary["eval_loss_final"] is not None:
        print(f"eval loss {summary['eval_loss_initial']:.4f} -> {summary['eval_loss_final']:.4f} "
              f"({summary['peers_finished']}/{args.peers} peers finished)")
    return 0 if ok else 1


def cmd_status(args: argparse.Namespace) -> int:
    from p2pdiloco.observe.status import fetch_status, format_status, to_json

    status = fetch_status(args.initial_peers, args.run_id, args.timeout, swarm_key=args.swarm_key or "")
    if args.json:
        print(to_json(status), flush=True)
    if not status["peers"]:
        print(f"p2pdiloco status: error: no live peers in swarm {args.run_id!r} seen within {args.timeout:.0f} s "
              "(is --run-id the swarm's?)", file=sys.stderr)
        return 1
    if not args.json:
        print(format_status(status), flush=True)
    return 0


def cmd_dashboard(args: argparse.Namespace) -> int:
    from p2pdiloco.observe.dashboard import run_dashboard

    stop = threading.Event()
    owner = os.getpid()

    def on_signal(signum, _frame):
        if os.getpid() != owner:
            # the DHT process is forked from this one and inherits this handler; there, a SIGTERM (hivemind's
            # "terminate it the hard way" after a slow shutdown) must end the process, not set a copied flag
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    run_dashboard(args.initial_peers, args.run_id, args.host, args.port, args.refresh, stop,
                  announce=lambda line: print(line, flush=True), swarm_key=args.swarm_key or "")
    return 0


def cmd_plot(args: argparse.Namespace) -> int:
    from p2pdiloco.observe.plot import plot_run

    run_dir = Path(args.run_dir)
    if not run_dir.is_dir():
        raise ConfigError(f"{run_dir} is not a folder (expected a run folder, e.g. runs/latest)")
    if not args.verbose:  # the error line below says it; plot_run's own warning would say it twice
        logging.getLogger("p2pdiloco.observe.plot").setLevel(logging.ERROR)
    written = plot_run(run_dir)
    if not written:
        print(f"p2pdiloco plot: error: nothing to plot in {run_dir}: no loss points in peers/*/metrics.jsonl "
              "or metrics.jsonl", file=sys.stderr)
        return 1
    for path in written:
        print(path)
    return 0


def _round_lengths(text: str | None) -> tuple[int, ...]:
    """--h "50,100" -> (50, 100); ConfigError on anything but positive integers."""
    if not text:
        return ()
    try:
        hs = tuple(int(h) for h in text.split(","))
    except ValueError:
        hs = ()
    if not hs or any(h < 1 for h in hs):
        raise ConfigError(f"--h takes positive integers separated by commas, got {text!r}")
    return hs


def _one_round_length(text: str | None) -> int | None:
    hs = _round_lengths(text)
    if len(hs) > 1:
        raise ConfigError("this benchmark takes one --h")
    return hs[0] if hs else None


def cmd_bench(args: argparse.Namespace) -> int:
    _stop_on_signals()  # benches run local swarms (and slowlink its namespaces): stop and clean them up
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
        bench_bandwidth(out, steps=args.steps or 1000, hs=_round_lengths(args.h) or HS, codecs=codecs)
    elif args.which == "parity":
        from p2pdiloco.bench.parity import bench_parity

        bench_parity(out, steps=args.steps or 3000, h=_one_round_length(args.h) or 50, peers=args.peers or 4)
    elif args.which == "slowlink":
        from p2pdiloco.bench.slowlink import bench_slowlink

        bench_slowlink(out, steps=args.steps or 250, h=_one_round_length(args.h) or 25, peers=args.peers or 2,
                       rate_mbit=args.rate_mbit)
    elif args.which == "byzantine":
        from p2pdiloco.bench.byzantine import bench_byzantine

        bench_byzantine(out, steps=args.steps or 60)
    else:
        from p2pdiloco.bench.overhead import bench_overhead

        bench_overhead(out, steps=args.steps or 600)
    return 0


def add_watch_args(p: argparse.ArgumentParser) -> None:
    """The swarm a read-only client (status, dashboard) watches."""
    p.add_argument("--initial-peers", nargs="+", required=True, metavar="MADDR",
                   help="bootstrap node or live peer multiaddrs")
    default_run_id = SwarmConfig.model_fields["run_id"].default
    p.add_argument("--run-id", default=default_run_id, metavar="NAME",
                   help=f"the swarm's run id (default {default_run_id})")
    p.add_argument("--swarm-key", metavar="FILE", help="a private swarm's key file")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="p2pdiloco",
        description="DiLoCo training on volunteer compute: peers find each other through a hivemind DHT, "
        "train locally and merge pseudo-gradients over slow links.",
        epilog=EPILOG,
    )
    parser.add_argument("--version", action="version", version=f"p2pdiloco {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    b = sub.add_parser("bootstrap", help="host a DHT-only bootstrap node", epilog=EPILOG,
                       description="Run a DHT-only node that peers use to find each other. Its identity key is "
                       "created on first run and reused, so its address stays the same across restarts.")
    b.add_argument("--host", default="0.0.0.0", help="interface to listen on (default 0.0.0.0)")
    b.add_argument("--port", type=int, default=31337, help="TCP port (default 31337)")
    b.add_argument("--identity", default="bootstrap.key", metavar="FILE",
                   help="private key file, created if missing (default ./bootstrap.key)")
    b.add_argument("--announce", nargs="+", metavar="MADDR", help="public multiaddrs to advertise, e.g. /ip4/203.0.113.5/tcp/31337")
    b.add_argument("--maddr-file", metavar="FILE", help="also write the node's multiaddrs here")
    b.add_argument("--swarm-key", metavar="FILE", help="private swarm: store and serve only records signed with this key")
    b.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    b.set_defaults(func=cmd_bootstrap)

    p = sub.add_parser("peer", help="join a swarm and train", epilog=EPILOG,
                       description="Join the swarm through any bootstrap node or live peer and train. With no "
                       "--initial-peers, start a new swarm and print the address others should use.")
    p.add_argument("--initial-peers", nargs="+", metavar="MADDR", help="bootstrap node or live peer multiaddrs")
    p.add_argument("--host", help="interface to listen on (default 0.0.0.0)")
    p.add_argument("--port", type=int, help="TCP port to listen on (default: any free one)")
    p.add_argument("--announce", nargs="+", metavar="MADDR", help="public multiaddrs to advertise")
    p.add_argument("--name", help="public name of this peer")
    p.add_argument("--steps", type=int, help="inner steps to run (run.total_steps)")
    p.add_argument("--metrics-port", type=int, metavar="PORT",
                   help="serve Prometheus metrics on this port at /metrics (run.metrics_port; default 0: off)")
    p.add_argument("--resume", action="store_true",
                   help="continue from the newest good checkpoint in --run-dir (the swarm's state wins if it is ahead)")
    p.add_argument("--nproc", type=int, default=1, metavar="N",
                   help="run this peer as N processes (one per GPU, or CPU processes) training data-parallel; "
                   "only the first talks to the swarm. Under torchrun, leave it out")
    p.add_argument("--in-local", action="store_true", help=argparse.SUPPRESS)
    add_config_args(p)
    p.set_defaults(func=cmd_peer)

    lo = sub.add_parser("local", help="run a whole swarm on this machine", epilog=EPILOG,
                        description="Start a bootstrap node and N peers on 127.0.0.1, show their progress, "
                        "and write summary.json and loss.png to the run folder.")
    lo.add_argument("--peers", type=int, default=4, help="number of peers (default 4)")
    lo.add_argument("--steps", type=int, help="inner steps per peer (default: run.total_steps of the config)")
    lo.add_argument("--chaos", action="store_true",
                    help="kill a random peer (SIGKILL) every --kill-every seconds and restart it with --resume")
    lo.add_argument("--kill-every", type=float, default=60.0, metavar="SECONDS", help="chaos: seconds between kills (default 60)")
    lo.add_argument("--restart-delay", type=float, default=5.0, metavar="SECONDS",
                    help="chaos: seconds before a killed peer is restarted (default 5)")
    lo.add_argument("--slow", action="append", metavar="INDEX:FACTOR",
                    help="make peer INDEX FACTOR times slower, emulating an older accelerator (repeatable)")
    lo.add_argument("--hostile", action="append", metavar="INDEX:KIND",
                    help="make peer INDEX corrupt its contributions: nan, scale (x1000), noise or signflip (repeatable)")
    lo.add_argument("--dashboard", action="store_true",
                    help="serve the live web dashboard of this swarm on 127.0.0.1 while it trains")
    lo.add_argument("--dashboard-port", type=int, default=8080, metavar="PORT",
                    help="port of --dashboard (default 8080; 0: any free one, printed at start)")
    add_config_args(lo)
    lo.set_defaults(func=cmd_local)

    st = sub.add_parser("status", help="show the live peers of a swarm", epilog=EPILOG,
                        description="Join the swarm as a read-only DHT client and print a table of its live peers "
                        "(round, steps, tokens, tokens/s, loss, bytes, last merge) and the swarm's totals. Exits 1 "
                        "if no live peer is found.")
    add_watch_args(st)
    st.add_argument("--json", action="store_true", help="print JSON (peers and totals) for scripts")
    st.add_argument("--timeout", type=float, default=15.0, metavar="S",
                    help="give up joining, or waiting for a first peer record, after this many seconds (default 15)")
    st.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    st.set_defaults(func=cmd_status)

    da = sub.add_parser("dashboard", help="serve a live web dashboard of a swarm", epilog=EPILOG,
                        description="Join the swarm as a read-only DHT client and serve a web page with live charts "
                        "(loss per peer, swarm tokens/s, peers joining and leaving, bytes per peer) and the JSON "
                        "API it reads (/api/state, /api/status). Works offline: the page needs no CDN.")
    add_watch_args(da)
    da.add_argument("--host", default="127.0.0.1",
                    help="interface to serve on (default 127.0.0.1; 0.0.0.0 lets other machines see it)")
    da.add_argument("--port", type=int, default=8080, help="HTTP port (default 8080; 0: any free one)")
    da.add_argument("--refresh", type=float, default=2.0, metavar="S",
                    help="seconds between readings of the swarm (default 2)")
    da.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    da.set_defaults(func=cmd_dashboard)

    kg = sub.add_parser("keygen", help="write a new private swarm key", epilog=EPILOG,
                        description="Write a new random swarm key (readable by you only). Peers, bootstrap nodes and "
                        "watchers started with --swarm-key FILE take part only in the swarm of that key.")
    kg.add_argument("file", nargs="?", default="swarm.key", metavar="FILE", help="where to write it (default ./swarm.key)")
    kg.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    kg.set_defaults(func=cmd_keygen)

    pl = sub.add_parser("plot", help="draw a run's loss, throughput and bytes into PNGs", epilog=EPILOG,
                        description="Read RUN_DIR/peers/*/metrics.jsonl (a `local` run) or RUN_DIR/metrics.jsonl "
                        "(one peer's folder) and write loss.png (loss vs time), loss_tokens.png (loss vs tokens), "
                        "throughput.png and bytes.png into RUN_DIR, one colour per peer. `local` and `peer` "
                        "draw them at the end of a run; this redraws them, e.g. while a run goes on.")
    pl.add_argument("run_dir", metavar="RUN_DIR", help="the run folder")
    pl.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    pl.set_defaults(func=cmd_plot)

    be = sub.add_parser("bench", help="measure a figure beside its baseline", epilog=EPILOG,
                        description="straggler: fast peers' inner steps/s with one 4x slower peer ÷ without it, "
                        "decoupled vs --sync, and eval loss at equal wall time (about 7 minutes). overhead: a "
                        "peer's inner-step throughput in a swarm ÷ a plain torch loop (about 3 minutes). churn: "
                        "goodput with a peer killed every minute, decoupled vs --sync vs data-parallel (gloo ranks "
                        "restarted from a checkpoint), and eval loss ÷ a run without churn (4 runs of about "
                        "--minutes each, about 25 minutes by default). bandwidth: bytes per "
                        "inner step ÷ data-parallel for each codec and H, with eval loss at equal tokens (20 runs of "
                        "2 peers). parity: eval loss at equal tokens, decoupled and --sync DiLoCo ÷ data-parallel "
                        "(gloo). slowlink (root): compute utilization of peers in network namespaces over "
                        "tbf-limited links, decoupled vs --sync. byzantine: honest peers' eval loss with one hostile "
                        "peer in 5 ÷ a clean run, per hostile kind, guards on and off (10 short runs).")
    be.add_argument("which", choices=["straggler", "overhead", "churn", "bandwidth", "parity", "slowlink", "byzantine"],
                    help="which benchmark")
    be.add_argument("--out", metavar="DIR", help="output folder (default runs/bench-<which>)")
    be.add_argument("--seconds", type=float, default=60.0, help="straggler: wall time of each of its 4 runs")
    be.add_argument("--steps", type=int, help="overhead: inner steps measured (default 600); bandwidth: inner "
                    "steps per peer per run (1000); parity: inner steps per worker (3000); slowlink: inner "
                    "steps per peer (250); byzantine: inner steps of each run, in rounds of 10 (60)")
    be.add_argument("--h", metavar="H[,H...]", help="inner steps per round: bandwidth tries each (default "
                    "50,100,250,500); parity and slowlink take one (default 50, 25)")
    be.add_argument("--codecs", metavar="C,C,...", help="bandwidth: codecs to try (default all)")
    be.add_argument("--peers", type=int, help="parity: workers (default 4); slowlink: peers (default 2)")
    be.add_argument("--rate-mbit", type=float, default=10.0, help="slowlink: link rate each way (default 10)")
    be.add_argument("--minutes", type=float, default=5.0, help="churn: length of each of its 3 runs")
    be.add_argument("--kill-every", type=float, default=60.0, help="churn: seconds between kills")
    be.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    be.set_defaults(func=cmd_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # `peer --nproc` starts its ranks with these
    setup_logging(args.verbose)
    from p2pdiloco.network.swarm import SwarmError

    try:
        return args.func(args)
    except (ConfigError, SwarmError) as e:
        print(f"p2pdiloco {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"p2pdiloco {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
