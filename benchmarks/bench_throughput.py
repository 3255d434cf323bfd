"""Bulk throughput through the devbox agent vs OpenSSH's sshd, same OpenSSH client, loopback:
a command's stdin and stdout, and a TCP stream through `ssh -L` to a sink or source in the box.

Prints JSON: MB/s per direction and path, and the ratio agent/sshd (target >= 0.7).
    python benchmarks/bench_throughput.py [--mib 256] [--repeat 3]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

if not __package__:
    # Run as a file (python benchmarks/bench_x.py, from any folder), Python puts benchmarks/
    # first on the path: the repo's root takes its place, as under `python -m`, for the
    # benchmarks.* and tests.* imports (neither is an installed package).
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from benchmarks.harness import emit, free_port, sandbox, ssh_base, sshd

_CHUNK = 1 << 20


def _timed(argv: list[str], env: dict[str, str], *, stdin: int | None = None) -> float:
    start = time.perf_counter()
    subprocess.run(argv, stdin=stdin, stdout=subprocess.DEVNULL, check=True, env=env)
    return time.perf_counter() - start


def measure(
    base: list[str], mib: int, repeat: int, payload: str, env: dict[str, str]
) -> dict[str, float]:
    size = mib * 1024 * 1024
    up, down = [], []
    for _ in range(repeat):
        with open(payload, "rb") as f:
            up.append(_timed([*base, "cat > /dev/null"], env, stdin=f.fileno()))
        down.append(_timed([*base, f"head -c {size} /dev/zero"], env))
    return {"upload_MBps": mib / min(up), "download_MBps": mib / min(down)}


def _serve(handle: Callable[[socket.socket], None]) -> int:
    """A loopback TCP server in the box running `handle(conn)` per connection; its port."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen()

    def loop() -> None:
        while True:
            conn, _ = srv.accept()
            threading.Thread(target=handle, args=(conn,), daemon=True).start()

    threading.Thread(target=loop, daemon=True).start()
    return int(srv.getsockname()[1])


def _sink(conn: socket.socket) -> None:
    """Reads to EOF, then answers one byte: the upload is through the whole path."""
    with conn:
        while conn.recv(_CHUNK):
            pass
        conn.sendall(b"k")


def _source(size: int) -> Callable[[socket.socket], None]:
    def send(conn: socket.socket) -> None:
        with conn:
            if conn.recv(1):  # a connection that only probes the forward sends nothing
                block = memoryview(os.urandom(_CHUNK))
                for offset in range(0, size, _CHUNK):
                    conn.sendall(block[: min(_CHUNK, size - offset)])

    return send


@contextlib.contextmanager
def _forward(base: list[str], target: int, env: dict[str, str]) -> Iterator[int]:
    """`ssh -N -L PORT:127.0.0.1:target` through `base`, until it is ready; yields PORT."""
    port = free_port()
    argv = [*base[:-1], "-N", "-o", "ExitOnForwardFailure=yes"]
    argv += ["-L", f"{port}:127.0.0.1:{target}", base[-1]]
    proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while True:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port)):
                break
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"ssh -L did not start: {argv}")
            time.sleep(0.05)
        yield port
    finally:
        proc.terminate()
        proc.wait()


def measure_forward(
    base: list[str], mib: int, repeat: int, env: dict[str, str]
) -> dict[str, float]:
    """A TCP stream through `ssh -L` to a sink (upload) and from a source (download)."""
    size = mib * 1024 * 1024
    block = memoryview(os.urandom(_CHUNK))
    sink, source = _serve(_sink), _serve(_source(size))
    up, down = [], []
    with _forward(base, sink, env) as up_port, _forward(base, source, env) as down_port:
        for _ in range(repeat):
            start = time.perf_counter()
            with socket.create_connection(("127.0.0.1", up_port)) as c:
                for offset in range(0, size, _CHUNK):
                    c.sendall(block[: min(_CHUNK, size - offset)])
                c.shutdown(socket.SHUT_WR)
                if c.recv(1) != b"k":
                    raise SystemExit("the upload through ssh -L was cut short")
            up.append(time.perf_counter() - start)
            start = time.perf_counter()
            got = 0
            with socket.create_connection(("127.0.0.1", down_port)) as c:
                c.sendall(b"g")
                while data := c.recv(_CHUNK):
                    got += len(data)
            if got != size:
                raise SystemExit(f"the download through ssh -L brought {got} of {size} bytes")
            down.append(time.perf_counter() - start)
    return {"upload_MBps": mib / min(up), "download_MBps": mib / min(down)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    with sandbox() as sb:
        box = sb.devbox("up", "bench", "--no-attach", "--json")
        record = json.loads(box.stdout)
        payload = str(sb.root / "payload")
        with open(payload, "wb") as f:
            f.write(os.urandom(args.mib * 1024 * 1024))
        known = sb.root / "home/.local/state/devbox/known_hosts"
        agent = ssh_base(sb.key, known, record["port"], alias="bench.devbox")
        sb.devbox("ssh-config", "--write")
        proxied = ["ssh", "-F", str(sb.root / "home/.config/devbox/ssh_config"), "bench.devbox"]
        with sshd(sb.root, sb.key.with_name("id_ed25519.pub")) as peer:
            openssh = ssh_base(sb.key, peer.known_hosts, peer.port)
            results = {
                "sshd": measure(openssh, args.mib, args.repeat, payload, sb.env),
                "agent_direct": measure(agent, args.mib, args.repeat, payload, sb.env),
                "agent_via_proxycommand": measure(proxied, args.mib, args.repeat, payload, sb.env),
            }
            forward = {
                "sshd": measure_forward(openssh, args.mib, args.repeat, sb.env),
                "agent_direct": measure_forward(agent, args.mib, args.repeat, sb.env),
            }
    forward_ratios = {
        f"agent_direct_{d}_ratio": forward["agent_direct"][f"{d}_MBps"]
        / forward["sshd"][f"{d}_MBps"]
        for d in ("upload", "download")
    }
    ratios = {
        f"{path}_{d}_ratio": results[path][f"{d}_MBps"] / results["sshd"][f"{d}_MBps"]
        for path in ("agent_direct", "agent_via_proxycommand")
        for d in ("upload", "download")
    }
    emit(
        {
            "benchmark": "throughput",
            "mib": args.mib,
            "repeat": args.repeat,
            "results": results,
            "ratios_vs_sshd": ratios,
            # A TCP stream through `ssh -L` (VS Code's server connection, a notebook).
            "forward_L": forward,
            "forward_L_ratios_vs_sshd": forward_ratios,
            "target_ratio": 0.7,
        }
    )


if __name__ == "__main__":
    main()
