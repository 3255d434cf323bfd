"""Bulk throughput through the devbox agent vs OpenSSH's sshd, same OpenSSH client, loopback:
a command's stdin and stdout, and a TCP stream through `ssh -L` to a sink or source in the box.

Like for like: only the transfer is timed, inside one connection (from the remote command's
first byte, or the forwarded connection's, to the last), so neither connection set-up nor
the peer's per-connection costs (sshd re-executing itself, the key exchange) count; the
peer's sessions run as a throwaway user with an empty home (no ~/.bashrc); and every take
is interleaved with its peer's and repeated, with the load printed. Two modes:
  same_kex  the client is told the key exchange it negotiates with the agent, for both;
  defaults  the client as users run it: each server's own choice.
The ciphers each server negotiates are printed (a server's offer is part of its speed).

Beside MB/s, the CPU time each server's processes (the agent; sshd's per-connection
processes) and the OpenSSH client spend per MiB of a command's transfer: on a loaded 2-core
machine the throughput is mostly a share of the CPU, and CPU time is what stays put.

Prints JSON with a `met` block: download and upload >= 1.0x sshd (median of per-round ratios).
    python benchmarks/bench_throughput.py [--mib 256] [--repeat 5]
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import functools
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil

if not __package__:
    # Run as a file (python benchmarks/bench_x.py, from any folder), Python puts benchmarks/
    # first on the path: the repo's root takes its place, as under `python -m`, for the
    # benchmarks.* and tests.* imports (neither is an installed package).
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from benchmarks.harness import (
    emit,
    free_port,
    interleaved,
    machine,
    met,
    sandbox,
    ssh_base,
    summary,
)
from benchmarks.sshpeer import negotiated, sshd_peer

_CHUNK = 1 << 20
_BLOCK = memoryview(os.urandom(_CHUNK))  # what uploads send, over and over
TARGET = 1.0
AGENT_LOCK = "home/.local/state/devbox/local/boxes/bench/agent.lock"  # in the sandbox
F_SETPIPE_SZ = getattr(fcntl, "F_SETPIPE_SZ", 1031)


def _wide(fd: int) -> None:
    """A 1 MiB pipe: the benchmark's own reads are no narrower for one server than the other."""
    with contextlib.suppress(OSError):
        fcntl.fcntl(fd, F_SETPIPE_SZ, _CHUNK)


def _send(write: Callable[[memoryview], int], size: int) -> None:
    left = size
    while left:
        left -= write(_BLOCK[: min(_CHUNK, left)])


def _finish(proc: subprocess.Popen[bytes], argv: list[str]) -> None:
    err = proc.stderr.read() if proc.stderr else b""
    if proc.wait() != 0:
        raise SystemExit(f"{argv} exited {proc.returncode}: {err.decode()[-500:]}")


def exec_download(
    base: list[str], env: dict[str, str], size: int, meter: Meter | None = None
) -> float:
    """Seconds from the command's first byte to its last: `size` bytes on its stdout."""
    argv = [*base, f"printf R; exec head -c {size} /dev/zero"]
    proc = subprocess.Popen(
        argv, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    assert proc.stdout
    fd = proc.stdout.fileno()
    _wide(fd)
    got = len(os.read(fd, _CHUNK)) - 1  # blocks until the command runs
    if meter:
        meter.start(proc.pid)
    start = time.perf_counter()
    while chunk := os.read(fd, _CHUNK):
        got += len(chunk)
    took = time.perf_counter() - start
    if meter:
        meter.stop()
    _finish(proc, argv)
    if got != size:
        raise SystemExit(f"download brought {got} of {size} bytes: {argv}")
    return took


def exec_upload(
    base: list[str], env: dict[str, str], size: int, meter: Meter | None = None
) -> float:
    """Seconds from the command's start to its word that it read `size` bytes to EOF."""
    argv = [*base, "printf R; cat >/dev/null; printf D"]
    proc = subprocess.Popen(
        argv, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    assert proc.stdin and proc.stdout
    _wide(proc.stdin.fileno())
    if os.read(proc.stdout.fileno(), 1) != b"R":
        raise SystemExit(f"{argv} did not start")
    if meter:
        meter.start(proc.pid)
    start = time.perf_counter()
    _send(lambda view: os.write(proc.stdin.fileno(), view), size)  # type: ignore[union-attr]
    proc.stdin.close()
    done = os.read(proc.stdout.fileno(), 1)
    took = time.perf_counter() - start
    if meter:
        meter.stop()
    _finish(proc, argv)
    if done != b"D":
        raise SystemExit(f"the upload was cut short: {argv}")
    return took


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
    """Says it is there, reads to EOF, then answers one byte: the upload went all the way."""
    with conn:
        conn.sendall(b"r")
        while conn.recv(_CHUNK):
            pass
        conn.sendall(b"k")


def _source(size: int) -> Callable[[socket.socket], None]:
    def send(conn: socket.socket) -> None:
        with conn:
            if conn.recv(1):  # a connection that only probes the forward sends nothing
                _send(conn.send, size)

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


def forward_upload(port: int, size: int) -> float:
    """Seconds from the sink's hello through the forward to its word that all arrived."""
    with socket.create_connection(("127.0.0.1", port)) as c:
        if c.recv(1) != b"r":
            raise SystemExit("the sink through ssh -L did not answer")
        start = time.perf_counter()
        _send(c.send, size)
        c.shutdown(socket.SHUT_WR)
        if c.recv(1) != b"k":
            raise SystemExit("the upload through ssh -L was cut short")
        return time.perf_counter() - start


def forward_download(port: int, size: int) -> float:
    """Seconds from the source's first byte through the forward to its last."""
    with socket.create_connection(("127.0.0.1", port)) as c:
        c.sendall(b"g")
        got = len(c.recv(_CHUNK))
        start = time.perf_counter()
        while data := c.recv(_CHUNK):
            got += len(data)
        took = time.perf_counter() - start
    if got != size:
        raise SystemExit(f"the download through ssh -L brought {got} of {size} bytes")
    return took


class Meter:
    """CPU seconds a server's processes (a process and its descendants) and the OpenSSH
    client spend from start() to stop(): the transfer alone, not the connection's set-up.
    The tree is sampled every 10 ms from a thread, so a descendant that ends between two
    samples loses its last few ms, mostly its teardown; /proc counts in 10 ms ticks. Both
    are about 1% of a transfer of a second (256 MiB), and far more of a tiny one."""

    def __init__(self, server_pid: int) -> None:
        self._root = psutil.Process(server_pid)
        self._first: dict[int, float] = {}
        self._last: dict[int, float] = {}
        self._client: psutil.Process | None = None
        self._client_first = self.client_seconds = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @staticmethod
    def _used(proc: psutil.Process) -> float:
        times = proc.cpu_times()
        return float(times.user + times.system)

    def _sample(self, *, at_start: bool = False) -> None:
        with contextlib.suppress(psutil.Error):
            for proc in [self._root, *self._root.children(recursive=True)]:
                with contextlib.suppress(psutil.Error):
                    used = self._used(proc)
                    # What ran before start() does not count; a process started since, whole.
                    self._first.setdefault(proc.pid, used if at_start else 0.0)
                    self._last[proc.pid] = used

    def _run(self) -> None:
        while not self._stop.wait(0.01):
            self._sample()

    def start(self, client_pid: int) -> None:
        self._client = psutil.Process(client_pid)
        self._client_first = self._used(self._client)
        self._sample(at_start=True)
        self._thread.start()

    def stop(self) -> None:
        """Before the client is reaped (a zombie still has its times)."""
        self._stop.set()
        self._thread.join()
        self._sample()
        assert self._client is not None
        self.client_seconds = self._used(self._client) - self._client_first

    @property
    def server_seconds(self) -> float:
        return sum(self._last[pid] - first for pid, first in self._first.items())


Take = Callable[[Meter | None], float]


def _with_cpu(
    take: Take, server_pid: int, mib: int, cpu: dict[str, list[float]]
) -> Callable[[], float]:
    """`take`, noting the server's and the OpenSSH client's CPU ms per MiB in `cpu`."""

    def run() -> float:
        meter = Meter(server_pid)
        took = take(meter)
        cpu["server"].append(meter.server_seconds * 1000 / mib)
        cpu["client"].append(meter.client_seconds * 1000 / mib)
        return took

    return run


def _kex(base: list[str], kex: str | None) -> list[str]:
    return base if kex is None else [*base[:-1], "-o", f"KexAlgorithms={kex}", base[-1]]


def _cpu_figures(cpu: dict[str, dict[str, list[float]]]) -> dict[str, object]:
    return {
        name: {f"{side}_cpu_ms_per_MiB": round(statistics.median(v), 2) for side, v in c.items()}
        for name, c in cpu.items()
    }


def _figures(samples: dict[str, list[float]], mib: int, pairs: list[str]) -> dict[str, object]:
    """MB/s per take, and per pair the median of the per-round ratios agent/sshd."""
    out: dict[str, object] = {}
    for name, s in samples.items():
        seconds = summary(s)
        out[name] = {
            "median_MBps": round(mib / seconds["median"], 1),
            "best_MBps": round(mib / seconds["min"], 1),
            "worst_MBps": round(mib / max(s), 1),
            "n": len(s),
        }
    for pair in pairs:  # "exec_download" -> agent_exec_download over sshd_exec_download
        ratios = [
            peer / ours
            for ours, peer in zip(samples[f"agent_{pair}"], samples[f"sshd_{pair}"], strict=True)
        ]
        out[f"{pair}_ratio"] = round(statistics.median(ratios), 3)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    size = args.mib * 1024 * 1024
    before = machine()
    sink, source = _serve(_sink), _serve(_source(size))
    with sandbox() as sb:
        record = json.loads(sb.devbox("up", "bench", "--no-attach", "--json").stdout)
        known = sb.root / "home/.local/state/devbox/known_hosts"
        agent = ssh_base(sb.key, known, record["port"], alias="bench.devbox")
        sb.devbox("ssh-config", "--write")
        proxied = ["ssh", "-F", str(sb.root / "home/.config/devbox/ssh_config"), "bench.devbox"]
        agent_pid = int((sb.root / AGENT_LOCK).read_text())
        with sshd_peer(sb.key.with_name("id_ed25519.pub")) as peer:
            sshd = peer.base(sb.key)
            agent_kex = negotiated(agent, sb.env).kex
            modes: dict[str, dict[str, object]] = {}
            for mode, kex in (("same_kex", agent_kex), ("defaults", None)):
                a, p = _kex(agent, kex), _kex(sshd, kex)
                algs = {"agent": negotiated(a, sb.env), "sshd": negotiated(p, sb.env)}
                with (
                    _forward(a, sink, sb.env) as a_up,
                    _forward(a, source, sb.env) as a_down,
                    _forward(p, sink, sb.env) as p_up,
                    _forward(p, source, sb.env) as p_down,
                ):
                    pids = {"sshd": peer.pid, "agent": agent_pid}
                    bases = {"sshd": p, "agent": a}
                    directions = {"download": exec_download, "upload": exec_upload}
                    execs: dict[str, Take] = {
                        f"{server}_exec_{d}": functools.partial(fn, bases[server], sb.env, size)
                        for d, fn in directions.items()
                        for server in bases
                    }
                    cpu: dict[str, dict[str, list[float]]] = {
                        name: {"server": [], "client": []} for name in execs
                    }
                    takes: dict[str, Callable[[], float]] = {
                        name: _with_cpu(take, pids[name.split("_")[0]], args.mib, cpu[name])
                        for name, take in execs.items()
                    }
                    takes |= {
                        "sshd_forward_download": lambda: forward_download(p_down, size),
                        "agent_forward_download": lambda: forward_download(a_down, size),
                        "sshd_forward_upload": lambda: forward_upload(p_up, size),
                        "agent_forward_upload": lambda: forward_upload(a_up, size),
                    }
                    if mode == "defaults":  # what `ssh NAME.devbox` does: devbox proxy between
                        takes["proxied_exec_download"] = lambda: exec_download(
                            proxied, sb.env, size
                        )
                        takes["proxied_exec_upload"] = lambda: exec_upload(proxied, sb.env, size)
                    samples = interleaved(args.repeat, takes)
                pairs = ["exec_download", "exec_upload", "forward_download", "forward_upload"]
                modes[mode] = {
                    "negotiated": {k: vars(v) for k, v in algs.items()},
                    **_figures(samples, args.mib, pairs),
                    "cpu_of_exec_takes": _cpu_figures(cpu),
                }
                if mode == "defaults":
                    for d in ("download", "upload"):
                        ratios = [
                            peer_s / ours
                            for ours, peer_s in zip(
                                samples[f"proxied_exec_{d}"], samples[f"sshd_exec_{d}"], strict=True
                            )
                        ]
                        modes[mode][f"proxied_exec_{d}_ratio"] = round(statistics.median(ratios), 3)
    judged = {
        f"{mode}_{pair}": met(float(modes[mode][f"{pair}_ratio"]), ">=", TARGET)  # type: ignore[arg-type]
        for mode in modes
        for pair in ("exec_download", "exec_upload", "forward_download", "forward_upload")
    }
    defaults = modes["defaults"]
    emit(
        {
            "benchmark": "throughput",
            "what": "transfer only, inside one connection; MB/s and agent/sshd ratios",
            "mib": args.mib,
            "repeat": args.repeat,
            "peer": {"user": peer.user, "home_empty": peer.home_empty},
            "machine_before": before,
            "machine_after": machine(),
            "modes": modes,
            # The four figures earlier runs of this benchmark printed (now transfer only).
            "ratios_vs_sshd": {
                "agent_direct_upload_ratio": defaults["exec_upload_ratio"],
                "agent_direct_download_ratio": defaults["exec_download_ratio"],
                "agent_via_proxycommand_upload_ratio": defaults["proxied_exec_upload_ratio"],
                "agent_via_proxycommand_download_ratio": defaults["proxied_exec_download_ratio"],
            },
            "met": judged,
        }
    )


if __name__ == "__main__":
    main()
