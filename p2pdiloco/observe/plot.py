"""Loss curves of a run folder, drawn from each peer's ``metrics.jsonl``."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

# The Agg canvas draws to files only. Using Figure directly (not pyplot) needs no display, leaves
# pyplot's global backend alone and keeps no figures alive between calls.
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from p2pdiloco.util.files import replacing
from p2pdiloco.util.logfiles import read_jsonl
from p2pdiloco.util.numbers import number_or_none

LOG = logging.getLogger(__name__)


@dataclass
class PeerCurves:
    """One peer's points, in the order its metrics file lists them. Times are seconds since the peer started,
    losses in nats per byte."""

    train: list[tuple[float, float]] = field(default_factory=list)
    """(time, training loss of the local model)."""
    eval: list[tuple[float, float]] = field(default_factory=list)
    """(time, validation loss of the global model)."""
    train_tokens: list[tuple[float, float]] = field(default_factory=list)
    """(tokens trained on so far, training loss)."""
    eval_tokens: list[tuple[float, float]] = field(default_factory=list)
    """(tokens trained on so far, validation loss)."""
    throughput: list[tuple[float, float]] = field(default_factory=list)
    """(time, tokens per second since the previous train line)."""
    tokens: list[tuple[float, float]] = field(default_factory=list)
    """(time, tokens trained on so far)."""
    sent: list[tuple[float, float]] = field(default_factory=list)
    """(time, bytes sent in merges so far)."""
    received: list[tuple[float, float]] = field(default_factory=list)
    """(time, bytes received in merges so far)."""


def _number(value: object) -> float | None:
    return number_or_none(value)


def read_metrics(path: Path) -> PeerCurves:
    """Points from one ``metrics.jsonl``, skipping lines that are malformed or lack the keys.

    A peer may be writing the file while we read it, so a cut-off last line is expected, not an error.

    Args:
        path: A JSON-lines file; lines with ``elapsed_s`` count, and give a point to each curve whose keys
            they carry (``loss``, ``eval_loss``, ``tokens``, ``tokens_per_s``, ``bytes_sent``, ``bytes_received``).

    Returns:
        The peer's curves.
    """
    curves = PeerCurves()
    try:
        records = read_jsonl(path)
    except OSError as e:
        LOG.warning("cannot read %s: %s", path, e.strerror)
        return curves
    for record in records:
        t = _number(record.get("elapsed_s"))
        if t is None:
            continue
        loss, eval_loss, tokens = (_number(record.get(k)) for k in ("loss", "eval_loss", "tokens"))
        if loss is not None:
            curves.train.append((t, loss))
            if tokens is not None:
                curves.train_tokens.append((tokens, loss))
        if eval_loss is not None:
            curves.eval.append((t, eval_loss))
            if tokens is not None:
                curves.eval_tokens.append((tokens, eval_loss))
        if tokens is not None:
            curves.tokens.append((t, tokens))
        for key, points in (("tokens_per_s", curves.throughput), ("bytes_sent", curves.sent),
                            ("bytes_received", curves.received)):
            value = _number(record.get(key))
            if value is not None:
                points.append((t, value))
    return curves


def _time_unit(max_seconds: float) -> tuple[float, str]:
    """Divisor and name of a time unit that keeps the axis numbers readable."""
    if max_seconds >= 2 * 3600:
        return 3600.0, "h"
    if max_seconds >= 10 * 60:
        return 60.0, "min"
    return 1.0, "s"


def _scale(max_value: float, unit: str) -> tuple[float, str]:
    """Divisor and label of a count unit: 12_000_000 tokens -> (1e6, 'M tokens')."""
    for factor, prefix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if max_value >= 10 * factor:
            return factor, f"{prefix}{unit}" if unit == "B" else f"{prefix} {unit}"
    return 1.0, unit


@dataclass
class Panel:
    """One subplot: which curve of each peer it draws, and how its axes read."""

    title: str
    curve: str
    """The `PeerCurves` field to draw."""
    x: str
    """'time' (seconds since the peer started) or a count unit such as 'tokens'."""
    y: str
    """The y axis label; 'B' and 'tokens' get scaled units."""
    markers: bool = False


FIGURES = {
    "loss.png": [Panel("Training loss (local model)", "train", "time", "loss (nats per byte)"),
                 Panel("Validation loss (global model)", "eval", "time", "loss (nats per byte)", markers=True)],
    "loss_tokens.png": [Panel("Training loss vs tokens", "train_tokens", "tokens", "loss (nats per byte)"),
                        Panel("Validation loss vs tokens", "eval_tokens", "tokens", "loss (nats per byte)", markers=True)],
    "throughput.png": [Panel("Throughput", "throughput", "time", "tokens/s"),
                       Panel("Tokens trained", "tokens", "time", "tokens")],
    "bytes.png": [Panel("Bytes sent in merges", "sent", "time", "B"),
                  Panel("Bytes received in merges", "received", "time", "B")],
}
"""The PNGs `plot_run` writes, each with its panels. A figure whose panels have no point is not written."""


def _draw(path: Path, panels: list[Panel], peers: dict[str, PeerCurves]) -> None:
    fig = Figure(figsize=(12, 4.5), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(panels))
    for ax, panel in zip(axes, panels, strict=True):
        series = {name: getattr(c, panel.curve) for name, c in peers.items()}
        xs = [x for pts in series.values() for x, _ in pts] or [1.0]
        ys = [y for pts in series.values() for _, y in pts] or [1.0]
        if panel.x == "time":
            x_div, x_unit = _time_unit(max(xs))
            x_label = f"time since peer start ({x_unit})"
        else:
            x_div, x_unit = _scale(max(xs), panel.x)
            x_label = x_unit
        y_div, y_label = (1.0, panel.y) if "loss" in panel.y else _scale(max(ys), panel.y)
        y_label = ("bytes" if y_label == "B" else f"bytes ({y_label})") if panel.y == "B" else y_label
        for i, (name, pts) in enumerate(series.items()):
            if pts:  # one colour per peer in every panel and figure, so a peer's curves are easy to pair up
                px, py = zip(*pts, strict=True)
                ax.plot([x / x_div for x in px], [y / y_div for y in py], color=f"C{i % 10}", label=name,
                        linewidth=1.2, marker="o" if panel.markers else None, markersize=4)
        ax.set_title(panel.title)
        ax.set_xlabel(x_label)
        ax.set_ylabel(y_label)
        ax.grid(True, alpha=0.3)
        if any(series.values()):
            ax.legend(title="peer", fontsize="small")
        else:
            ax.text(0.5, 0.5, "no points yet", transform=ax.transAxes, ha="center", va="center")
    with replacing(path) as tmp:  # a reader of the PNG never sees half a file
        fig.savefig(tmp, format="png", dpi=100)


def plot_run(run_dir: Path) -> list[Path]:
    """Draw the run's PNGs from its peers' metrics, one colour per peer:

    - ``loss.png``: training loss (local model) and validation loss (global model) vs time;
    - ``loss_tokens.png``: the same vs tokens trained on;
    - ``throughput.png``: tokens per second, and tokens trained, vs time;
    - ``bytes.png``: bytes sent and received in merges vs time.

    Args:
        run_dir: A run folder holding ``peers/<peer_name>/metrics.jsonl`` (`p2pdiloco local`), or the
            folder of one peer holding ``metrics.jsonl``.

    Returns:
        The paths written; ``[]`` when no peer has a point yet. A figure with no point at all is skipped.
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
    written = []
    for filename, panels in FIGURES.items():
        if any(getattr(c, panel.curve) for c in peers.values() for panel in panels):
            _draw(run_dir / filename, panels, peers)
            written.append(run_dir / filename)
    return written
