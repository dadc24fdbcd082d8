"""The flags that set config values come from one table (app/flags.py), and each benchmark has its own flags
(bench/cli.py): what a flag sets, what `local` hands its peers, and every `p2pdiloco bench` command the docs give."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from p2pdiloco.app.commands import config_from_args, user_sets
from p2pdiloco.app.flags import CONFIG_FLAGS, field_help, flag_overrides, forwarded_sets
from p2pdiloco.bench.cli import BENCHES
from p2pdiloco.cli import build_parser
from p2pdiloco.config import Config

ROOT = Path(__file__).resolve().parent.parent


def test_every_table_flag_names_a_config_field_and_sets_it(tmp_path):
    for f in CONFIG_FLAGS:
        section, key = f.path.split(".")
        assert key in Config.model_fields[section].annotation.model_fields, f.path
        assert field_help(f.path).endswith(f"({f.path})")
    key = tmp_path / "swarm.key"
    args = build_parser().parse_args([
        "peer", "--initial-peers", "/ip4/127.0.0.1/tcp/1/p2p/x", "--host", "127.0.0.1", "--port", "0",
        "--announce", "/ip4/1.2.3.4/tcp/5", "--name", "p", "--steps", "7", "--metrics-port", "0", "--resume",
        "--run-dir", str(tmp_path), "--run-id", "r", "--data", "a.txt", "--device", "cpu", "--sync",
        "--swarm-key", str(key)])
    assert flag_overrides(args, "peer") == {
        "swarm": {"initial_peers": ["/ip4/127.0.0.1/tcp/1/p2p/x"], "host": "127.0.0.1", "port": 0,
                  "announce": ["/ip4/1.2.3.4/tcp/5"], "run_id": "r", "swarm_key": str(key.resolve())},
        "rounds": {"sync": True},
        "run": {"name": "p", "total_steps": 7, "metrics_port": 0, "resume": True, "run_dir": str(tmp_path),
                "device": "cpu"},
        "data": {"paths": ["a.txt"]}}
    # a flag not given sets nothing: the config file's value stands
    assert flag_overrides(build_parser().parse_args(["peer"]), "peer") == {}


def test_local_sets_its_flags_and_hands_the_swarm_wide_ones_to_its_peers(tmp_path):
    args = build_parser().parse_args(["local", "--steps", "5", "--data", "a.txt", "b", "--device", "cpu", "--sync",
                                      "--swarm-key", "k.key", "--run-dir", str(tmp_path), "--set", "outer.lr=0.5"])
    cfg = config_from_args(args)
    assert (cfg.run.total_steps, cfg.data.paths, cfg.run.device, cfg.rounds.sync) == (5, ["a.txt", "b"], "cpu", True)
    assert forwarded_sets(args) == [f"data.paths={Path('a.txt').resolve()},{Path('b').resolve()}", "run.device=cpu",
                                    "rounds.sync=true", f"swarm.swarm_key={Path('k.key').resolve()}"]
    assert user_sets(args) == ["outer.lr=0.5"]


def test_each_bench_takes_only_its_own_flags(capsys):
    parser = build_parser()
    args = parser.parse_args(["bench", "scale", "--steps", "20", "--peers", "4,8"])
    assert (args.which, args.steps, args.peers, args.out, args.sets) == ("scale", 20, "4,8", None, [])
    assert parser.parse_args(["bench", "straggler"]).seconds == 60.0
    with pytest.raises(SystemExit):
        parser.parse_args(["bench", "straggler", "--steps", "5"])  # straggler runs for --seconds, not steps
    assert "unrecognized arguments: --steps 5" in capsys.readouterr().err
    helps = {name: flags.get("--steps") for name, (_, _, flags) in BENCHES.items() if "--steps" in flags}
    assert len(set(map(str, helps.values()))) == len(helps)  # --steps says what it means in each


def _doc_bench_commands() -> list[str]:
    text = " ".join(p.read_text() for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))])
    text = re.sub(r"\s+", " ", text)
    found = []
    for m in re.finditer(r"p2pdiloco bench ([a-z]+)([^`|#(;]*)", text):
        words = [w.strip("[]") for w in m.group(2).split()]
        found.append(" ".join([m.group(1), *(w for w in words if w and w != "...")]))
    return sorted(set(found))


PLACEHOLDERS = {"DIR": "/tmp/out", "K": "nan", "K,...": "nan", "M": "sync", "FILE": "t.json", "N": "4",
                "PATH": "/tmp/data", "H": "50"}


def test_every_bench_command_in_the_docs_parses():
    commands = _doc_bench_commands()
    assert len(commands) > 20 and "scale --peers 32 --steps 20" in commands
    parser = build_parser()
    for command in commands:
        argv = [PLACEHOLDERS.get(w, w) for w in command.split()]
        argv = [re.sub(r"=(FILE|N|PATH)$", lambda m: "=" + PLACEHOLDERS[m.group(1)], w) for w in argv]
        args = parser.parse_args(["bench", *argv])
        assert args.which == argv[0], command
