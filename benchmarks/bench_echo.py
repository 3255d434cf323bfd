"""Keystroke echo round trip through the devbox agent vs OpenSSH's sshd.

The same OpenSSH client (`ssh -tt`, a remote PTY in raw mode running `cat`) sends one byte
at a time and waits for it to come back. Only the round trips count (after the session is
up); the peer's sessions run as a throwaway user with an empty home; rounds alternate
between the servers. `--load N` starts N busy processes for the whole run (a box whose
user trains on its CPUs), and the load they reached is printed.

Prints p50/p99 per server, the agent's added p99 and a `met` block (added p99 < 5 ms).
    python benchmarks/bench_echo.py [--keys 400] [--rounds 4] [--load N]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

if not __package__:
    # Run as a file (python benchmarks/bench_x.py, from any folder), Python puts benchmarks/
    # first on the path: the repo's root takes its place, as under `python -m`, for the
    # benchmarks.* and tests.* imports (neither is an installed package).
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from benchmarks.harness import emit, machine, met, sandbox, ssh_base, summary
from benchmarks.sshpeer import sshd_peer

REMOTE = "stty raw -echo; echo READY; exec cat"
TARGET_ADDED_P99_MS = 5.0
WARMUP = 20  # keys per round not counted


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
        for i in range(keys + WARMUP):
            key = bytes([97 + i % 26])
            start = time.perf_counter()
            os.write(proc.stdin.fileno(), key)
            got = b""
            while key not in got:
                got += os.read(proc.stdout.fileno(), 4096)
            if i >= WARMUP:
                samples.append((time.perf_counter() - start) * 1000)
    finally:
        proc.kill()
        proc.wait()
    return samples


def _running() -> int:
    """Runnable tasks now (/proc/loadavg's fourth field), the instant the 1-minute load lags."""
    with open("/proc/loadavg") as f:
        return int(f.read().split()[3].split("/")[0])


@contextlib.contextmanager
def busy(n: int) -> Iterator[None]:
    """`n` processes spinning on the CPU, at the default priority, until the block ends."""
    procs = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"], stdin=subprocess.DEVNULL)
        for _ in range(n)
    ]
    try:
        yield
    finally:
        for proc in procs:
            proc.kill()
        for proc in procs:
            proc.wait()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--keys", type=int, default=400, help="counted keys per server")
    parser.add_argument("--rounds", type=int, default=4, help="alternations between servers")
    parser.add_argument("--load", type=int, default=0, help="busy processes during the run")
    args = parser.parse_args()
    per_round = max(1, args.keys // args.rounds)
    before = machine()
    running: list[int] = []
    with sandbox() as sb:
        record = json.loads(sb.devbox("up", "echo", "--no-attach", "--json").stdout)
        known = sb.root / "home/.local/state/devbox/known_hosts"
        agent = ssh_base(sb.key, known, record["port"], alias="echo.devbox")
        with sshd_peer(sb.key.with_name("id_ed25519.pub")) as peer, busy(args.load):
            openssh = peer.base(sb.key)
            peer_ms: list[float] = []
            agent_ms: list[float] = []
            for _ in range(args.rounds):
                running.append(_running())
                peer_ms += round_trips(openssh, sb.env, per_round)
                agent_ms += round_trips(agent, sb.env, per_round)
            during = machine()
    p, a = summary(peer_ms), summary(agent_ms)
    added_p99 = a["p99"] - p["p99"]
    emit(
        {
            "benchmark": "keystroke_echo_ms",
            "keys": len(agent_ms),
            "busy_processes": args.load,
            "machine_before": before,
            "machine_at_end_of_load": during,
            "runnable_tasks_per_round": running,
            "peer": {"user": peer.user, "home_empty": peer.home_empty},
            "sshd": p,
            "agent": a,
            "agent_added_p50_ms": a["median"] - p["median"],
            "agent_added_p99_ms": added_p99,
            "target_added_p99_ms": TARGET_ADDED_P99_MS,
            "met": {"agent_added_p99_ms": met(added_p99, "<=", TARGET_ADDED_P99_MS)},
        }
    )


if __name__ == "__main__":
    main()
