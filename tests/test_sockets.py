"""hivemind's socket files of dead daemons told from live ones (network/sockets.py), and removed by the reaper."""

import socket
import subprocess
import sys
from pathlib import Path

import psutil

from p2pdiloco.network.sockets import (
    daemon_sockets,
    remove_stale_sockets,
    stale_listeners,
    stale_socket_files,
)


def test_stale_socket_files_are_those_nobody_has_bound(tmp_path):
    live_path, dead_path = tmp_path / "hivemind-p2pd-live.sock", tmp_path / "hivemind-p2pclient-dead.sock"
    other = tmp_path / "not-hivemind.sock"
    live = socket.socket(socket.AF_UNIX)
    live.bind(str(live_path))
    live.listen()
    for p in (dead_path, other):
        s = socket.socket(socket.AF_UNIX)
        s.bind(str(p))
        s.close()  # the file stays, as a SIGKILLed daemon's does
    try:
        assert stale_socket_files(tmp_path, grace_s=0) == [dead_path]
        assert stale_socket_files(tmp_path, grace_s=3600) == []  # too young to judge
        assert remove_stale_sockets(tmp_path, grace_s=0) == 1
        assert live_path.exists() and other.exists() and not dead_path.exists()
    finally:
        live.close()


def test_dead_processes_multiprocessing_listeners_are_removed_and_every_folder_kept(tmp_path):
    """A folder holding only dead listeners may be a live parent's whose forked children made them (a DHT
    process): the listeners go, the folder stays, and a live listener or another file is never touched."""
    def folder(name: str, *sockets: str, bound: bool = False) -> tuple[Path, list[socket.socket]]:
        path, held = tmp_path / name, []
        path.mkdir()
        for sock_name in sockets:
            s = socket.socket(socket.AF_UNIX)
            s.bind(str(path / sock_name))
            if bound:
                held.append(s)
            else:
                s.close()  # the file stays, as a SIGKILLed process's does
        return path, held

    dead, _ = folder("pymp-dead", "listener-a", "listener-b")
    live, held = folder("pymp-live", "listener-c", bound=True)
    (other, _), (mixed, _) = folder("pymp-other"), folder("pymp-mixed", "listener-d")
    (other / "listener-e").write_text("not a socket")
    (mixed / "notes").write_text("not a socket")
    try:
        assert stale_listeners(tmp_path, grace_s=0) == [dead / "listener-a", dead / "listener-b",
                                                        mixed / "listener-d"]
        assert stale_listeners(tmp_path, grace_s=3600) == []  # too young to judge
        assert remove_stale_sockets(tmp_path, grace_s=0) == 3
        assert all(p.is_dir() for p in (dead, live, other, mixed))  # the folders stay, dead or alive
        assert list(dead.iterdir()) == [] and (live / "listener-c").exists()
        assert (other / "listener-e").exists() and (mixed / "notes").exists() and not (mixed / "listener-d").exists()
    finally:
        for s in held:
            s.close()


def test_a_daemons_sockets_come_from_its_command_line():
    cmd = ["/x/p2pd", "-autonat=1", "-listen=/unix/tmp/hivemind-p2pd-AbC_d.sock", "-b=0"]
    assert daemon_sockets(cmd) == ["/tmp/hivemind-p2pd-AbC_d.sock", "/tmp/hivemind-p2pclient-AbC_d.sock"]
    assert daemon_sockets(["python", "-m", "x"]) == []


def test_the_reaper_removes_the_socket_files_of_the_daemon_it_ends(tmp_path):
    victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    sock = tmp_path / "hivemind-p2pd-x.sock"
    sock.write_text("")
    created = psutil.Process(victim.pid).create_time()
    reaper = subprocess.Popen([sys.executable, "-m", "p2pdiloco.network.reaper", f"{victim.pid}:{created}", str(sock)],
                              stdin=subprocess.PIPE)
    reaper.stdin.close()  # as when the peer dies
    assert reaper.wait(timeout=30) == 0
    assert victim.wait(timeout=10) == -9
    assert not sock.exists()
