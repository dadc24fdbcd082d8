"""Logs capped by size (util/logfiles.py) and read back whole across their rotation."""

import json
import subprocess
import sys

from p2pdiloco.app.peer import keep_previous
from p2pdiloco.training.reporting import MetricsLog
from p2pdiloco.util.logfiles import CappedLog, cap_output, read_jsonl, rotations


def test_a_capped_log_keeps_the_newest_lines_within_its_budget_and_reads_back_in_order(tmp_path):
    path = tmp_path / "metrics.jsonl"
    log = MetricsLog(path, max_bytes=4000)
    for i in range(500):
        log.write(kind="train", step=i)
    log.close()
    assert [p.name for p in rotations(path)] == ["metrics.jsonl.1", "metrics.jsonl"]
    assert sum(p.stat().st_size for p in rotations(path)) <= 4000
    steps = [r["step"] for r in read_jsonl(path)]
    assert steps == list(range(steps[0], 500))  # the newest, whole and in order across the rotation
    assert steps[0] > 0


def test_no_cap_never_rotates_and_a_torn_line_is_skipped(tmp_path):
    path = tmp_path / "m.jsonl"
    log = CappedLog(path, 0)
    for i in range(200):
        log.write_line(json.dumps({"i": i}))
    log.close()
    with path.open("a") as f:
        f.write('{"i": 2')  # cut by a kill
    assert rotations(path) == [path]
    assert [r["i"] for r in read_jsonl(path)] == list(range(200))


def test_a_resumed_log_appends_to_the_file_it_finds(tmp_path):
    path = tmp_path / "m.jsonl"
    for start in (0, 10):
        log = CappedLog(path, 10_000)
        for i in range(start, start + 10):
            log.write_line(json.dumps({"i": i}))
        log.close()
    assert [r["i"] for r in read_jsonl(path)] == list(range(20))


def test_keep_previous_moves_the_rotation_aside_too(tmp_path):
    path = tmp_path / "metrics.jsonl"
    log = MetricsLog(path, max_bytes=400)
    for i in range(40):
        log.write(step=i)
    log.close()
    keep_previous(path)
    assert rotations(path) == []
    kept = sorted(p.name for p in tmp_path.iterdir())
    assert len(kept) == 2 and kept[0].startswith("metrics-") and kept[1].endswith(".jsonl.1")


def test_output_redirected_to_an_appended_file_is_capped_while_it_is_written(tmp_path):
    log = tmp_path / "peer.log"
    code = ("import sys\n"
            "from p2pdiloco.util.logfiles import cap_output\n"
            "rotated = 0\n"
            "for i in range(2000):\n"
            "    print(f'line {i:05d} ' + 'x' * 40, file=sys.stderr, flush=True)\n"
            "    rotated += cap_output(20_000)\n"
            "print('rotated', rotated, file=sys.stderr)\n")
    with log.open("a") as f:
        subprocess.run([sys.executable, "-c", code], stderr=f, check=True, timeout=60)
    older = tmp_path / "peer.log.1"
    assert older.exists() and log.stat().st_size + older.stat().st_size <= 20_000 + 100
    assert "rotated" in log.read_text() and "\0" not in log.read_text()  # written at the new end, no hole


def test_output_written_at_an_offset_is_left_alone(tmp_path):
    path = tmp_path / "out.log"
    with path.open("w") as f:
        f.write("x" * 5000)
        f.flush()
        assert not cap_output(1000, f.fileno())
    assert path.stat().st_size == 5000
