"""What the Kubernetes benchmarks share: claim to a shell prompt on a terminal, download
rates through two paths to one agent, and kubectl port-forward as the peer path."""

from __future__ import annotations

import contextlib
import fcntl
import io
import os
import pty
import select
import socket
import struct
import subprocess
import termios
import time
from collections.abc import Iterator
from pathlib import Path

from benchmarks.harness import REPO, Sandbox


def cluster_bin() -> Path:
    """The folder of the test cluster's binaries (built and cached by tests/cluster/build.sh)."""
    out = subprocess.run(
        [str(REPO / "tests/cluster/build.sh")], capture_output=True, text=True, check=True
    )
    return Path(out.stdout.split()[-1])


def downloads(paths: list[list[str]], env: dict[str, str], mib: int, repeat: int) -> list[float]:
    """MiB/s of the best of `repeat` downloads per path, the paths taking turns so that
    the machine's drift (other work on it) falls on both alike."""
    best = [0.0] * len(paths)
    for _ in range(repeat):
        for i, base in enumerate(paths):
            best[i] = max(best[i], transfer_rate([*base, f"head -c {mib << 20} /dev/zero"], env))
    return best


def transfer_rate(argv: list[str], env: dict[str, str]) -> float:
    """MiB/s from the first byte to the last: the transfer, not the connection's set-up,
    which differs between the paths for reasons other than throughput (each `ssh
    NAME.devbox` starts its ProxyCommand; kubectl port-forward was started once, before)."""
    proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE)
    # A buffered reader (bufsize's default), typed as a plain IO: read1 returns what came.
    out = proc.stdout
    assert isinstance(out, io.BufferedReader)
    first = out.read1(1 << 20)
    start, got = time.perf_counter(), 0
    while chunk := out.read1(1 << 20):
        got += len(chunk)
    elapsed = time.perf_counter() - start
    assert proc.wait() == 0 and first, f"download failed: {argv}"
    return got / elapsed / (1 << 20)


def claim_to_shell(argv: list[str], env: dict[str, str], timeout: float = 60) -> float:
    """Seconds from `devbox up NAME` on a terminal (it attaches in the same process, as a
    user runs it) to a command typed at once having run in the box's shell."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    start = time.perf_counter()
    proc = subprocess.Popen(argv, env=env, stdin=slave, stdout=slave, stderr=slave)
    os.close(slave)
    # Typed ahead, as a user does: the client keeps what waits in the terminal.
    os.write(master, b"echo READY-$((6*7))\r")
    seen = b""
    try:
        while b"READY-42" not in seen:
            ready, _, _ = select.select([master], [], [], timeout)
            if not ready:
                raise SystemExit(f"no shell after {timeout} s: {seen[-500:]!r}")
            seen += os.read(master, 65536)
        elapsed = time.perf_counter() - start
        os.write(master, b"\x01d")  # detach screen: the box stays, the client ends
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        with contextlib.suppress(OSError):
            while select.select([master], [], [], 0)[0] and os.read(master, 65536):
                pass
        os.close(master)
    return elapsed


@contextlib.contextmanager
def kubectl_forward(kubectl: list[str], namespace: str, pod: str, port: int) -> Iterator[None]:
    """`kubectl port-forward pod/POD PORT:2222`, until it accepts connections."""
    forward = subprocess.Popen(
        [*kubectl, "port-forward", "-n", namespace, f"pod/{pod}", f"{port}:2222"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port)):
                break
            assert time.monotonic() < deadline, "kubectl port-forward did not start"
            time.sleep(0.1)
        yield
    finally:
        forward.terminate()
        forward.wait()


def configure_kube_user(
    sb: Sandbox, kubeconfig: Path, namespace: str, *, image: str, extra: str = ""
) -> None:
    """Points the sandbox's devbox at the test cluster's namespace (homes on the
    simulated storage class), with `extra` appended to its config.toml."""
    sb.env.update(KUBECONFIG=str(kubeconfig), DEVBOX_BACKEND="kubernetes")
    cfg = Path(sb.env["HOME"]) / ".config/devbox/config.toml"
    cfg.parent.mkdir(parents=True, exist_ok=True)
    cfg.write_text(
        f'namespace = "{namespace}"\nhome_storage_class = "devbox-sim"\n'
        f'image = "{image}"\nstart_timeout = 300\n{extra}'
    )
