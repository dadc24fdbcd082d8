"""Tests of the loss plot of a run folder."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from p2pdiloco.observe.plot import plot_run, read_metrics
from tests.test_cli import _one_line_error, run_cli


def _write_peer(run_dir: Path, name: str, lines: list[str]) -> Path:
    path = run_dir / "peers" / name / "metrics.jsonl"
    path.parent.mkdir(parents=True)
    path.write_text("\n".join(lines) + "\n")
    return path


def _synthetic_lines(offset: float) -> list[str]:
    lines = []
    for step in range(0, 200, 10):
        record = {
            "elapsed_s": step * 0.5,
            "step": step,
            "tokens": step * 2048,
            "loss": 5.5 - step / 100 + offset,
            "tokens_per_s": 4096.0 + offset * 1000,
            "bytes_sent": step * 30_000,
            "bytes_received": step * 31_000,
        }
        if step % 50 == 0:
            record["eval_loss"] = 5.6 - step / 100 + offset  # a line may carry both
        lines.append(json.dumps(record))
    lines.append(json.dumps({"elapsed_s": 101.0, "step": 200, "tokens": 409600, "eval_loss": 3.7 + offset}))
    lines.append(json.dumps({"elapsed_s": 102.0, "step": 200, "peers": 3}))  # neither loss
    lines.append("not json at all")
    lines.append(json.dumps([1, 2, 3]))
    lines.append(json.dumps({"elapsed_s": "soon", "loss": 1.0}))
    lines.append('{"elapsed_s": 103.0, "step": 201, "lo')  # cut off while the peer was writing
    return lines


def test_read_metrics_keeps_only_well_formed_points(tmp_path: Path) -> None:
    path = _write_peer(tmp_path, "alice", _synthetic_lines(0.0))
    curves = read_metrics(path)
    assert len(curves.train) == 20
    assert curves.train[0] == (0.0, 5.5)
    assert curves.train[-1] == pytest.approx((95.0, 3.6))
    assert [t for t, _ in curves.eval] == [0.0, 25.0, 50.0, 75.0, 101.0]
    assert curves.eval[-1] == (101.0, 3.7)


def test_read_metrics_reads_tokens_throughput_and_bytes(tmp_path: Path) -> None:
    curves = read_metrics(_write_peer(tmp_path, "alice", _synthetic_lines(0.0)))
    assert curves.train_tokens[1] == (20480, pytest.approx(5.4))
    assert curves.eval_tokens[-1] == (409600, 3.7)
    assert len(curves.throughput) == 20 and curves.throughput[0] == (0.0, 4096.0)
    assert curves.tokens[-1] == (101.0, 409600)
    assert curves.sent[-1] == (95.0, 190 * 30_000) and curves.received[-1] == (95.0, 190 * 31_000)


PNGS = ["bytes.png", "loss.png", "loss_tokens.png", "throughput.png"]


def test_plot_run_writes_the_pngs(tmp_path: Path) -> None:
    _write_peer(tmp_path, "alice", _synthetic_lines(0.0))
    _write_peer(tmp_path, "bob-gpu", _synthetic_lines(0.2))
    _write_peer(tmp_path, "carol", ["garbage", ""])  # a peer with nothing to plot is left out
    written = plot_run(tmp_path)
    assert sorted(p.name for p in written) == PNGS
    for path in written:
        png = path.read_bytes()
        assert png.startswith(b"\x89PNG\r\n\x1a\n")
        assert len(png) > 10_000
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*PNGS, "peers"])  # no temp file left


def test_plot_run_with_only_train_points(tmp_path: Path) -> None:
    _write_peer(
        tmp_path,
        "alice",
        [json.dumps({"elapsed_s": float(s), "step": s, "loss": 5.0 - s / 10}) for s in range(5)],
    )
    # no tokens, throughput or bytes in these lines: only the figure that has points is written
    assert plot_run(tmp_path) == [tmp_path / "loss.png"]
    assert (tmp_path / "loss.png").stat().st_size > 1000


def test_plot_run_returns_nothing_for_an_empty_run(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="p2pdiloco.observe.plot"):
        assert plot_run(tmp_path) == []
    assert "nothing to plot" in caplog.text
    assert not (tmp_path / "loss.png").exists()

    _write_peer(tmp_path, "alice", ["{broken", json.dumps({"step": 1, "loss": 2.0})])  # no elapsed_s
    assert plot_run(tmp_path) == []
    assert not (tmp_path / "loss.png").exists()


def test_plot_command(tmp_path):
    _one_line_error(run_cli("plot", str(tmp_path / "missing")), "is not a folder")
    out = run_cli("plot", str(tmp_path))
    assert out.returncode == 1 and out.stderr.count("\n") == 1 and "nothing to plot" in out.stderr
    (tmp_path / "metrics.jsonl").write_text(
        "".join(json.dumps({"kind": "train", "elapsed_s": i, "step": i * 10, "tokens": i * 640, "loss": 5 - i / 10,
                            "tokens_per_s": 640.0, "bytes_sent": i * 100, "bytes_received": i * 90}) + "\n"
                for i in range(1, 20)))
    out = run_cli("plot", str(tmp_path))
    assert out.returncode == 0, out.stderr
    assert sorted(Path(p).name for p in out.stdout.split()) == ["bytes.png", "loss.png", "loss_tokens.png",
                                                                "throughput.png"]
