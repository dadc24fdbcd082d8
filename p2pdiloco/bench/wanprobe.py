"""Probes of an emulated link: round trips and loss over UDP, goodput each way over TCP.

The WAN lab runs `python -m p2pdiloco.bench.wanprobe serve ADDR PORT` in its hub and the probes in a home
(`rtt`, `up`, `down`), each a process inside its namespace that prints one JSON line; it imports nothing heavy,
so that a probe starts in a fraction of a second. Every socket has a short timeout and every probe a bound on
its duration, so a link that drops everything ends the probe with a figure (all lost), not a hang.

- `rtt`: `count` UDP datagrams, one every `interval_s`, each echoed by the server; the round trips of the echoes
  (p50, p99), the datagrams the server received (one-way loss, home to hub) and the echoes that came back
  (loss of a round trip).
- `up` / `down`: one TCP connection that carries bytes for `seconds` from the home to the hub / back; the rate
  of TCP payload reaching the receiver (retransmissions included: they used the link too), over the last two
  thirds of the transfer, after TCP's start-up.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import struct
import sys
import threading
import time

SOCKET_TIMEOUT_S = 5.0
CHUNK = 64 * 1024
WARMUP = 1 / 3
"""Share of a transfer's receiving time left out of its goodput (TCP's slow start over a long round trip)."""
TCP_INFO_LEN = 232
RCV_MSS_AT = 20
DATA_SEGS_IN_AT = 152
"""Offsets of tcpi_rcv_mss and tcpi_data_segs_in (u32 each) in Linux's struct tcp_info (the latter since 4.6)."""
HEADER = struct.Struct("!8sId")
"""A UDP probe: session id, sequence number, send time (monotonic, the sender's clock)."""


def goodput_mbit(marks: list[tuple[float, int]]) -> float | None:
    """Mbit/s over the last two thirds of a transfer, from (time, bytes received so far) marks; None if too short.

    Args:
        marks: (monotonic seconds, cumulative bytes) after each read, in order.
    """
    if len(marks) < 3 or marks[-1][0] <= marks[0][0]:
        return None
    start = marks[0][0] + WARMUP * (marks[-1][0] - marks[0][0])
    first = next(m for m in marks if m[0] >= start)
    seconds, size = marks[-1][0] - first[0], marks[-1][1] - first[1]
    return size * 8 / seconds / 1e6 if seconds > 0 else None


def _kernel_received(conn: socket.socket) -> int | None:
    """Payload bytes that have reached this TCP socket so far, as its kernel counts them; None if unknown.

    tcp_info's data segments received (in order or not) times the receiver's segment size: what crossed the
    link. The in-order count (tcpi_bytes_received) stalls behind each lost segment and then jumps, so a window
    that opens in a stall would credit it with bytes that came before; the application's own count is worse
    (a reader the CPU scheduler held back finds a backlog).
    """
    try:
        info = conn.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, TCP_INFO_LEN)
    except (OSError, AttributeError):
        return None
    if len(info) < DATA_SEGS_IN_AT + 4:
        return None
    return struct.unpack_from("I", info, DATA_SEGS_IN_AT)[0] * struct.unpack_from("I", info, RCV_MSS_AT)[0]


def _receive(conn: socket.socket, deadline: float) -> list[tuple[float, int]]:
    """Read until EOF or `deadline`; (time, bytes received so far) after each read (`_kernel_received` where
    Linux gives it, else the bytes read)."""
    marks, total = [], 0
    while time.monotonic() < deadline:
        data = conn.recv(CHUNK)
        if not data:
            break
        total += len(data)
        kernel = _kernel_received(conn)
        marks.append((time.monotonic(), total if kernel is None else kernel))
    return marks


def _send_for(conn: socket.socket, seconds: float) -> None:
    payload, end = b"\0" * CHUNK, time.monotonic() + seconds
    while time.monotonic() < end:
        conn.sendall(payload)


def _serve_tcp(conn: socket.socket) -> None:
    with conn:
        conn.settimeout(SOCKET_TIMEOUT_S)
        request = conn.recv(64).decode().split()
        if request[:1] == ["sink"]:  # the client sends; we measure and answer with the figure
            marks = _receive(conn, time.monotonic() + float(request[1]) + SOCKET_TIMEOUT_S)
            conn.sendall(json.dumps({"mbit": goodput_mbit(marks), "bytes": marks[-1][1] if marks else 0}).encode())
        elif request[:1] == ["source"]:
            _send_for(conn, float(request[1]))


def serve(host: str, port: int) -> None:
    """Echo UDP probes (and count them per session) and serve TCP transfers on `host:port`, until killed."""
    counts: dict[bytes, int] = {}
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    udp.bind((host, port))
    tcp = socket.socket()
    tcp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    tcp.bind((host, port))
    tcp.listen(8)

    def udp_loop() -> None:
        while True:
            data, peer = udp.recvfrom(2048)
            if data.startswith(b"STAT"):
                udp.sendto(str(counts.get(data[4:12], 0)).encode(), peer)
            elif len(data) >= HEADER.size:
                session = data[:8]
                counts[session] = counts.get(session, 0) + 1
                udp.sendto(data, peer)

    threading.Thread(target=udp_loop, daemon=True).start()
    print("ready", flush=True)
    while True:
        conn, _ = tcp.accept()
        threading.Thread(target=_serve_tcp, args=(conn,), daemon=True).start()


def probe_rtt(host: str, port: int, count: int, interval_s: float) -> dict:
    """Send `count` UDP probes to the server, one every `interval_s`; round trips and losses (module docstring)."""
    session = os.urandom(8)
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.connect((host, port))
    rtts: dict[int, float] = {}
    done = threading.Event()

    def collect() -> None:
        sock.settimeout(0.1)
        while not done.is_set():
            try:
                data = sock.recv(2048)
            except (TimeoutError, ConnectionRefusedError):
                continue
            if len(data) >= HEADER.size and data[:8] == session:
                _, seq, sent = HEADER.unpack_from(data)
                rtts.setdefault(seq, time.monotonic() - sent)

    reader = threading.Thread(target=collect, daemon=True)
    reader.start()
    start = time.monotonic()
    for seq in range(count):
        time.sleep(max(0.0, start + seq * interval_s - time.monotonic()))  # pacing the probes, not waiting on one
        sock.send(HEADER.pack(session, seq, time.monotonic()) + b"\0" * 64)
    # stragglers: until every echo is in, or twice the slowest round trip seen (at least 0.2 s, at most 2 s)
    deadline = time.monotonic() + min(2.0, max(0.2, 2 * max(rtts.values(), default=1.0)))
    while len(rtts) < count and time.monotonic() < deadline:
        time.sleep(0.01)  # polling for the last echoes, with a deadline
    done.set()
    reader.join(timeout=1.0)
    received = None
    sock.settimeout(0.5)
    for _ in range(5):  # the query itself may be lost
        try:
            sock.send(b"STAT" + session)
            received = int(sock.recv(64).decode())
            break
        except (TimeoutError, ValueError, ConnectionRefusedError):
            continue
    sock.close()
    ms = sorted(v * 1e3 for v in rtts.values())
    return {"sent": count, "server_received": received, "echoed": len(ms),
            "rtt_ms_p50": _quantile(ms, 0.5), "rtt_ms_p99": _quantile(ms, 0.99)}


def _quantile(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    pos = (len(xs) - 1) * q
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def probe_transfer(host: str, port: int, direction: str, seconds: float) -> dict:
    """One TCP transfer of `seconds` to the server (`up`) or from it (`down`); its goodput in Mbit/s."""
    with socket.create_connection((host, port), timeout=SOCKET_TIMEOUT_S) as conn:
        conn.settimeout(SOCKET_TIMEOUT_S)
        if direction == "up":
            conn.sendall(f"sink {seconds}".ljust(64).encode())
            _send_for(conn, seconds)
            conn.shutdown(socket.SHUT_WR)
            answer = json.loads(conn.recv(4096).decode())
            return {"mbit": answer["mbit"], "bytes": answer["bytes"]}
        conn.sendall(f"source {seconds}".ljust(64).encode())
        marks = _receive(conn, time.monotonic() + seconds + SOCKET_TIMEOUT_S)
        return {"mbit": goodput_mbit(marks), "bytes": marks[-1][1] if marks else 0}


def main(argv: list[str] | None = None) -> int:
    """`serve HOST PORT`, or a probe `rtt|up|down HOST PORT` that prints its result as one JSON line."""
    ap = argparse.ArgumentParser(prog="python -m p2pdiloco.bench.wanprobe")
    ap.add_argument("mode", choices=["serve", "rtt", "up", "down"])
    ap.add_argument("host")
    ap.add_argument("port", type=int)
    ap.add_argument("--count", type=int, default=500, help="rtt: UDP probes")
    ap.add_argument("--interval-s", type=float, default=0.002, help="rtt: seconds between probes")
    ap.add_argument("--seconds", type=float, default=1.5, help="up, down: length of the transfer")
    args = ap.parse_args(argv)
    if args.mode == "serve":
        serve(args.host, args.port)
    elif args.mode == "rtt":
        print(json.dumps(probe_rtt(args.host, args.port, args.count, args.interval_s)))
    else:
        print(json.dumps(probe_transfer(args.host, args.port, args.mode, args.seconds)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
