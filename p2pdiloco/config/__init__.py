"""Run configuration: one small typed model per component, composed into `Config`.

TOML files (``peers/*.toml``) map onto it one to one: a ``[model]`` table sets `ModelConfig` fields and so
on. Command-line flags and ``--set section.key=value`` override what the file says.

- `base.py`: coercion of TOML and flag values, one-line errors, the `_Section` base that runs `checks`.
- `schema.py`: the models, the allowed values, and every check on a value; `swarm.py`: the swarm's components.
- `load.py`: TOML files, ``--set`` flags, and the old keys that still work (`ALIASES`).
- `fingerprint.py`: what every peer of a swarm must agree on (the fingerprint), and comparing it.
"""

from p2pdiloco.config.fingerprint import (
    PROTOCOL_VERSION,
    fingerprint_diff,
    fingerprint_digest,
    protocol_fields,
    protocol_of,
)
from p2pdiloco.config.load import ALIASES, apply_values, load_config, parse_set
from p2pdiloco.config.schema import (
    AGGREGATORS,
    ARCHS,
    CODECS,
    HOSTILE_KINDS,
    OPTIMIZERS,
    PRECISIONS,
    CodecConfig,
    Config,
    ConfigError,
    DataConfig,
    EmulateConfig,
    GuardConfig,
    InnerOptConfig,
    MergeConfig,
    ModelConfig,
    OuterOptConfig,
    RoundsConfig,
    RunConfig,
    StartupConfig,
    SwarmConfig,
)

__all__ = [
    "AGGREGATORS", "ALIASES", "ARCHS", "CODECS", "HOSTILE_KINDS", "OPTIMIZERS", "PRECISIONS", "PROTOCOL_VERSION",
    "CodecConfig", "Config", "ConfigError",
    "DataConfig", "EmulateConfig", "GuardConfig", "InnerOptConfig", "MergeConfig", "ModelConfig", "OuterOptConfig",
    "RoundsConfig", "RunConfig", "StartupConfig", "SwarmConfig", "apply_values", "fingerprint_diff", "fingerprint_digest", "load_config",
    "parse_set", "protocol_fields", "protocol_of",
]
