"""Loss curves of a run folder, drawn from each peer's ``metrics.jsonl``."""

from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

# The Agg canvas draws to files only. Using Figure directly (not pyplot) needs no display, leaves
# pyplot's global backend alone and keeps no figures alive between calls.
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

LOG = logging.getLogger(__name__)


@dataclass
class PeerCurves:
    """One peer's loss points, in the order its metrics file lists them."""

    train: list[tuple[float, float]] = field(default_factory=list)
    """(seconds since the peer started, training loss in nats per byte)."""
    eval: list[tuple[float, float]] = field(default_factory=list)
    """(seconds since the peer started, validation loss of the global model in nats per byte)."""


def _number(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def read_metrics(path: Path) -> PeerCurves:
    """Loss points from one ``metrics.jsonl``, skipping lines that are malformed or lack the key.

    A peer may be writing the file while we read it, so a cut-off last line is expected, not an error.

    Args:
        path: A JSON-lines file; lines with ``elapsed_s`` and ``loss`` and/or ``eval_loss`` count.

    Returns:
        The peer's training and evaluation points.
    """
    curves = PeerCurves()
    try:
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError as e:
        LOG.warning("cannot read %s: %s", path, e.strerror)
        return curves
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if not isinstance(record, dict):
            continue
        t = _number(record.get("elapsed_s"))
        if t is None:
            continue
        loss, eval_loss = _number(record.get("loss")), _number(record.get("eval_loss"))
        if loss is not None:
            curves.train.append((t, loss))
        if eval_loss is not None:
            curves.eval.append((t, eval_loss))
    return curves


def _time_unit(max_seconds: float) -> tuple[float, str]:
    """Divisor and name of a time unit that keeps the axis numbers readable."""
    if max_seconds >= 2 * 3600:
        return 3600.0, "h"
    if max_seconds >= 10 * 60:
        return 60.0, "min"
    return 1.0, "s"


def plot_run(run_dir: Path) -> list[Path]:
    """Draw ``run_dir/loss.png``: training loss (left) and global-model eval loss (right) per peer.

    Args:
        run_dir: A run folder holding ``peers/<peer_name>/metrics.jsonl`` (`p2pdiloco local`), or the
            folder of one peer holding ``metrics.jsonl``.

    Returns:
        The paths written: ``[run_dir / "loss.png"]``, or ``[]`` when no peer has a loss point yet.
    """
    run_dir = Path(run_dir)
    files = sorted(run_dir.glob("peers/*/metrics.jsonl"))
    if not files and (run_dir / "metrics.jsonl").exists():  # the folder of one `p2pdiloco peer`
        files = [run_dir / "metrics.jsonl"]
    peers = {metrics.parent.name: read_metrics(metrics) for metrics in files}
    peers = {name: c for name, c in peers.items() if c.train or c.eval}
    if not peers:
        LOG.warning("nothing to plot in %s: no loss points in peers/*/metrics.jsonl", run_dir)
        return []

    max_t = max(t for c in peers.values() for t, _ in c.train + c.eval)
    scale, unit = _time_unit(max_t)
    fig = Figure(figsize=(12, 4.5), layout="constrained")
    FigureCanvasAgg(fig)
    ax_train, ax_eval = fig.subplots(1, 2, sharex=True)
    for i, (name, curves) in enumerate(peers.items()):
        # One colour per peer in both panels, so a peer's two curves are easy to pair up.
        color = f"C{i % 10}"
        if curves.train:
            ts, losses = zip(*curves.train, strict=True)
            ax_train.plot([t / scale for t in ts], losses, color=color, linewidth=1.2, label=name)
        if curves.eval:
            ts, losses = zip(*curves.eval, strict=True)
            ax_eval.plot([t / scale for t in ts], losses, color=color, marker="o", markersize=4, label=name)

    ax_train.set_title("Training loss (local model)")
    ax_eval.set_title("Validation loss (global model)")
    for ax, has_data in (
        (ax_train, any(c.train for c in peers.values())),
        (ax_eval, any(c.eval for c in peers.values())),
    ):
        ax.set_xlabel(f"time since peer start ({unit})")
        ax.set_ylabel("loss (nats per byte)")
        ax.grid(True, alpha=0.3)
        if has_data:
            ax.legend(title="peer", fontsize="small")
        else:
            ax.text(0.5, 0.5, "no points yet", transform=ax.transAxes, ha="center", va="center")

    out = run_dir / "loss.png"
    # Write then rename, so that a dashboard reading loss.png never sees half a file.
    tmp = out.with_name(f".{out.name}.tmp")
    fig.savefig(tmp, format="png", dpi=100)
    os.replace(tmp, out)
    return [out]
