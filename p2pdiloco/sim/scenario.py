"""What a simulation runs: the swarm's hardware, failures, links and protocol settings, and the presets.

A scenario is five small dataclasses, one a TOML table (`[compute]`, `[failures]`, `[network]`, `[protocol]`,
`[run]`); `load_scenario` reads a TOML or JSON file onto the defaults and rejects unknown keys in one line.
Hardware, failure and link defaults are this machine's measured figures (docs/benchmarks.md); every protocol
setting (rounds, windows, groups, epochs, codec, the outer step's `land_wait`, `rebase_keep` and `eager`) defaults
to the shipped config's (`SHIPPED`, a `Config()`), read here rather than copied, so a changed default moves the
simulation with it.
"""

from __future__ import annotations

import dataclasses
import json
import math
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from p2pdiloco.algorithm.names import CODECS
from p2pdiloco.config import Config, ConfigError

ALGORITHMS = ("decoupled", "sync", "data_parallel", "elastic_data_parallel")
SHIPPED = Config()
"""The shipped defaults the protocol settings below start from."""


@dataclass
class Compute:
    """How fast each learner steps."""

    step_s: float = 0.1
    """Inner-step time of a speed-1 learner, seconds (the benches pad steps to 0.1 s)."""
    speeds: list[float] = field(default_factory=lambda: [1.0])
    """Step-time multipliers (4 = four times slower). As long as the swarm: one per learner; else a mix."""
    speed_fractions: list[float] = field(default_factory=list)
    """Share of learners at each entry of `speeds` (default equal shares)."""
    jitter: float = 0.0
    """Per-learner lognormal spread of the step time (sigma; 0: none)."""
    tokens_per_step: int = 512
    """Tokens one inner step trains on (the bench model: 8 sequences of 64)."""


@dataclass
class Failures:
    """When learners die and what coming back costs."""

    mtbf_s: float = math.inf
    """Mean time between failures of one learner, seconds (exponential; inf: never)."""
    kill_every_s: float = 0.0
    """`bench churn`'s chaos instead: a random running learner killed every this many seconds (0: off)."""
    down_s: float = 5.0
    """Seconds a failed learner stays down before its process starts again (bench churn: 5)."""
    first_start_s: float = 12.8
    """Process start to first inner step at the start of a run (bench churn's `start` lines: 12.7-12.9 s)."""
    restart_s: float = 6.6
    """Process start to first step after a failure, state download included (bench churn: 5.5-7.7 s)."""
    finish_s: float = 0.0
    """Seconds from the end of training to the process's exit (final merge and evaluation), counted as spent."""
    count_down_time: bool = False
    """Count a dead learner's down time as spent (its hardware idles); the benches do not."""
    dp_restart_s: float = 6.0
    """Data-parallel: a rank's start-up after a restart (spawn, imports, checkpoint load), seconds."""
    dp_detect_s: float = 0.0
    """Data-parallel: seconds before the survivors of a failure notice and stop."""


@dataclass
class Network:
    """What a merge costs."""

    params: int = 120_576
    """Model parameters (the bench model)."""
    codec: str = SHIPPED.codec.name
    """Pseudo-gradient codec of merges (`codec.name`). (θg, momentum) agreements are modelled as the code runs them
    (sim/groups.py): a catch-up of a majority, int8 differences from an anchor, or two int8 exchanges."""
    bandwidth_gbps: float = 2.5
    """Each learner's link rate, each way, Gbit/s (loopback all-reduce here: ~2.5)."""
    latency_s: float = 0.005
    """One-way latency of a link, seconds."""
    matchmaking_s: float = 0.24
    """Fixed cost of a group merge beyond its bytes: DHT reads, invites, notice (bench straggler --sync: 0.25 s)."""
    dp_bytes_per_value: float = 4.0
    """Data-parallel gradient all-reduce bytes per value (fp32 4, bf16 2)."""
    dp_overlap: float = 1.0
    """Share of the data-parallel all-reduce hidden behind compute (1: fully overlapped)."""


@dataclass
class Protocol:
    """Round timing, group formation and the outer step's settings, as in `RoundsConfig`, `MergeConfig` and
    `OuterOptConfig` (defaults: theirs), and the data-parallel baseline's checkpoints."""

    round_seconds: float = SHIPPED.rounds.round_seconds
    """Decoupled: timed rounds of this many seconds (0: `round_steps` steps; `rounds.round_seconds`)."""
    round_steps: int = SHIPPED.rounds.round_steps
    """Steps per round of --sync, and of decoupled when `round_seconds` is 0 (`rounds.round_steps`)."""
    window_fraction: float = SHIPPED.merge.window_fraction
    """Decoupled grace window: this fraction of the round, within [min_window_s, merge_window_s]."""
    min_window_s: float = SHIPPED.merge.min_window_s
    merge_window_s: float = SHIPPED.merge.merge_window_s
    """Upper bound of the decoupled window, and the whole window of a run's closing merges."""
    sync_window_s: float = 60.0
    """--sync: how long a ready peer waits for every live peer (bench: merge.merge_window_s=60)."""
    group_size: int = SHIPPED.merge.group_size
    """Decoupled: most members of a merge group; the census is dealt into groups of at most this every epoch."""
    epoch_s: float = SHIPPED.merge.epoch_s
    """Decoupled: seconds between redrawings of the groups (`merge.epoch_s`)."""
    state_anchors: int = SHIPPED.merge.state_anchors
    """Recent global models each learner keeps: an agreement whose members all hold one sends int8 differences."""
    land_wait: float = SHIPPED.outer.land_wait
    """Decoupled: wait up to this share of a round for a merge to land, where recent exchanges fit it."""
    rebase_keep: float = SHIPPED.outer.rebase_keep
    """Decoupled: share of the inner steps taken while a group merge was in flight that its landing keeps."""
    eager: bool = SHIPPED.outer.eager
    """Decoupled: steps in flight start from the eager update, so a merge alone keeps all of them."""
    record_ttl_s: float = 3.0
    """How long a dead learner still holds --sync peers back. Its DHT record expires 6-8 s after death (it lives 4
    heartbeats of 2 s); 3 s is fitted to bench churn's --sync goodput (docs/simulation.md)."""
    checkpoint_every_steps: int = 100
    """Data-parallel checkpoint interval, steps (bench churn: 100)."""
    checkpoint_s: float = 0.0
    """Data-parallel: seconds the job stops to write a checkpoint."""
    elastic_units: int = 0
    """Elastic data-parallel: replicas the job shrinks by one of (0: one per learner)."""


@dataclass
class Run:
    """How long, how many, and what to compute."""

    learners: int = 4
    duration_s: float = 300.0
    """Training wall time after the first start (the run's time limit, `run.time_limit_s`)."""
    total_steps: int = 0
    """Instead of `duration_s`: the swarm's step budget (`run.total_steps`; a restarted learner adopts the swarm's
    step). Decoupled runs it as `total_steps` × `step_s` of wall time; --sync until its rounds add up to it."""
    token_budget: float = 0.0
    """Report the time to reach this many tokens in the model (0: off)."""
    seed: int = 0
    algorithms: list[str] = field(default_factory=lambda: ["decoupled", "sync", "data_parallel"])


@dataclass
class Scenario:
    compute: Compute = field(default_factory=Compute)
    failures: Failures = field(default_factory=Failures)
    network: Network = field(default_factory=Network)
    protocol: Protocol = field(default_factory=Protocol)
    run: Run = field(default_factory=Run)

    def validate(self) -> Scenario:
        c, f, n, p, r = self.compute, self.failures, self.network, self.protocol, self.run
        checks = [
            (c.step_s > 0 and all(s > 0 for s in c.speeds) and c.speeds, "compute.step_s and speeds must be > 0"),
            (not c.speed_fractions or len(c.speed_fractions) == len(c.speeds), "compute.speed_fractions: one per speed"),
            (f.mtbf_s > 0 and f.down_s >= 0 and f.restart_s >= 0 and f.first_start_s >= 0, "failure times must be >= 0"),
            (n.codec in CODECS, f"network.codec must be one of {', '.join(CODECS)}"),
            (n.params > 0 and n.bandwidth_gbps > 0 and n.latency_s >= 0, "network: params, bandwidth must be > 0"),
            (p.round_seconds > 0 or p.round_steps >= 1, "protocol: round_seconds > 0 or round_steps >= 1"),
            (0 < p.window_fraction <= 1 and 0 < p.min_window_s <= p.merge_window_s, "protocol: bad window settings"),
            (p.checkpoint_every_steps >= 1 and p.group_size >= 2 and p.epoch_s > 0,
             "protocol: checkpoint_every_steps >= 1, group_size >= 2, epoch_s > 0"),
            (0 <= p.land_wait <= 1 and 0 <= p.rebase_keep <= 1, "protocol: land_wait and rebase_keep in [0, 1]"),
            (r.learners >= 1 and r.duration_s > 0 and r.total_steps >= 0, "run: learners >= 1, duration_s > 0"),
            (all(a in ALGORITHMS for a in r.algorithms), f"run.algorithms: choose from {', '.join(ALGORITHMS)}"),
        ]
        for ok, message in checks:
            if not ok:
                raise ConfigError(message)
        return self

    @property
    def duration(self) -> float:
        """Training wall time of a learner that never waits: the time limit, or the step budget at speed 1."""
        return self.run.total_steps * self.compute.step_s if self.run.total_steps else self.run.duration_s

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def bytes_per_value(codec: str) -> float:
    """Encoded bytes per value of a codec (algorithm/codecs.py: int8 has an fp32 absmax per 4096, int4 per 128;
    sparseloco, algorithm/sparse.py: 48 of 4096 values at ~10 bits each, two bf16 scales a chunk)."""
    return {"none": 4.0, "fp16": 2.0, "bf16": 2.0, "int8": 1.0 + 4 / 4096, "int4": 0.5 + 4 / 128,
            "sparseloco": (48 * 10 + 32) / 8 / 4096}[codec]


def scenario_from_dict(data: dict, base: Scenario | None = None) -> Scenario:
    """`data`'s tables onto `base` (default: the defaults). Raises ConfigError on unknown tables, keys or types."""
    s = base or Scenario()
    for table, values in data.items():
        section = getattr(s, table, None)
        if not dataclasses.is_dataclass(section) or not isinstance(values, dict):
            raise ConfigError(f"unknown table [{table}]; tables are compute, failures, network, protocol, run")
        names = {f.name: f for f in dataclasses.fields(section)}
        for key, value in values.items():
            if key not in names:
                raise ConfigError(f"unknown key {table}.{key}; known: {', '.join(names)}")
            old = getattr(section, key)
            if isinstance(old, bool) != isinstance(value, bool) or (
                isinstance(old, int | float) and not isinstance(value, int | float)) or (
                isinstance(old, str | list) and not isinstance(value, type(old))):
                raise ConfigError(f"{table}.{key} must be a {type(old).__name__}, got {value!r}")
            setattr(section, key, float(value) if isinstance(old, float) else value)
    return s.validate()


def load_scenario(path: str | Path, base: Scenario | None = None) -> Scenario:
    """A TOML (or .json) file onto `base`. Raises ConfigError, in one line, on anything wrong with it."""
    path = Path(path)
    try:
        text = path.read_text()
        data = json.loads(text) if path.suffix == ".json" else tomllib.loads(text)
    except OSError as e:
        raise ConfigError(f"cannot read {path}: {e.strerror}") from None
    except (tomllib.TOMLDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{path} is not valid {'JSON' if path.suffix == '.json' else 'TOML'}: {e}") from None
    return scenario_from_dict(data, base)
