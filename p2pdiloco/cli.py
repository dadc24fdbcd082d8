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
from p2pdiloco.bench.cli import cmd_bench
from p2pdiloco.config import ConfigError, DataConfig, SwarmConfig

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
    p.add_argument("--run-dir", metavar="DIR", help="folder for metrics, summary, checkpoint and plots")
    p.add_argument("--run-id", metavar="NAME", help="swarm name; all peers of one run use the same")
    p.add_argument("--data", nargs="+", metavar="PATH", help="text files or folders (default: Python's stdlib sources)")
    p.add_argument("--device", metavar="DEV", help="auto (default), cpu, cuda, cuda:N, mps, xpu")
    p.add_argument("--sync", action="store_true",
                   help="synchronous DiLoCo baseline: wait for every merge and for every live peer")
    p.add_argument("--swarm-key", metavar="FILE", help="private swarm: its key file (p2pdiloco keygen; swarm.swarm_key)")
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
    p.add_argument("--start-barrier", metavar="DIR", help=argparse.SUPPRESS)  # local's peers: see wait_for_peers
    add_config_args(p)
    p.set_defaults(func=cmd_peer)

    lo = sub.add_parser("local", help="run a whole swarm on this machine", epilog=EPILOG,
                        description="Start a bootstrap node and N peers on 127.0.0.1, show their progress, "
                        "and write summary.json and loss.png to the run folder. On Linux the peers are forked from "
                        "one process that has imported torch and hivemind (P2PDILOCO_PREFORK=0: each a fresh "
                        "interpreter).")
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
                    help="make peer INDEX hostile (repeatable): nan, scale (x1000), noise or signflip corrupt its "
                         "contributions; takeover, final, leader or donor lie about its model, the end of its run, "
                         "its leadership or the state it serves (docs/security.md)")
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
                        "tbf-limited links, decoupled vs --sync. byzantine: honest peers' eval loss with 2 hostile "
                        "peers ÷ a clean run, per hostile kind, swarm size (5, 9) and mode (sync, decoupled), default "
                        "guards (32 runs, about an hour; --sizes, --modes, --kinds pick fewer). loader: the data "
                        "loader's tokens/s (cold tokenization, cached load, next_batch) beside the trainer's inner "
                        "steps on CPU, as a ratio (target >= 10x; under a minute; --set picks tokenizer, data, model). "
                        "scale: per peer DHT bytes/s, merge bytes per round, merge time, group share, consensus, eval loss, "
                        "start-up, host memory (PSS of its processes) and CPU outside inner steps, for swarms of "
                        "--peers N (default 4, 8, 16, 32), each ÷ the smallest swarm's (one run of about 2-3 "
                        "minutes per N). dht: per node DHT bytes/s of N nodes running only the heartbeat and "
                        "census loops, p2pdiloco's record stores beside hivemind's store (two runs of about "
                        "--dht-seconds + 20 s per N; default N 4, 16, 32). wan (root): peers in homes behind "
                        "routers (the first --nat of them NAT with a stateful firewall, the rest reachable) over "
                        "links shaped by --profile (tbf rates, delay and loss from an NFQUEUE daemon), beside the "
                        "same on the lan profile: the lab's own measured RTT, rates and loss, then per peer the "
                        "rounds merged in a group vs alone, the group merge time and whether the final global "
                        "models are identical (two runs of about 2 minutes; docs/wanlab.md).")
    be.add_argument("which", choices=["straggler", "overhead", "churn", "bandwidth", "parity", "slowlink", "byzantine",
                                      "loader", "scale", "dht", "wan"],
                    help="which benchmark")
    be.add_argument("--out", metavar="DIR", help="output folder (default runs/bench-<which>)")
    be.add_argument("--seconds", type=float, default=60.0, help="straggler: wall time of each of its 4 runs")
    be.add_argument("--steps", type=int, help="overhead: inner steps measured (default 600); bandwidth: inner "
                    "steps per peer per run (1000); parity: inner steps per worker (3000); slowlink: inner "
                    "steps per peer (250); byzantine: inner steps of each run, in sync rounds of 5 (100); scale: inner "
                    "steps per peer, padded to 0.3 s each (350, about 105 s of training); wan: inner steps per peer, padded "
                    "to 0.3 s each (200)")
    be.add_argument("--h", metavar="H[,H...]", help="inner steps per round: bandwidth tries each (default "
                    "50,100,250,500); parity and slowlink take one (default 50, 25)")
    be.add_argument("--codecs", metavar="C,C,...", help="bandwidth: codecs to try (default all)")
    be.add_argument("--seeds", type=int, default=1, help="parity and byzantine: repeat every run with this many "
                    "initial models (model.init_seed 1234, 1235, ...) and report each ratio's mean and spread "
                    "(default 1)")
    be.add_argument("--peers", metavar="N[,N...]", help="parity: workers (default 4); bandwidth: peers (default "
                    "2); slowlink: peers (default 2); scale: swarm sizes, one run each, the smallest the baseline "
                    "(default 4,8,16,32); dht: DHT nodes (default 4,16,32); wan: peers, one home each (default 6)")
    be.add_argument("--profile", default="home", choices=["lan", "home", "intercontinental", "mixed"],
                    help="wan: the links of the homes (default home: 20/100 Mbit/s, 40 ms each way, 0.5 %% loss; "
                    "see docs/wanlab.md)")
    be.add_argument("--nat", type=int, default=4, help="wan: how many of the peers are behind NAT routers (default 4)")
    be.add_argument("--dht-seconds", type=float, help="dht: seconds measured per run, after 10 s of settling (60)")
    be.add_argument("--group-size", type=int, help="scale: swarm.group_size, the largest merge group (default the "
                    "config's, 8)")
    be.add_argument("--rate-mbit", type=float, default=10.0, help="slowlink: link rate each way (default 10)")
    be.add_argument("--sizes", metavar="N[,N...]", help="byzantine: swarm sizes (default 5,9)")
    be.add_argument("--hostile", type=int, default=2, help="byzantine: hostile peers in each swarm (default 2)")
    be.add_argument("--modes", metavar="M[,M]", help="byzantine: sync, decoupled or both (default both); bandwidth: "
                    "sync or decoupled (default sync)")
    be.add_argument("--kinds", metavar="K[,K...]", help="byzantine: hostile kinds (default honest_only, nan, scale, "
                    "noise, signflip, takeover, final, leader; honest_only is a clean run of the honest peers alone)")
    be.add_argument("--minutes", type=float, default=5.0, help="churn: length of each of its 4 runs (3 swarms and the data-parallel baseline)")
    be.add_argument("--kill-every", type=float, default=60.0, help="churn: seconds between kills")
    be.add_argument("--set", dest="sets", action="append", default=[], metavar="SECTION.KEY=VALUE",
                    help="loader, byzantine, scale and wan: override one config value, e.g. --set data.tokenizer=tokenizer.json, "
                    "or for scale --set emulate.min_step_s=1 --set swarm.round_seconds=10 (repeatable)")
    be.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    be.set_defaults(func=cmd_bench)

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
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # `peer --nproc` starts its ranks with these
    setup_logging(args.verbose)
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
