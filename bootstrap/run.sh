#!/usr/bin/env bash
# Example: run a p2pdiloco bootstrap node in the foreground (Ctrl+C or SIGTERM stops it cleanly).
#
# Environment (all optional):
#   P2PDILOCO_BIN         the p2pdiloco command                 (default: p2pdiloco, found on PATH)
#   BOOTSTRAP_HOST        interface to listen on                (default: 0.0.0.0)
#   BOOTSTRAP_PORT        TCP port; open it in the firewall     (default: 31337)
#   BOOTSTRAP_IDENTITY    private key file, created on first run, then reused so the peer id and the
#                         multiaddr survive restarts; keep it private and back it up
#                                                               (default: ./bootstrap.key)
#   BOOTSTRAP_MADDR_FILE  where the node also writes its multiaddrs, one a line
#                                                               (default: ./bootstrap.maddr)
#   ANNOUNCE_IP           public IPv4 or IPv6 address to advertise, when this host is behind NAT or its
#                         listening address is not the one peers reach    (default: none)
#   ANNOUNCE_MADDRS       full multiaddrs to advertise, space-separated, instead of ANNOUNCE_IP
#                         (e.g. "/dns4/boot.example.org/tcp/31337")        (default: none)
#
# Example:  BOOTSTRAP_PORT=31337 ANNOUNCE_IP=203.0.113.5 bash bootstrap/run.sh
set -euo pipefail

P2PDILOCO_BIN="${P2PDILOCO_BIN:-p2pdiloco}"
BOOTSTRAP_HOST="${BOOTSTRAP_HOST:-0.0.0.0}"
BOOTSTRAP_PORT="${BOOTSTRAP_PORT:-31337}"
BOOTSTRAP_IDENTITY="${BOOTSTRAP_IDENTITY:-./bootstrap.key}"
BOOTSTRAP_MADDR_FILE="${BOOTSTRAP_MADDR_FILE:-./bootstrap.maddr}"
ANNOUNCE_IP="${ANNOUNCE_IP:-}"
ANNOUNCE_MADDRS="${ANNOUNCE_MADDRS:-}"

args=(bootstrap
      --host "$BOOTSTRAP_HOST"
      --port "$BOOTSTRAP_PORT"
      --identity "$BOOTSTRAP_IDENTITY"
      --maddr-file "$BOOTSTRAP_MADDR_FILE")

if [[ -n "$ANNOUNCE_MADDRS" ]]; then
    read -r -a announce <<< "$ANNOUNCE_MADDRS"
    args+=(--announce "${announce[@]}")
elif [[ -n "$ANNOUNCE_IP" ]]; then
    if [[ "$ANNOUNCE_IP" == *:* ]]; then proto=ip6; else proto=ip4; fi
    args+=(--announce "/$proto/$ANNOUNCE_IP/tcp/$BOOTSTRAP_PORT")
fi

# exec: the node itself receives SIGINT/SIGTERM and shuts its DHT down in order
exec "$P2PDILOCO_BIN" "${args[@]}"
