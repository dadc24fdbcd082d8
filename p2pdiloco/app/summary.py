"""A run's summary.json: every peer's peer_summary.json, their mean eval losses, how far apart their final global
models ended, and the swarm's bandwidth. Its own module so that a lone peer writes it without importing `local`'s
display (rich) and process management."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from p2pdiloco.network.traffic import swarm_bandwidth
from p2pdiloco.util.files import write_json_atomic


def consensus_distance(peer_dirs: list[Path]) -> float | None:
    """Largest relative L2 distance ‖θa − θb‖ / mean(‖θa‖, ‖θb‖) between two peers' final global models
    (their model.safetensors); 0.0 means every peer ended with the same model, None if fewer than two."""
    from safetensors.torch import load_file

    flats = []
    for d in peer_dirs:
        path = d / "model.safetensors"
        if path.exists():
            tensors = load_file(str(path))
            flats.append(torch.cat([tensors[k].flatten().double() for k in sorted(tensors)]))
    if len(flats) < 2:
        return None
    worst = 0.0
    for i in range(len(flats)):
        for j in range(i + 1, len(flats)):
            scale = (flats[i].norm() + flats[j].norm()) / 2
            worst = max(worst, float((flats[i] - flats[j]).norm() / scale) if scale > 0 else 0.0)
    return worst


FINAL_LOSS_TOLERANCE = 0.01
"""Final global models that are not bit-identical count as "within tolerance" when their eval losses are within
1 % of each other: interchangeable for whoever takes the model, whichever peer it comes from."""


def final_models(peers: list[dict]) -> tuple[str, float | None]:
    """Whether the finished peers hold one model: "identical" (one digest), "within tolerance" (eval losses
    within `FINAL_LOSS_TOLERANCE`), "apart", or "none" (no peer finished); and the spread, max ÷ min − 1 of their
    final eval losses (None without losses)."""
    losses = [p["eval_loss_final"] for p in peers if p.get("eval_loss_final") is not None]
    spread = max(losses) / min(losses) - 1 if losses and min(losses) > 0 else None
    if not peers:
        return "none", spread
    if len({p["global_digest"] for p in peers}) == 1:
        return "identical", spread
    return ("within tolerance" if spread is not None and spread <= FINAL_LOSS_TOLERANCE else "apart"), spread


def summarize(run_dir: Path, peer_dirs: list[Path], config: dict, wall_s: float, extra: dict | None = None) -> dict:
    """Collect the peers' summaries into the run's summary.json."""
    loaded = [(d, json.loads((d / "peer_summary.json").read_text()))
              for d in peer_dirs if (d / "peer_summary.json").exists()]
    peers = [p for _, p in loaded]
    # a peer (re)started after the swarm finished trained nothing and kept the model it had: the run's result is
    # the models of the peers that were there at its end (`local --chaos` restarted one after the others had
    # finished, and the run was reported "apart")
    at_end = [(d, p) for d, p in loaded if not p.get("arrived_after_end")]
    ended = [p for _, p in at_end]

    def mean(key: str, of: list[dict]) -> float | None:  # over those that report it (older summaries lack the
        values = [p[key] for p in of if p.get(key) is not None]  # per-byte ones)
        return sum(values) / len(values) if values else None

    which, spread = final_models(ended)
    summary = {
        "n_peers": len(peer_dirs),
        "peers_finished": len(peers),
        "wall_s": wall_s,
        "eval_loss_initial": mean("eval_loss_initial", peers),
        "eval_loss_final": mean("eval_loss_final", ended),
        "eval_loss_per_byte_initial": mean("eval_loss_per_byte_initial", peers),
        "eval_loss_per_byte_final": mean("eval_loss_per_byte_final", ended),
        "global_models_identical": which == "identical" if peers else None,
        "consensus_distance": consensus_distance([d for d, _ in at_end]),
        "arrived_after_end": len(peers) - len(ended),  # not in final_models nor in the consensus distance
        "final_models": which,  # see final_models: identical, within tolerance (1 % of eval loss) or apart
        "eval_loss_final_spread": spread,
        **swarm_bandwidth(peers),
        **(extra or {}),
        "peers": peers,
        "config": config,
    }
    write_json_atomic(run_dir / "summary.json", summary)
    return summary
