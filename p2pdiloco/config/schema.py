"""The run configuration as typed models: one small model per component, composed into `Config`.

Every check on a value lives here, in the models' validators; `load.py` only reads TOML and flags and hands
the tables over. A bad value raises `ConfigError` with a one-line message that names the key.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, ClassVar

from pydantic import Field, model_validator

from p2pdiloco.algorithm.names import AGGREGATORS, ARCHS, CODECS, HOSTILE_KINDS, OPTIMIZERS, PRECISIONS
from p2pdiloco.config.base import ConfigError, _Model, _Section
from p2pdiloco.config.fingerprint import config_fingerprint
from p2pdiloco.config.swarm import CodecConfig, MergeConfig, RoundsConfig, StartupConfig, SwarmConfig

__all__ = ["AGGREGATORS", "ARCHS", "CODECS", "HOSTILE_KINDS", "OPTIMIZERS", "PRECISIONS", "CodecConfig", "Config",
           "ConfigError", "DataConfig", "EmulateConfig", "GuardConfig", "InnerOptConfig", "MergeConfig", "ModelConfig",
           "OuterOptConfig", "RoundsConfig", "RunConfig", "StartupConfig", "SwarmConfig"]


class ModelConfig(_Section):
    """A decoder-only transformer: nanoGPT's GPT-2 or a Llama-style model."""

    SECTION: ClassVar[str] = "model"

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
    """Token ids are in [0, vocab_size): 256 for byte tokens, the tokenizer's vocabulary size otherwise."""
    arch: str = "gpt"
    """gpt (GPT-2: learned positions, LayerNorm, GELU, tied embeddings) or llama (RMSNorm, rotary, SwiGLU, no biases)."""
    rope_theta: float = 10000.0
    """llama: base of the rotary embedding's wavelengths."""
    ffn_hidden: int = 0
    """llama: width of the SwiGLU MLP; 0 = 8/3·d_model rounded up to a multiple of 64 (Llama's rule)."""
    tie_embeddings: bool = True
    """llama: the output layer shares the token embedding matrix (the GPT always does)."""

    LLAMA_ONLY: ClassVar[tuple[str, ...]] = ("arch", "rope_theta", "ffn_hidden", "tie_embeddings")
    """Fields that shape only the llama; a gpt's fingerprint leaves them out (see `fingerprint`)."""

    def fingerprint(self) -> dict[str, Any]:
        """The model's part of the swarm fingerprint. For arch gpt the llama-only fields change nothing in the
        model, so they are left out: a gpt swarm's fingerprint stays what it was before they existed, and old
        and new peers of one gpt swarm still recognise each other."""
        values = self.model_dump()
        if self.arch == "gpt":
            for key in self.LLAMA_ONLY:
                values.pop(key)
        return values

    def checks(self) -> Iterator[tuple[bool, str]]:
        yield self.arch in ARCHS, f"model.arch must be one of {', '.join(ARCHS)}, got {self.arch!r}"
        yield self.rope_theta > 0, "model.rope_theta must be > 0"
        yield self.ffn_hidden >= 0, "model.ffn_hidden must be >= 0 (0: automatic)"
        yield (self.tie_embeddings or self.arch == "llama",
               "model.tie_embeddings = false needs model.arch = 'llama' (the gpt always ties them)")
        yield min(self.n_layer, self.n_head, self.d_model) >= 1, "model.n_layer, n_head and d_model must be >= 1"
        yield self.d_model % self.n_head == 0, "model.d_model must be divisible by model.n_head"
        yield self.seq_len >= 2 and self.vocab_size >= 2, "model.seq_len and model.vocab_size must be >= 2"


def _int_list(text: str, sep: str) -> list[int] | None:
    """The integers in `text` separated by `sep`, or None if one is not an integer."""
    try:
        return [int(x) for x in text.split(sep)]
    except ValueError:
        return None


class DataConfig(_Section):
    """Where training text comes from and how a peer picks its part of it."""

    SECTION: ClassVar[str] = "data"

    paths: list[str] = Field(default_factory=list)
    """Text files or folders; empty means the running Python's standard library sources."""
    val_fraction: float = 0.02
    """Share of files held out for validation (chosen by file-name hash, the same on every peer)."""
    max_bytes: int = 24_000_000
    """Read at most this many bytes of text (keeps start-up fast on laptops)."""
    shard: str = ""
    """'i/n' reads the i-th of n disjoint parts of the training text; empty: a seed-shuffled order of all."""
    batch_size: int = 16
    """Sequences per inner step."""
    tokenizer: str = "bytes"
    """'bytes' (every byte a token, vocabulary 256) or a path to a tokenizer.json (`p2pdiloco tokenizer train`)."""
    dataset: str = ""
    """Local jsonl/parquet/arrow files or folders (comma-separated), or 'hub:NAME[:SPLIT]' (needs internet), read
    with Hugging Face `datasets` (pip install p2pdiloco[hf]); replaces `paths`. Empty: read `paths`."""
    text_field: str = "text"
    """The field of a dataset's rows that holds the text."""
    cache_dir: str = "~/.cache/p2pdiloco/tokens"
    """Where tokenized text is cached, keyed by the source files, the tokenizer and these settings; empty: no cache."""

    def checks(self) -> Iterator[tuple[bool, str]]:
        yield 0 < self.val_fraction < 1, "data.val_fraction must be in (0, 1)"
        yield self.batch_size >= 1, "data.batch_size must be >= 1"
        yield self.max_bytes >= 1, "data.max_bytes must be >= 1"
        yield bool(self.text_field), "data.text_field must not be empty"
        if self.shard:
            parts = _int_list(self.shard, "/")
            if parts is None or len(parts) != 2:
                yield False, f"data.shard must look like 'i/n', got {self.shard!r}"
            else:
                yield 0 <= parts[0] < parts[1], f"data.shard {self.shard!r}: need 0 <= i < n"


class InnerOptConfig(_Section):
    """AdamW for the inner steps, with linear warmup then cosine decay over the whole run."""

    SECTION: ClassVar[str] = "inner"

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

    def checks(self) -> Iterator[tuple[bool, str]]:
        yield self.lr > 0, "learning rates must be positive"
        yield (self.optimizer in OPTIMIZERS,
               f"inner.optimizer must be one of {', '.join(OPTIMIZERS)}, got {self.optimizer!r}")


class OuterOptConfig(_Section):
    """Nesterov SGD applied to the merged pseudo-gradient (DiLoCo, arXiv 2311.08105)."""

    SECTION: ClassVar[str] = "outer"

    lr: float = 0.7
    """Outer learning rate."""
    momentum: float = 0.9
    """Outer momentum."""
    nesterov: bool = True
    """Use Nesterov momentum."""
    eager: bool = True
    """Decoupled: go on from the outer step on the own Δ while a merge is in flight (arXiv 2502.12996)."""
    alone_lr: float = 0.0
    """Outer lr of steps on the own Δ alone (merges alone, eager updates); 0: `lr` (sparseloco's lr 3 overshoots)."""
    rebase_keep: float = 0.5
    """Decoupled: the share kept of the inner steps taken while a merge was in flight, when it lands (`rebase`)."""
    land_wait: float = 0.05
    """Decoupled: wait ≤ this share of a round for a merge to land, where recent exchanges fit it (`LandWait`)."""

    def checks(self) -> Iterator[tuple[bool, str]]:
        yield self.lr > 0 and self.alone_lr >= 0, "learning rates must be positive"
        yield 0 <= self.rebase_keep <= 1, "outer.rebase_keep must be in [0, 1]"
        yield 0 <= self.land_wait <= 1, "outer.land_wait must be in [0, 1]"
        yield 0 <= self.momentum < 1, "outer.momentum must be in [0, 1)"


class GuardConfig(_Section):
    """Checks on every received contribution, and how a merge group's contributions are combined."""

    SECTION: ClassVar[str] = "guard"

    enabled: bool = True
    """Screen contributions (finite, norm, trust, direction, staleness) and ban repeat offenders; off: plain mean."""
    norm_bound: float = 4.0
    """Reject a part whose L2 norm exceeds this many times the group's median norm (0 disables)."""
    min_cosine: float = -1.0
    """Reject a part whose cosine to the coordinate-wise median of the other members' parts is below this (-1, the
    default, disables: honest peers with unusual data fell below 0.1 and banned each other, docs/security.md)."""
    max_round_lag: int = 0
    """Leave out members whose round counter lags the group's median by more than this (0, the default, disables:
    counters grow by one per merge, so a peer that fell behind never catches up and stays excluded)."""
    ban_after: int = 3
    """Ban a peer for the rest of the run after this many consecutive merges with a rejected contribution (0: never)."""
    trust_decay: float = 0.9
    """Memory of a member's trust: its parts' cosines to our outer momentum, averaged; 0: none, -1: off (security.md)."""
    aggregate: str = "centered_clip"
    """How the accepted parts are combined: centered_clip, trimmed_mean, mean, or rda (radial-directional)."""
    robust_min_group: int = 3
    """Use the robust rule (centered_clip, trimmed_mean) only in groups of at least this many members."""
    trim_fraction: float = 0.2
    """trimmed_mean: share of values dropped at each end of every coordinate."""

    def checks(self) -> Iterator[tuple[bool, str]]:
        yield (self.norm_bound >= 0 and -1 <= self.min_cosine <= 1,
               "guard.norm_bound must be >= 0 and guard.min_cosine in [-1, 1]")
        rules = f"{', '.join(AGGREGATORS[:-1])} or {AGGREGATORS[-1]}"
        yield self.aggregate in AGGREGATORS, f"guard.aggregate must be {rules}, got {self.aggregate!r}"
        yield 0 <= self.trim_fraction < 0.5, "guard.trim_fraction must be in [0, 0.5)"
        yield self.max_round_lag >= 0 and self.ban_after >= 0, "guard.max_round_lag and ban_after must be >= 0"
        yield self.trust_decay == -1 or 0 <= self.trust_decay < 1, "guard.trust_decay must be -1 (off) or in [0, 1)"


class RunConfig(_Section):
    """One peer's run: length, device, output."""

    SECTION: ClassVar[str] = "run"

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
    checkpoint_every: int = 5
    """Save a checkpoint every this many merges (0: only at the end)."""
    resume: bool = False
    """Continue from the newest good checkpoint in run_dir (and take the swarm's state if it is ahead)."""
    cpu_affinity: str = ""
    """Comma-separated CPU ids to pin this peer to (Linux), e.g. "0"; empty leaves it to the OS."""
    metrics_port: int = 0
    """Serve Prometheus metrics at http://metrics_host:metrics_port/metrics; 0 serves none."""
    metrics_host: str = "127.0.0.1"
    """Interface for metrics_port; 0.0.0.0 lets a Prometheus on another machine scrape this peer."""
    compile: bool = False
    """Compile the model of the inner steps with torch.compile (falls back to eager, with a warning, if it fails)."""
    max_log_mb: float = 64.0
    """The most megabytes metrics.jsonl, and the log file `local` writes the peer's output to, each hold on disk
    with their one rotation (NAME.1, the older half) included; 0: no cap."""

    def checks(self) -> Iterator[tuple[bool, str]]:
        yield self.total_steps >= 1, "run.total_steps must be >= 1"
        yield self.time_limit_s >= 0, "run.time_limit_s must be >= 0"
        yield self.eval_every_rounds >= 0, "run.eval_every_rounds must be >= 0"
        yield self.log_every >= 1, "run.log_every must be >= 1"
        yield self.checkpoint_every >= 0, "run.checkpoint_every must be >= 0"
        yield self.max_log_mb >= 0, "run.max_log_mb must be >= 0"
        yield self.eval_batches >= 1, "run.eval_batches must be >= 1"
        yield 0 <= self.metrics_port <= 65535, "run.metrics_port must be in [0, 65535]"
        yield (self.precision in PRECISIONS,
               f"run.precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}")
        yield self.peak_flops >= 0, "run.peak_flops must be >= 0"
        if self.cpu_affinity:
            yield (_int_list(self.cpu_affinity, ",") is not None,
                   f"run.cpu_affinity must be comma-separated CPU ids, got {self.cpu_affinity!r}")


class EmulateConfig(_Section):
    """Emulation and testing knobs for benchmarks and tests on one machine: a slower accelerator, a fixed
    step time, a hostile peer. A real peer leaves them at their defaults; they are no property of the swarm."""

    SECTION: ClassVar[str] = "emulate"

    slow_factor: float = 1.0
    """Emulate an accelerator this many times slower: each inner step is padded with sleep."""
    min_step_s: float = 0.0
    """Pad each inner step to at least this long (an emulated accelerator's step time); 0 disables."""
    hostile: str = ""
    """Make this peer hostile (one of HOSTILE_KINDS, see testing/hostile.py); empty: an honest peer."""

    def checks(self) -> Iterator[tuple[bool, str]]:
        yield self.slow_factor >= 1, "emulate.slow_factor must be >= 1"
        yield self.min_step_s >= 0, "emulate.min_step_s must be >= 0"
        kinds = f"{', '.join(HOSTILE_KINDS[:-1])} or {HOSTILE_KINDS[-1]}"
        yield self.hostile in ("", *HOSTILE_KINDS), f"emulate.hostile must be {kinds}, got {self.hostile!r}"


class Config(_Model):
    """Everything one peer needs, one table per component."""

    model: ModelConfig = Field(default_factory=ModelConfig)
    """The transformer (the same on every peer of a swarm)."""
    data: DataConfig = Field(default_factory=DataConfig)
    """Training text and this peer's part of it."""
    inner: InnerOptConfig = Field(default_factory=InnerOptConfig)
    """The inner optimizer and its schedule."""
    outer: OuterOptConfig = Field(default_factory=OuterOptConfig)
    """The outer optimizer (the same on every peer of a swarm)."""
    swarm: SwarmConfig = Field(default_factory=SwarmConfig)
    """Joining the swarm: its name, the DHT node, the peer record."""
    rounds: RoundsConfig = Field(default_factory=RoundsConfig)
    """When rounds end, and whether the learner waits for their merges (the same on every peer of a swarm)."""
    merge: MergeConfig = Field(default_factory=MergeConfig)
    """Finding merge groups and merging in them."""
    codec: CodecConfig = Field(default_factory=CodecConfig)
    """How pseudo-gradients travel (the same on every peer of a swarm)."""
    startup: StartupConfig = Field(default_factory=StartupConfig)
    """Waiting for peers before the first inner step."""
    guard: GuardConfig = Field(default_factory=GuardConfig)
    """Screening and combining contributions (the same on every peer of a swarm)."""
    run: RunConfig = Field(default_factory=RunConfig)
    """This peer's run: length, device, output."""
    emulate: EmulateConfig = Field(default_factory=EmulateConfig)
    """Benchmark and test knobs: emulated slowness, step time, a hostile peer."""

    @model_validator(mode="after")
    def _check_across_sections(self) -> Config:
        if self.data.tokenizer in ("", "bytes") and self.model.vocab_size != 256:
            raise ConfigError(f"model.vocab_size must be 256 with data.tokenizer = 'bytes', got {self.model.vocab_size}")
        return self

    def to_dict(self) -> dict[str, Any]:
        """Every section's values, as plain dicts (what summaries and checkpoints record)."""
        return self.model_dump()

    def fingerprint(self, tokenizer: str = "bytes") -> dict[str, Any]:
        """What must be equal on every peer of a swarm (`fingerprint.config_fingerprint`); `tokenizer` is the loaded
        tokenizer's digest (`Tokenizer.digest`)."""
        return config_fingerprint(self, tokenizer)
