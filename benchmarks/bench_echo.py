"""Keystroke echo round trip through the devbox agent vs OpenSSH's sshd.

The same OpenSSH client (`ssh -tt`, a remote PTY in raw mode running `cat`) sends one byte
at a time and waits for it to come back. Prints p50/p99 per server and the agent's added
p99 (target < 5 ms).
    python benchmarks/bench_echo.py [--keys 400]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

if not __package__:
    # Run as a file (python benchmarks/bench_x.py, from any folder), Python puts benchmarks/
    # first on the path: the repo's root takes its place, as under `python -m`, for the
    # benchmarks.* and tests.* imports (neither is an installed package).
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from benchmarks.harness import emit, sandbox, ssh_base, sshd, summary

REMOTE = "stty raw -echo; echo READY; exec cat"


def round_trips(base: list[str], env: dict[str, str], keys: int) -> list[float]:
    proc = subprocess.Popen(
        [*base[:-1], "-tt", base[-1], REMOTE],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        bufsize=0,
    )
    assert proc.stdin and proc.stdout
    seen = b""
    while b"READY" not in seen:
        seen += os.read(proc.stdout.fileno(), 4096)
    samples = []
    try:
        for i in range(keys + 20):
            key = bytes([97 + i % 26])
            start = time.perf_counter()
            os.write(proc.stdin.fileno(), key)
            got = b""
            while key not in got:
                got += os.read(proc.stdout.fileno(), 4096)
            if i >= 20:  # warm-up keys are not counted
                samples.append((time.perf_counter() - start) * 1000)
    finally:
        proc.kill()
        proc.wait()
    return samples


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--keys", type=int, default=400)
    args = parser.parse_args()
    with sandbox() as sb:
        record = json.loads(sb.devbox("up", "echo", "--no-attach", "--json").stdout)
        known = sb.root / "home/.local/state/devbox/known_hosts"
        agent = ssh_base(sb.key, known, record["port"], alias="echo.devbox")
        with sshd(sb.root, sb.key.with_name("id_ed25519.pub")) as peer:
            openssh = ssh_base(sb.key, peer.known_hosts, peer.port)
            # Interleave rounds so that background noise hits both servers alike.
            peer_ms: list[float] = []
            agent_ms: list[float] = []
            for _ in range(4):
                peer_ms += round_trips(openssh, sb.env, args.keys // 4)
                agent_ms += round_trips(agent, sb.env, args.keys // 4)
    p, a = summary(peer_ms), summary(agent_ms)
    emit(
        {
            "benchmark": "keystroke_echo_ms",
            "keys": len(agent_ms),
            "sshd": p,
            "agent": a,
            "agent_added_p50_ms": a["median"] - p["median"],
            "agent_added_p99_ms": a["p99"] - p["p99"],
            "target_added_p99_ms": 5.0,
        }
    )


if __name__ == "__main__":
    main()
