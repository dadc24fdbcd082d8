"""What each `p2pdiloco` command does, once its flags are parsed (see p2pdiloco/cli.py for the flags).

Each parses its config, builds, runs and closes; the heavy imports (torch, hivemind) happen inside the
command that needs them, so `p2pdiloco --help` stays fast.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
from pathlib import Path

from p2pdiloco.app.flags import flag_overrides, forwarded_sets
from p2pdiloco.config import HOSTILE_KINDS, Config, ConfigError, DataConfig, load_config, parse_set
from p2pdiloco.config.recipes import recipe_sets

logger = logging.getLogger("p2pdiloco")


def config_path(args: argparse.Namespace) -> str | None:
    """The TOML file that --config or --preset names, if any."""
    if args.preset:
        from p2pdiloco.config.presets import preset_path

        if args.config:
            raise ConfigError("give --config or --preset, not both")
        return str(preset_path(args.preset))
    return args.config


def user_sets(args: argparse.Namespace) -> list[str]:
    """The `section.key=value` settings given on the command line: --recipe's, then the --set flags over them."""
    return [*recipe_sets(args.recipe), *args.sets]


def config_from_args(args: argparse.Namespace) -> Config:
    """The config of a command that trains (`args.command`: peer or local): --config or --preset, under --recipe,
    the command's config flags (app/flags.py) and --set, in that order."""
    flags = flag_overrides(args, args.command)
    cfg = load_config(config_path(args), [parse_set(recipe_sets(args.recipe)), flags, parse_set(args.sets)])
    if cfg.data.tokenizer not in ("", "bytes") and Path(cfg.data.tokenizer).expanduser().is_file():
        # recorded as found from here, so that `sample` and `export` find it again from any folder
        cfg.data.tokenizer = str(Path(cfg.data.tokenizer).expanduser().resolve())
    return cfg


def cmd_bootstrap(args: argparse.Namespace) -> int:
    from p2pdiloco.app.bootstrap import run_bootstrap

    run_bootstrap(args.host, args.port, Path(args.identity), args.announce or [],
                  Path(args.maddr_file) if args.maddr_file else None, print_fn=lambda line: print(line, flush=True),
                  swarm_key=args.swarm_key or "")
    return 0


def cmd_peer(args: argparse.Namespace) -> int:
    if args.nproc > 1 and "RANK" not in os.environ:  # under torchrun, RANK is set and this process is one rank
        from p2pdiloco.training.distributed import launch_unit, strip_nproc

        return launch_unit(args.nproc, strip_nproc(args.argv))
    cfg = config_from_args(args)  # a bad flag or value fails here, before seconds of imports
    from p2pdiloco.app.startup import defer_unused_imports, say

    say("importing torch and hivemind")  # the longest silent part of a start on a busy machine
    defer_unused_imports()  # before hivemind is imported
    from p2pdiloco.app.peer import StopFlag, run_peer

    stop = StopFlag()
    stop.install()
    summary = run_peer(cfg, stop, announce=lambda line: print(line, flush=True),
                       start_barrier=Path(args.start_barrier) if args.start_barrier else None)
    if summary is None:  # a follower rank of a learner unit: rank 0 writes the results
        return 0
    run_dir = Path(cfg.run.run_dir)
    if not args.in_local:  # a peer of `local` leaves the run's summary and plot to it
        from p2pdiloco.app.summary import summarize

        summarize(run_dir, [run_dir], cfg.to_dict(), summary["wall_s"])
        try:
            from p2pdiloco.observe.plot import plot_run

            plot_run(run_dir)
        except Exception as e:  # a plot must not lose the run's results
            logger.warning("plotting failed: %r", e)
    print(json.dumps({k: summary[k] for k in ("inner_steps", "rounds", "merges", "eval_loss_initial",
                                               "eval_loss_final", "eval_loss_per_byte_final")}), flush=True)
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


def stop_on_signals() -> None:
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


def warm_token_cache(cfg: Config) -> None:
    """Tokenize the run's data once, here, before `local` starts its peers: else each of them would tokenize the
    same text at the same time on the same cores. A bad tokenizer or vocabulary size fails here, once."""
    if cfg.data.tokenizer in ("", "bytes") and not cfg.data.dataset:
        return  # byte-level text files: nothing to tokenize, nothing cached
    from p2pdiloco.training.corpus import load_corpus
    from p2pdiloco.training.tokenizer import check_vocab, load_tokenizer

    tokenizer = load_tokenizer(cfg.data.tokenizer)
    check_vocab(tokenizer, cfg.model.vocab_size, cfg.data.tokenizer)
    if cfg.data.cache_dir:
        load_corpus(cfg.data, tokenizer, min_tokens=2 * (cfg.model.seq_len + 1))


def cmd_local(args: argparse.Namespace) -> int:
    from p2pdiloco.app.local import Chaos, run_local

    if args.peers < 1:
        raise ConfigError("--peers must be >= 1")
    cfg = config_from_args(args)
    sets = [*user_sets(args), *forwarded_sets(args)]  # --run-dir, --run-id, --steps: each peer's, see peer_command
    warm_token_cache(cfg)
    slow = parse_slow(args.slow or [], args.peers)
    peer_sets = {i: [f"emulate.hostile={kind}"] for i, kind in parse_hostile(args.hostile or [], args.peers).items()}
    run_dir = Path(cfg.run.run_dir)
    stop_on_signals()
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
        per_byte = ""
        if summary.get("eval_loss_per_byte_final") is not None and cfg.data.tokenizer not in ("", "bytes"):
            per_byte = (f", per byte {summary['eval_loss_per_byte_initial']:.4f} -> "
                        f"{summary['eval_loss_per_byte_final']:.4f}")
        print(f"eval loss {summary['eval_loss_initial']:.4f} -> {summary['eval_loss_final']:.4f}{per_byte} "
              f"({summary['peers_finished']}/{args.peers} peers finished)")
    if summary["peers_finished"] > 1:
        spread = summary["eval_loss_final_spread"]
        print(f"final global models: {summary['final_models']}" + (
            f" (eval losses {100 * spread:.2f} % apart, consensus distance {summary['consensus_distance']:.4f})"
            if summary["final_models"] != "identical" and spread is not None else ""))
    if summary.get("arrived_after_end"):
        print(f"{summary['arrived_after_end']} peer(s) restarted after the swarm had finished: they trained nothing "
              "and are left out of the final models above")
    return 0 if ok else 1


def cmd_status(args: argparse.Namespace) -> int:
    from p2pdiloco.observe.status import fetch_status, format_status, to_json, watch_status

    if args.watch is not None:
        def emit(status: dict) -> None:
            print(json.dumps(status) if args.json else f"{format_status(status)}\n", flush=True)

        watch_status(args.initial_peers, args.run_id, args.watch, emit, _stop_on_signals(), args.timeout,
                     swarm_key=args.swarm_key or "")
        return 0
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


def _stop_on_signals() -> threading.Event:
    """An event that SIGINT and SIGTERM set, for a watcher that runs until stopped (dashboard, status --watch)."""
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
    return stop


def cmd_dashboard(args: argparse.Namespace) -> int:
    from p2pdiloco.observe.dashboard import run_dashboard

    run_dashboard(args.initial_peers, args.run_id, args.host, args.port, args.refresh, _stop_on_signals(),
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


def cmd_tokenizer_train(args: argparse.Namespace) -> int:
    import time

    from p2pdiloco.training.corpus import documents
    from p2pdiloco.training.data import is_val_file
    from p2pdiloco.training.tokenizer import check_bpe_args, train_bpe

    out = check_bpe_args(args.vocab_size, Path(args.out))  # before reading megabytes of text, not after
    if args.data and args.dataset:
        raise ConfigError("give --data or --dataset, not both")
    data = DataConfig(paths=args.data or [], dataset=",".join(args.dataset or []), text_field=args.text_field,
                      max_bytes=args.max_bytes, val_fraction=args.val_fraction)
    t0 = time.monotonic()
    print(f"reading text (at most {args.max_bytes / 1e6:.0f} MB) from "
          f"{data.dataset or ', '.join(data.paths) or 'the Python standard library'}", flush=True)
    docs, _ = documents(data)
    # the validation documents stay out, so that a run's eval loss is on text the tokenizer has not seen either
    docs = [(key, text) for key, text in docs if not is_val_file(key, data.val_fraction)]
    size = sum(len(text.encode("utf-8")) for _, text in docs)
    print(f"read {len(docs)} training documents, {size / 1e6:.1f} MB, in {time.monotonic() - t0:.1f} s", flush=True)
    tok = train_bpe((text for _, text in docs), args.vocab_size, out, min_frequency=args.min_frequency,
                    progress=lambda line: print(line, flush=True))
    print(f"use it with: --set data.tokenizer={out} --set model.vocab_size={tok.vocab_size}", flush=True)
    return 0


def cmd_sample(args: argparse.Namespace) -> int:
    from p2pdiloco.app.sample import sample_text

    print(sample_text(args.run_dir, args.prompt, args.tokens, args.temperature, args.top_k, args.seed, args.device),
          flush=True)
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from p2pdiloco.app.export import export_run

    done = export_run(args.run_dir, args.to)
    print(f"exported {done['source']} to {done['to']}: {', '.join(done['files'])} (tokenizer: {done['tokenizer']})")
    return 0
