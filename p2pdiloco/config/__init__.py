"""Run configuration: one small dataclass per component, composed into `Config`.

TOML files (``peers/*.toml``) map onto it one to one: a ``[model]`` table sets `ModelConfig` fields and so
on. Command-line flags and ``--set section.key=value`` override what the file says.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

CODECS = ("none", "fp16", "bf16", "int8", "int4")
"""Names of the merge payload codecs (see codecs.py)."""
OPTIMIZERS = ("adamw", "adamw8bit")
"""Inner optimizers (see optim.py)."""
PRECISIONS = ("auto", "fp32", "bf16")
"""Inner-step compute precisions (see accel.py)."""


class ConfigError(ValueError):
    """Bad user input in a config file or a flag; the CLI prints it as one line."""


@dataclass
class ModelConfig:
    """A decoder-only transformer over byte tokens."""

    n_layer: int = 2
    """Transformer blocks."""
    n_head: int = 4
    """Attention heads per block."""
    d_model: int = 128
    """Width of the residual stream."""
    seq_len: int = 128
    """Context length in tokens (bytes)."""
    dropout: float = 0.0
    """Dropout probability inside blocks."""
    init_seed: int = 1234
    """Seed of the initial weights; the same on every peer so that all start from one global model."""
    vocab_size: int = 256
    """Byte-level tokens: always 256."""


@dataclass
class DataConfig:
    """Where training text comes from and how a peer picks its part of it."""

    paths: list[str] = field(default_factory=list)
    """Text files or folders; empty means the running Python's standard library sources."""
    val_fraction: float = 0.02
    """Share of files held out for validation (chosen by file-name hash, the same on every peer)."""
    max_bytes: int = 24_000_000
    """Read at most this many bytes of text (keeps start-up fast on laptops)."""
    shard: str = ""
    """'i/n' reads the i-th of n disjoint parts of the training text; empty: a seed-shuffled order of all."""
    batch_size: int = 16
    """Sequences per inner step."""


@dataclass
class InnerOptConfig:
    """AdamW for the inner steps, with linear warmup then cosine decay over the whole run."""

    lr: float = 2e-3
    """Peak learning rate."""
    weight_decay: float = 0.1
    """Decoupled weight decay."""
    beta1: float = 0.9
    """Adam beta1."""
    beta2: float = 0.95
    """Adam beta2."""
    warmup_steps: int = 30
    """Inner steps of linear warmup."""
    min_lr_ratio: float = 0.1
    """Learning rate at the end of the cosine, as a fraction of the peak."""
    grad_clip: float = 1.0
    """Clip the gradient's global L2 norm to this (0 disables)."""
    optimizer: str = "adamw"
    """adamw (torch, fp32 state) or adamw8bit (bitsandbytes' 8-bit state: 2 bytes per parameter instead of 8)."""


@dataclass
class OuterOptConfig:
    """Nesterov SGD applied to the merged pseudo-gradient (DiLoCo, arXiv 2311.08105)."""

    lr: float = 0.7
    """Outer learning rate."""
    momentum: float = 0.9
    """Outer momentum."""
    nesterov: bool = True
    """Use Nesterov momentum."""


@dataclass
class SwarmConfig:
    """How a peer finds the swarm and merges with it."""

    run_id: str = "p2pdiloco"
    """Name of the swarm; prefixes every DHT key and protocol name."""
    initial_peers: list[str] = field(default_factory=list)
    """Multiaddrs of a bootstrap node or any live peer; empty starts a new swarm."""
    host: str = "0.0.0.0"
    """Interface to listen on."""
    port: int = 0
    """TCP port to listen on (0 picks a free one)."""
    announce: list[str] = field(default_factory=list)
    """Multiaddrs to announce instead of the listening ones (public address behind NAT)."""
    round_steps: int = 50
    """Inner steps per round (H in DiLoCo); used when round_seconds is 0."""
    round_seconds: float = 0.0
    """If > 0, rounds are timed instead: a round ends at the next multiple of this many seconds of DHT time,
    so peers of any speed submit on the swarm's cadence and a slow peer simply runs fewer steps."""
    sync: bool = False
    """Synchronous DiLoCo (the baseline): wait for the merge, and wait for every live peer to be ready."""
    merge_window_s: float = 15.0
    """Upper bound on the wait for other peers to become ready for a merge (the whole wait in sync mode)."""
    window_fraction: float = 0.25
    """Decoupled mode: wait for others at most this fraction of this peer's recent round time (Decoupled
    DiLoCo's grace window), clamped to [min_window_s, merge_window_s]."""
    min_window_s: float = 1.0
    """Lower bound of the adaptive merge window."""
    merge_timeout_s: float = 60.0
    """Longest one exchange phase of a merge (Δ; then (θg, momentum) if members disagree) may take before
    the merge is abandoned and not applied."""
    heartbeat_s: float = 2.0
    """Seconds between peer records in the DHT; a record expires after three of these."""
    join_timeout_s: float = 20.0
    """Give up on unreachable initial peers after this many seconds."""
    wait_for_peers: int = 0
    """Before the first inner step, wait until this many peers (this one included) are live; 0 does not wait."""
    wait_for_peers_s: float = 120.0
    """Longest wait for `wait_for_peers`; after it the peer starts with whoever is there."""
    codec: str = "int4"
    """How pseudo-gradients travel in merges: none (fp32), fp16, bf16, int8 (8-bit blockwise), int4 (4-bit NF4
    blockwise; the default: fewest bytes within 2% of fp32's loss at every H in `p2pdiloco bench bandwidth`)."""
    error_feedback: bool = True
    """Add each round's quantization residual to the next round's pseudo-gradient (lossy codecs only)."""
    swarm_key: str = ""
    """File with the private swarm's secret key (`p2pdiloco keygen`); empty: a public swarm."""


@dataclass
class GuardConfig:
    """Checks on every received contribution, and how a merge group's contributions are combined."""

    enabled: bool = True
    """Screen contributions (finite, norm, direction, staleness) and ban repeat offenders; off: plain mean."""
    norm_bound: float = 4.0
    """Reject a part whose L2 norm exceeds this many times the group's median norm (0 disables)."""
    min_cosine: float = -1.0
    """Reject a part whose cosine to the coordinate-wise median of the other members' parts is below this; -1,
    the default, disables the check. Honest parts measured 0.35-0.96 in short sync runs, but in `bench churn`
    (4 decoupled peers, 2 s rounds, int4) honest peers fell below 0.1 within the first minute and banned each
    other (docs/security.md); pure noise is ~1/sqrt(slice length), ~0."""
    max_round_lag: int = 0
    """Leave out members whose round counter lags the group's median by more than this (0, the default, disables).
    Off by default: round counters only grow by one per merge, so a peer that fell behind (frozen for a while,
    or slower under step-based rounds) never catches up and, once excluded, stays excluded for the whole run."""
    ban_after: int = 3
    """Ban a peer for the rest of the run after this many consecutive merges with a rejected contribution (0: never)."""
    aggregate: str = "centered_clip"
    """How the accepted parts are combined: centered_clip, trimmed_mean, mean, or rda (radial-directional)."""
    robust_min_group: int = 3
    """Use the robust rule (centered_clip, trimmed_mean) only in groups of at least this many members."""
    trim_fraction: float = 0.2
    """trimmed_mean: share of values dropped at each end of every coordinate."""


@dataclass
class RunConfig:
    """One peer's run: length, device, output."""

    total_steps: int = 1000
    """Inner steps this peer runs before it stops (the learning-rate schedule spans them)."""
    run_dir: str = "runs/latest"
    """Folder for metrics, checkpoints and plots."""
    device: str = "auto"
    """auto (cuda > mps > xpu > cpu), or a torch device string."""
    precision: str = "auto"
    """Inner-step compute: auto (bf16 autocast on CUDA with bf16 and on XPU, fp32 elsewhere), fp32 or bf16."""
    peak_flops: float = 0.0
    """Peak FLOP/s of one device for the MFU estimate; 0 looks the GPU up by name (unknown on CPU: no MFU)."""
    seed: int = 0
    """Seed of this peer's data order."""
    eval_batches: int = 8
    """Validation batches per evaluation of the global model."""
    log_every: int = 10
    """Write a metrics line every this many inner steps."""
    name: str = ""
    """Optional public name of this peer."""
    threads: int = 0
    """torch CPU threads (0 keeps torch's default)."""
    eval_every_rounds: int = 1
    """Evaluate the global model after every this many merges (0: only at start and end)."""
    time_limit_s: float = 0.0
    """Stop training after this many seconds (0: no limit); benchmarks use it to compare at equal wall time."""
    slow_factor: float = 1.0
    """Emulate an accelerator this many times slower: each inner step is padded with sleep."""
    min_step_s: float = 0.0
    """Pad each inner step to at least this long (emulated accelerator time, so that benchmark peers sharing
    few cores do not compete for them); 0 disables."""
    checkpoint_every: int = 5
    """Save a checkpoint every this many merges (0: only at the end)."""
    resume: bool = False
    """Continue from the newest good checkpoint in run_dir (and take the swarm's state if it is ahead)."""
    cpu_affinity: str = ""
    """Comma-separated CPU ids to pin this peer to (Linux), e.g. "0"; empty leaves it to the OS."""
    metrics_port: int = 0
    """Serve Prometheus metrics at http://metrics_host:metrics_port/metrics; 0 serves none."""
    hostile: str = ""
    """Benchmarks and tests only: corrupt this peer's own contributions (nan, scale, noise, signflip)."""
    metrics_host: str = "127.0.0.1"
    """Interface for metrics_port; 0.0.0.0 lets a Prometheus on another machine scrape this peer."""


@dataclass
class Config:
    """Everything one peer needs, one table per component."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    inner: InnerOptConfig = field(default_factory=InnerOptConfig)
    outer: OuterOptConfig = field(default_factory=OuterOptConfig)
    swarm: SwarmConfig = field(default_factory=SwarmConfig)
    guard: GuardConfig = field(default_factory=GuardConfig)
    run: RunConfig = field(default_factory=RunConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def fingerprint(self) -> dict[str, Any]:
        """What must be equal on every peer of a swarm for their contributions to mean the same thing: the model,
        the tokenizer, how payloads are encoded, the outer optimizer, the round cadence and merge mode, and the
        rules that screen and combine contributions (every slice owner must apply the same ones)."""
        s = self.swarm
        return {
            "model": dataclasses.asdict(self.model), "tokenizer": "bytes",
            "codec": {"codec": s.codec, "error_feedback": s.error_feedback},
            "outer": dataclasses.asdict(self.outer),
            "rounds": {"round_steps": s.round_steps, "round_seconds": s.round_seconds, "sync": s.sync},
            "guard": dataclasses.asdict(self.guard),
        }


def fingerprint_digest(fingerprint: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(fingerprint, sort_keys=True).encode()).hexdigest()[:16]


def fingerprint_diff(mine: dict[str, Any], theirs: dict[str, Any], prefix: str = "") -> list[str]:
    """Human-readable differences between two fingerprints, e.g. ``model.n_layer: 2 here, 4 in swarm``."""
    out = []
    for key in sorted(set(mine) | set(theirs)):
        a, b = mine.get(key), theirs.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            out += fingerprint_diff(a, b, f"{prefix}{key}.")
        elif a != b:
            out.append(f"{prefix}{key}: {a!r} here, {b!r} in the swarm")
    return out


def _coerce(value: Any, annotation: Any, key: str) -> Any:
    """Convert a TOML or command-line value to the field's type, or raise ConfigError."""
    hint = annotation
    origin = typing.get_origin(hint)
    try:
        if origin in (list,):
            (item_type,) = typing.get_args(hint)
            if isinstance(value, str):
                value = [v for v in value.split(",") if v]
            if not isinstance(value, list):
                raise TypeError
            return [_coerce(v, item_type, key) for v in value]
        if origin in (typing.Union, types.UnionType):
            raise TypeError  # no optional fields today
        if hint is bool:
            if isinstance(value, bool):
                return value
            if isinstance(value, str) and value.lower() in ("true", "1", "yes", "on", "false", "0", "no", "off"):
                return value.lower() in ("true", "1", "yes", "on")
            raise TypeError
        if hint is int:
            if isinstance(value, bool):
                raise TypeError
            if isinstance(value, float) and not value.is_integer():
                raise TypeError
            return int(value)
        if hint is float:
            if isinstance(value, bool):
                raise TypeError
            return float(value)
        if hint is str:
            if not isinstance(value, str | int | float):
                raise TypeError
            return str(value)
    except (TypeError, ValueError):
        pass
    else:
        raise ConfigError(f"config key {key!r} has an unsupported type")
    raise ConfigError(f"config key {key!r} expects {getattr(hint, '__name__', hint)}, got {value!r}")


def _section_types(section: Any) -> dict[str, Any]:
    return typing.get_type_hints(type(section))


def apply_values(config: Config, values: dict[str, Any], source: str) -> None:
    """Set ``{"section": {"key": value}}`` onto `config`, naming `source` in errors."""
    sections = {f.name for f in dataclasses.fields(config)}
    for section_name, table in values.items():
        if section_name not in sections:
            raise ConfigError(f"{source}: unknown config section [{section_name}] (known: {', '.join(sorted(sections))})")
        if not isinstance(table, dict):
            raise ConfigError(f"{source}: [{section_name}] must be a table")
        section = getattr(config, section_name)
        types_ = _section_types(section)
        for key, value in table.items():
            if key not in types_:
                raise ConfigError(
                    f"{source}: unknown config key '{section_name}.{key}' (known in [{section_name}]: "
                    f"{', '.join(types_)})"
                )
            setattr(section, key, _coerce(value, types_[key], f"{section_name}.{key}"))


def parse_set(items: list[str]) -> dict[str, dict[str, Any]]:
    """Turn ``["model.n_layer=4", ...]`` into ``{"model": {"n_layer": "4"}}`` (strings are coerced later)."""
    out: dict[str, dict[str, Any]] = {}
    for item in items:
        key, sep, value = item.partition("=")
        section, dot, name = key.strip().partition(".")
        if not sep or not dot or not name:
            raise ConfigError(f"--set expects section.key=value, got {item!r}")
        out.setdefault(section, {})[name] = value.strip()
    return out


def load_config(path: str | Path | None = None, overrides: list[dict[str, Any]] | None = None) -> Config:
    """Defaults, then the TOML file at `path`, then each override table in order."""
    config = Config()
    if path is not None:
        path = Path(path)
        try:
            values = tomllib.loads(path.read_text())
        except OSError as e:
            raise ConfigError(f"cannot read config file {path}: {e.strerror}") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config file {path} is not valid TOML: {e}") from None
        apply_values(config, values, str(path))
    for table in overrides or []:
        apply_values(config, table, "flags")
    validate(config)
    return config


def validate(config: Config) -> None:
    """Reject values that cannot work, with a message that says which key and why."""
    m = config.model
    checks = [
        (m.n_layer >= 1, "model.n_layer must be >= 1"),
        (m.n_head >= 1 and m.d_model >= 1, "model.n_head and model.d_model must be >= 1"),
        (m.n_head >= 1 and m.d_model % max(m.n_head, 1) == 0, "model.d_model must be divisible by model.n_head"),
        (m.seq_len >= 2, "model.seq_len must be >= 2"),
        (m.vocab_size == 256, "model.vocab_size must be 256 (byte tokens)"),
        (0 < config.data.val_fraction < 1, "data.val_fraction must be in (0, 1)"),
        (config.data.batch_size >= 1, "data.batch_size must be >= 1"),
        (config.swarm.round_steps >= 1, "swarm.round_steps must be >= 1"),
        (config.run.total_steps >= 1, "run.total_steps must be >= 1"),
        (config.inner.lr > 0 and config.outer.lr > 0, "learning rates must be positive"),
        (0 <= config.outer.momentum < 1, "outer.momentum must be in [0, 1)"),
        (config.swarm.merge_window_s > 0 and config.swarm.merge_timeout_s > 0, "merge times must be positive"),
        (config.swarm.round_seconds >= 0, "swarm.round_seconds must be >= 0"),
        (0 < config.swarm.window_fraction <= 1, "swarm.window_fraction must be in (0, 1]"),
        (0 < config.swarm.min_window_s <= config.swarm.merge_window_s, "need 0 < swarm.min_window_s <= merge_window_s"),
        (config.run.slow_factor >= 1, "run.slow_factor must be >= 1"),
        (config.run.min_step_s >= 0 and config.run.time_limit_s >= 0, "run.min_step_s and run.time_limit_s must be >= 0"),
        (config.run.eval_every_rounds >= 0, "run.eval_every_rounds must be >= 0"),
        (config.run.log_every >= 1, "run.log_every must be >= 1"),
        (config.run.checkpoint_every >= 0, "run.checkpoint_every must be >= 0"),
        (config.run.eval_batches >= 1, "run.eval_batches must be >= 1"),
        (config.data.max_bytes >= 1, "data.max_bytes must be >= 1"),
        (0 <= config.run.metrics_port <= 65535, "run.metrics_port must be in [0, 65535]"),
        (config.swarm.heartbeat_s > 0, "swarm.heartbeat_s must be > 0"),
        (config.swarm.join_timeout_s > 0, "swarm.join_timeout_s must be > 0"),
        (config.swarm.wait_for_peers >= 0 and config.swarm.wait_for_peers_s >= 0, "swarm.wait_for_peers* must be >= 0"),
        (config.inner.optimizer in OPTIMIZERS,
         f"inner.optimizer must be one of {', '.join(OPTIMIZERS)}, got {config.inner.optimizer!r}"),
        (config.run.precision in PRECISIONS,
         f"run.precision must be one of {', '.join(PRECISIONS)}, got {config.run.precision!r}"),
        (config.run.peak_flops >= 0, "run.peak_flops must be >= 0"),
        (config.guard.norm_bound >= 0 and -1 <= config.guard.min_cosine <= 1,
         "guard.norm_bound must be >= 0 and guard.min_cosine in [-1, 1]"),
        (config.guard.aggregate in ("mean", "centered_clip", "trimmed_mean", "rda"),
         f"guard.aggregate must be mean, centered_clip, trimmed_mean or rda, got {config.guard.aggregate!r}"),
        (0 <= config.guard.trim_fraction < 0.5, "guard.trim_fraction must be in [0, 0.5)"),
        (config.guard.max_round_lag >= 0 and config.guard.ban_after >= 0, "guard.max_round_lag and ban_after must be >= 0"),
        (config.run.hostile in ("", "nan", "scale", "noise", "signflip"),
         f"run.hostile must be nan, scale, noise or signflip, got {config.run.hostile!r}"),
        (config.swarm.codec in CODECS, f"swarm.codec must be one of {', '.join(CODECS)}, got {config.swarm.codec!r}"),
    ]
    for ok, message in checks:
        if not ok:
            raise ConfigError(message)
    if config.run.cpu_affinity:
        try:
            [int(c) for c in config.run.cpu_affinity.split(",")]
        except ValueError:
            raise ConfigError(f"run.cpu_affinity must be comma-separated CPU ids, got {config.run.cpu_affinity!r}") from None
    if config.data.shard:
        try:
            i, n = (int(x) for x in config.data.shard.split("/"))
        except ValueError:
            raise ConfigError(f"data.shard must look like 'i/n', got {config.data.shard!r}") from None
        if not 0 <= i < n:
            raise ConfigError(f"data.shard {config.data.shard!r}: need 0 <= i < n")
