"""The `p2pdiloco` command: its flags and help, and `main`. What each command does is in app/commands.py
(bench: bench/cli.py); each parses, builds, runs and closes."""

from __future__ import annotations

import argparse
import logging
import sys

from p2pdiloco import __version__
from p2pdiloco.app.commands import (
    cmd_bootstrap,
    cmd_dashboard,
    cmd_export,
    cmd_keygen,
    cmd_local,
    cmd_peer,
    cmd_plot,
    cmd_sample,
    cmd_status,
    cmd_tokenizer_train,
)
from p2pdiloco.app.flags import add_config_flags
from p2pdiloco.bench.cli import add_bench_parser
from p2pdiloco.config import ConfigError, DataConfig, SwarmConfig
from p2pdiloco.util.memory import trace_growth_from_env

EPILOG = "Docs: README.md, docs/architecture.md, docs/operations.md."


def cmd_simulate(args: argparse.Namespace) -> int:
    """`p2pdiloco simulate` (sim/cli.py), imported only when it runs: numpy and rich would slow every other
    command's start, a peer's included."""
    from p2pdiloco.sim.cli import cmd_simulate as simulate

    return simulate(args)


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
    p.add_argument("--recipe", metavar="NAME", help="settings that only work together, over the config and under "
                   "--set: sparseloco (sparse pseudo-gradients with their outer step; p2pdiloco/config/recipes.py)")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override one config value, e.g. --set model.n_layer=4 (repeatable)")
    add_config_flags(p, "run")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")


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
    add_training_commands(sub)
    add_watching_commands(sub)
    add_model_commands(sub)
    add_bench_parser(sub, EPILOG)
    add_simulate_command(sub)
    return parser



def add_training_commands(sub: argparse._SubParsersAction) -> None:
    """bootstrap, peer and local: the commands that run a swarm."""
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
    add_config_flags(p, "peer")
    p.add_argument("--nproc", type=int, default=1, metavar="N",
                   help="run this peer as N processes (one per GPU, or CPU processes) training data-parallel; "
                   "only the first talks to the swarm. Under torchrun, leave it out")
    p.add_argument("--in-local", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--start-barrier", metavar="DIR", help=argparse.SUPPRESS)  # local's peers: see wait_for_peers
    add_config_args(p)
    p.set_defaults(func=cmd_peer)

    lo = sub.add_parser("local", help="run a whole swarm on this machine", epilog=EPILOG,
                        description="Start a bootstrap node and N peers on 127.0.0.1, show their progress, "
                        "and write summary.json and loss.png to the run folder. On Linux the peers are forked from "
                        "one process that has imported torch and hivemind (P2PDILOCO_PREFORK=0: each a fresh "
                        "interpreter).")
    lo.add_argument("--peers", type=int, default=4, help="number of peers (default 4)")
    add_config_flags(lo, "local")
    lo.add_argument("--chaos", action="store_true",
                    help="kill a random peer (SIGKILL) every --kill-every seconds and restart it with --resume")
    lo.add_argument("--kill-every", type=float, default=60.0, metavar="SECONDS", help="chaos: seconds between kills (default 60)")
    lo.add_argument("--restart-delay", type=float, default=5.0, metavar="SECONDS",
                    help="chaos: seconds before a killed peer is restarted (default 5)")
    lo.add_argument("--slow", action="append", metavar="INDEX:FACTOR",
                    help="make peer INDEX FACTOR times slower, emulating an older accelerator (repeatable)")
    lo.add_argument("--hostile", action="append", metavar="INDEX:KIND",
                    help="make peer INDEX hostile (repeatable): nan, scale (x1000), noise or signflip corrupt its "
                         "contributions; takeover, final, leader or donor lie about its model, the end of its run, "
                         "its leadership or the state it serves (docs/security.md)")
    lo.add_argument("--dashboard", action="store_true",
                    help="serve the live web dashboard of this swarm on 127.0.0.1 while it trains")
    lo.add_argument("--dashboard-port", type=int, default=8080, metavar="PORT",
                    help="port of --dashboard (default 8080; 0: any free one, printed at start)")
    add_config_args(lo)
    lo.set_defaults(func=cmd_local)


def add_watching_commands(sub: argparse._SubParsersAction) -> None:
    """status, dashboard, keygen and plot: the commands around a running swarm."""
    st = sub.add_parser("status", help="show the live peers of a swarm", epilog=EPILOG,
                        description="Join the swarm as a read-only DHT client and print a table of its live peers "
                        "(round, steps, tokens, tokens/s, loss, bytes, last merge) and the swarm's totals. Exits 1 "
                        "if no live peer is found.")
    add_watch_args(st)
    st.add_argument("--json", action="store_true", help="print JSON (peers and totals) for scripts; with --watch, "
                    "one object a line")
    st.add_argument("--watch", type=float, default=None, metavar="S",
                    help="keep watching: print the swarm every S seconds until Ctrl+C (one DHT client throughout)")
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


def add_model_commands(sub: argparse._SubParsersAction) -> None:
    """tokenizer, sample and export: the commands around a run's data and model."""
    tk = sub.add_parser("tokenizer", help="make a tokenizer for a swarm's data", epilog=EPILOG,
                        description="Tokenizers for data.tokenizer. train: learn a byte-level BPE from local text.")
    tk_sub = tk.add_subparsers(dest="tokenizer_command", required=True, metavar="ACTION")
    tt = tk_sub.add_parser("train", help="train a byte-level BPE tokenizer from local text", epilog=EPILOG,
                           description="Train a byte-level BPE (GPT-2's scheme: every byte is a token, merges on top, "
                           "one special token <|endoftext|> at id 0) from text files, folders or a local dataset, "
                           "offline and deterministically: the same text gives a byte-identical tokenizer.json, so "
                           "peers can each make it. Validation documents are left out. Use the result with --set "
                           "data.tokenizer=FILE --set model.vocab_size=N.")
    default_bytes = DataConfig.model_fields["max_bytes"].default
    tt.add_argument("--data", nargs="+", metavar="PATH",
                    help="text files or folders, found as training finds them (default: Python's stdlib sources)")
    tt.add_argument("--dataset", nargs="+", metavar="PATH",
                    help="jsonl/parquet/arrow files or folders instead of --data (as data.dataset; needs p2pdiloco[hf])")
    tt.add_argument("--text-field", default="text", metavar="NAME", help="--dataset: the field with the text (default text)")
    tt.add_argument("--vocab-size", type=int, default=4096, metavar="N",
                    help="tokens in the vocabulary, at least 257 (default 4096)")
    tt.add_argument("--out", default="tokenizer.json", metavar="FILE", help="where to write it (default ./tokenizer.json)")
    tt.add_argument("--max-bytes", type=int, default=default_bytes, metavar="N",
                    help=f"read at most this many bytes of text, as data.max_bytes (default {default_bytes})")
    tt.add_argument("--val-fraction", type=float, default=DataConfig.model_fields["val_fraction"].default,
                    metavar="F", help="leave out the documents a run with this data.val_fraction validates on")
    tt.add_argument("--min-frequency", type=int, default=2, metavar="N",
                    help="fewest occurrences of a pair for it to become a merge (default 2)")
    tt.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    tt.set_defaults(func=cmd_tokenizer_train)

    sa = sub.add_parser("sample", help="generate text from a run's latest global model", epilog=EPILOG,
                        description="Continue --prompt with the latest global model of RUN_DIR (a peer's folder, or a "
                        "`local` run's: the newest model.safetensors or checkpoint of any of its peers), using the "
                        "tokenizer the run trained with, and print the prompt and its continuation.")
    sa.add_argument("run_dir", metavar="RUN_DIR", help="the run folder")
    sa.add_argument("--prompt", required=True, help="the text to continue")
    sa.add_argument("--tokens", type=int, default=200, metavar="N", help="tokens to generate (default 200)")
    sa.add_argument("--temperature", type=float, default=0.8, help="sampling temperature; 0 is greedy (default 0.8)")
    sa.add_argument("--top-k", type=int, default=50, metavar="K",
                    help="sample among the K most likely tokens; 0: all (default 50)")
    sa.add_argument("--seed", type=int, help="seed of the draws: the same seed gives the same text (default: random)")
    sa.add_argument("--device", default="cpu", metavar="DEV", help="cpu (default), auto, cuda, cuda:N, mps, xpu")
    sa.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sa.set_defaults(func=cmd_sample)

    ex = sub.add_parser("export", help="write a run's model as a transformers checkpoint", epilog=EPILOG,
                        description="Write the latest global model of RUN_DIR (arch llama) into DIR as a Hugging "
                        "Face checkpoint: config.json (LlamaForCausalLM), model.safetensors and the tokenizer "
                        "(tokenizer.json, tokenizer_config.json), loadable with "
                        "AutoModelForCausalLM.from_pretrained(DIR) and AutoTokenizer.from_pretrained(DIR).")
    ex.add_argument("run_dir", metavar="RUN_DIR", help="the run folder")
    ex.add_argument("--to", required=True, metavar="DIR", help="a new or empty folder to write")
    ex.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    ex.set_defaults(func=cmd_export)


def add_simulate_command(sub: argparse._SubParsersAction) -> None:
    """simulate: the discrete-event model of a swarm (sim/)."""
    si = sub.add_parser("simulate", help="simulate a swarm of many learners: goodput, tokens/s, bandwidth", epilog=EPILOG,
                        description="A discrete-event model (numpy, no network, no training) of N learners under "
                        "mixed speeds, failures and links, for decoupled p2pdiloco, --sync DiLoCo and data-parallel "
                        "(restarted from checkpoints, or elastic). Prints goodput, tokens/s, time to a token budget, "
                        "bytes and link rate per learner, merge group sizes, and writes simulate.json, timing.json, "
                        "goodput_vs_failure_rate.png and scaling.png into --out. --preset seeds sets the Decoupled "
                        "DiLoCo paper's scale and prints its published figures beside the simulated ones; --calibrate "
                        "RUN_DIR compares a bench straggler or bench churn folder with its simulation. See "
                        "docs/simulation.md.")
    si.add_argument("--preset", metavar="NAME", help="seeds, churn, straggler or volunteers (p2pdiloco/sim/presets.py)")
    si.add_argument("--config", metavar="FILE", help="TOML (or .json) with [compute] [failures] [network] [protocol] "
                    "[run] tables, over the preset or the defaults")
    si.add_argument("--set", dest="sets", action="append", default=[], metavar="TABLE.KEY=VALUE",
                    help="override one value, e.g. --set failures.mtbf_s=3600 (repeatable)")
    si.add_argument("--learners", type=int, metavar="N", help="number of learners (run.learners)")
    si.add_argument("--seed", type=int, help="random seed (run.seed); the same seed gives the same simulate.json")
    si.add_argument("--calibrate", metavar="RUN_DIR", help="a bench straggler or bench churn output folder: print "
                    "measured and simulated figures side by side")
    si.add_argument("--out", metavar="DIR", help="output folder (default runs/simulate)")
    si.add_argument("--no-sweep", action="store_true", help="skip the failure-rate and swarm-size sweeps and plots")
    si.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    si.set_defaults(func=cmd_simulate)

def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # `peer --nproc` starts its ranks with these
    setup_logging(args.verbose)
    trace_growth_from_env()  # a debugging aid, off unless P2PDILOCO_TRACE_MEMORY names a folder (util/memory)
    try:
        return args.func(args)
    except Exception as e:
        # a SwarmError comes only from a command that imported network/swarm.py (and so hivemind and torch): not
        # imported here, so that a peer says what it is doing before those seconds of imports
        swarm = sys.modules.get("p2pdiloco.network.swarm")
        if not isinstance(e, ConfigError) and not (swarm is not None and isinstance(e, swarm.SwarmError)):
            raise
        print(f"p2pdiloco {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"p2pdiloco {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
