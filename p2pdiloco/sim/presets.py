"""Shipped scenarios: the benches of this machine, and the seeds' (Decoupled DiLoCo, arXiv 2604.21428) setting.

The seeds publish their results (goodput 88 % for Decoupled DiLoCo, 58 % elastic data-parallel, 27 % data-parallel,
1.2M simulated chips under high failure rates; 93 % with 16 learners; 198 -> 0.84 Gbps across 8 data centers) but,
in what we could read, not every input behind them. `SEEDS` fills the gaps with stated assumptions; one is fitted
(the failure rate, so that plain data-parallel lands near 27 %), the rest are round numbers, and the other figures
are then predictions. docs/simulation.md lists which assumption differs where the figures do.
"""

from __future__ import annotations

from p2pdiloco.config import ConfigError
from p2pdiloco.sim.scenario import Scenario, scenario_from_dict

SEEDS_PUBLISHED = {
    "goodput": {"decoupled": 0.88, "elastic_data_parallel": 0.58, "data_parallel": 0.27},
    "goodput_16_learners": 0.93,
    "link_gbps": {"data_parallel": 198.0, "decoupled": 0.84},
    "chips": 1_200_000,
}

SEEDS = {
    "compute": {"step_s": 1.7, "tokens_per_step": 4_194_304},  # a 12B model's step; 1024 x 4096 tokens per learner
    "failures": {
        "mtbf_s": 9600.0,  # per learner of 150k chips: the 1.2M chips fail every 20 min (fitted: data-parallel ~27 %)
        "down_s": 300.0, "restart_s": 300.0, "first_start_s": 0.0,  # repair 5 min; restart + state download 5 min
        "dp_restart_s": 300.0, "dp_detect_s": 30.0, "count_down_time": True,  # idle chips count as spent
    },
    "network": {
        "params": 12_000_000_000, "codec": "int4", "bandwidth_gbps": 5.0, "latency_s": 0.03, "matchmaking_s": 1.0,
        "dp_bytes_per_value": 2.0,  # bf16 gradients: 198 Gbps per data-centre link at 1.7 s a step
    },
    "protocol": {
        "round_seconds": 0.0, "round_steps": 100, "merge_window_s": 120.0, "sync_window_s": 600.0,
        "checkpoint_every_steps": 1060, "elastic_units": 64,  # checkpoints every 30 min; 64 data-parallel replicas
        "epoch_s": 1700.0,  # groups redrawn every ~10 rounds, as the config's presets for big models do (medium.toml)
    },
    "run": {"learners": 8, "duration_s": 360_000.0, "algorithms":
            ["decoupled", "sync", "elastic_data_parallel", "data_parallel"]},
}

BENCH_PROTOCOL = {  # what the benches set over the shipped defaults (bench/churn.py, bench/straggler.py)
    "round_seconds": 2.0, "round_steps": 20, "merge_window_s": 10.0, "sync_window_s": 60.0,
}

CHURN = {  # bench churn's setting (bench/churn.py): 4 peers, 3000 steps, a kill every 60 s, back 5 s later
    "failures": {"kill_every_s": 60.0},
    "protocol": BENCH_PROTOCOL,
    "run": {"learners": 4, "total_steps": 3000},
}

STRAGGLER = {  # bench straggler's with-slow runs: 4 peers for 60 s, peer 3 four times slower
    "compute": {"speeds": [1.0, 1.0, 1.0, 4.0]},
    "protocol": BENCH_PROTOCOL,
    "run": {"learners": 4, "duration_s": 60.0, "algorithms": ["decoupled", "sync", "data_parallel"]},
}

VOLUNTEERS = {  # an operator's first guess: 1000 consumer GPUs of three generations, home links, 2 hours
    "compute": {"step_s": 0.5, "speeds": [1.0, 1.6, 2.5], "speed_fractions": [0.2, 0.5, 0.3], "jitter": 0.15,
                "tokens_per_step": 65_536},
    "failures": {"mtbf_s": 14_400.0, "down_s": 600.0, "restart_s": 60.0, "first_start_s": 60.0},
    "network": {"params": 500_000_000, "bandwidth_gbps": 0.1, "latency_s": 0.05, "matchmaking_s": 2.0},
    "protocol": {"sync_window_s": 600.0, "checkpoint_every_steps": 1000},  # the rest: the shipped defaults
    "run": {"learners": 1000, "duration_s": 7_200.0},
}

PRESETS = {"seeds": SEEDS, "churn": CHURN, "straggler": STRAGGLER, "volunteers": VOLUNTEERS}


def preset(name: str) -> Scenario:
    """A shipped scenario by name. Raises ConfigError for an unknown one."""
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; choose from {', '.join(PRESETS)}")
    return scenario_from_dict(PRESETS[name])
