"""Shared set-up for benchmarks: a throwaway devbox user with a local box, the OpenSSH client
aimed at it, and the conventions every figure follows (OpenSSH's sshd as the peer lives in
sshpeer.py). Everything runs on 127.0.0.1 and is torn down at exit."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from devbox import protocol

REPO = Path(__file__).resolve().parents[1]


def devbox_command() -> list[str]:
    """The installed console script when there is one (what users run), else `python -m`."""
    script = Path(sys.executable).with_name("devbox")
    return [str(script)] if script.exists() else [sys.executable, "-m", "devbox"]


def installed_devbox(root: Path) -> list[str]:
    """A `devbox` console script as `pip install .` writes one, in a venv of its own whose
    only .pth puts this venv's site-packages (the dependencies) on the path: no editable
    hook (setuptools' finder, 10-25 ms of every start here), devbox from PYTHONPATH."""
    venv = root / "installed"
    base = (
        Path(sys.base_prefix) / "bin" / f"python{sys.version_info.major}.{sys.version_info.minor}"
    )
    subprocess.run([str(base), "-m", "venv", "--without-pip", str(venv)], check=True)
    packages = next(p for p in map(Path, sys.path) if p.name == "site-packages")
    lib = next((venv / "lib").glob("python3*")) / "site-packages"
    (lib / "devbox-dependencies.pth").write_text(f"{packages}\n")
    script = venv / "bin/devbox"
    script.write_text(
        f"#!{venv}/bin/python\nimport sys\nfrom devbox.cli import main\nsys.exit(main())\n"
    )
    script.chmod(0o755)
    return [str(script)]


@dataclass
class Sandbox:
    root: Path
    env: dict[str, str]

    def devbox(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[bytes]:
        return subprocess.run(
            [*devbox_command(), *args],
            env=self.env,
            capture_output=True,
            stdin=subprocess.DEVNULL,
            check=check,
        )

    @property
    def key(self) -> Path:
        return self.root / "home/.config/devbox/id_ed25519"

    def box(self, name: str) -> dict[str, object]:
        rows = json.loads(self.devbox("ls", "--json").stdout)
        return next(b for b in rows if b["name"] == name)


@contextlib.contextmanager
def sandbox() -> Iterator[Sandbox]:
    root = Path(tempfile.mkdtemp(prefix="devbox-bench-"))
    (root / "home").mkdir()
    screens = root / "s"
    screens.mkdir(mode=0o700)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XDG_", "DEVBOX_", "STY"))}
    env.update(
        HOME=str(root / "home"),
        SCREENDIR=str(screens),
        TMUX_TMPDIR=str(root),
        # Its own GPU lock namespace: a sandbox never competes with real boxes' GPUs.
        DEVBOX_GPU_NAMESPACE=f"devbox-bench-{root.name}",
        PYTHONPATH=str(REPO),
    )
    box = Sandbox(root, env)
    try:
        yield box
    finally:
        for folder in (root / "home/.local/state/devbox/local/boxes").glob("*"):
            with contextlib.suppress(OSError, ValueError):
                os.kill(int((folder / "agent.lock").read_text()), signal.SIGTERM)
        time.sleep(0.3)
        shutil.rmtree(root, ignore_errors=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def ssh_base(key: Path, known_hosts: Path, port: int, alias: str | None = None) -> list[str]:
    """The OpenSSH client aimed at 127.0.0.1:port, the same options for every server."""
    opts = [
        "ssh",
        "-F",
        "/dev/null",
        "-i",
        str(key),
        "-o",
        "IdentitiesOnly=yes",
        "-o",
        f"UserKnownHostsFile={known_hosts}",
        "-o",
        "StrictHostKeyChecking=yes",
        "-o",
        "BatchMode=yes",
        "-p",
        str(port),
    ]
    if alias:
        opts += ["-o", f"HostKeyAlias={alias}"]
    return [*opts, "127.0.0.1"]


def wall(argv: list[str], env: dict[str, str], *, status: int = 0) -> float:
    """Seconds one command takes, its output discarded; it must exit with `status`."""
    start = time.perf_counter()
    done = subprocess.run(
        argv, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    took = time.perf_counter() - start
    if done.returncode != status:
        raise SystemExit(f"{argv} exited {done.returncode}: {done.stderr.decode()[-500:]}")
    return took


def summary(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
    return {"median": statistics.median(ordered), "p99": p99, "min": ordered[0], "n": len(ordered)}


def emit(result: dict[str, object]) -> None:
    print(json.dumps(result, indent=1))


# How every benchmark compares like with like on a noisy 2-core machine: each figure is
# taken in turn with its peer's (interleaved, so a burst of load lands on both), repeated,
# with the machine's load and the bytecode mode printed beside it, and each target judged in
# a `met` block. Ratios, never seconds, are what carries from one machine to another.


def interleaved(runs: int, takes: dict[str, Callable[[], float]]) -> dict[str, list[float]]:
    """`runs` rounds of every take in turn (a, b, c, a, b, c, ...): the samples of each."""
    samples: dict[str, list[float]] = {name: [] for name in takes}
    for _ in range(runs):
        for name, take in takes.items():
            samples[name].append(take())
    return samples


def machine() -> dict[str, object]:
    """What the numbers were taken under: the load, the cores, whether Python may write
    bytecode (PYTHONDONTWRITEBYTECODE in an editable install means every devbox command
    compiles its modules anew) and the interpreter."""
    return {
        "loadavg_1m": round(os.getloadavg()[0], 2),
        "cpus": os.cpu_count(),
        "PYTHONDONTWRITEBYTECODE": bool(os.environ.get("PYTHONDONTWRITEBYTECODE")),
        "python": sys.version.split()[0],
    }


def met(value: float, op: str, target: float) -> dict[str, object]:
    """One target judged: {"value", "op", "target", "met"}; op is "<=" or ">="."""
    ok = value <= target if op == "<=" else value >= target
    return {"value": round(value, 4), "op": op, "target": target, "met": ok}


def bytecode_cached() -> bool:
    """Whether devbox's CLI module has its compiled bytecode next to it (or in site-packages),
    which decides most of a command's start-up when Python may not write it."""
    import importlib.util

    import devbox.cli

    return Path(importlib.util.cache_from_source(devbox.cli.__file__)).exists()


@contextlib.contextmanager
def uncompiled_source() -> Iterator[Path]:
    """A copy of devbox's packages without one compiled file: with PYTHONPATH at it and
    PYTHONDONTWRITEBYTECODE=1, every process compiles devbox's modules, as every command
    of an editable install does where that variable is set (however much bytecode the
    working tree has by now)."""
    root = Path(tempfile.mkdtemp(prefix="devbox-src-"))
    try:
        for package in ("devbox", "agent", "tui"):
            shutil.copytree(
                REPO / package, root / package, ignore=shutil.ignore_patterns("__pycache__")
            )
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


# How devbox is started in the CLI benchmarks, each its own figure:
MODES = {
    "bytecode": "this checkout's editable install, its bytecode written",
    "no_bytecode": "an uncompiled copy, PYTHONDONTWRITEBYTECODE=1: compiled by every process",
    "installed": "as `pip install .` leaves it (installed_devbox): no editable hook",
}
MODE_CHOICES = {
    "all": ("no_bytecode", "bytecode", "installed"),
    "both": ("no_bytecode", "bytecode"),
    "bytecode": ("bytecode",),
    "no-bytecode": ("no_bytecode",),
    "installed": ("installed",),
}


def mode_setup(
    mode: str, sb: Sandbox, source: Path, uncompiled: Path
) -> tuple[bool, Path, list[str]]:
    """For one of MODES: whether bytecode may be written, the tree on PYTHONPATH, and the
    devbox command (the agent and its helpers run under that command's Python)."""
    if mode == "no_bytecode":
        return False, uncompiled, devbox_command()
    if mode == "installed":
        return True, source, installed_devbox(sb.root)
    return True, source, devbox_command()


def bytecode_env(env: dict[str, str], *, write: bool) -> dict[str, str]:
    """`env` with Python allowed to write bytecode (write=True: what a `pip install .` user
    has, once the first run cached it) or told not to (PYTHONDONTWRITEBYTECODE=1)."""
    out = dict(env)
    out.pop("PYTHONDONTWRITEBYTECODE", None)
    if not write:
        out["PYTHONDONTWRITEBYTECODE"] = "1"
    return out


@contextlib.contextmanager
def probe_sink() -> Iterator[str]:
    """A stand-in for the agent's hub: says somebody watches, reads and drops every frame."""
    folder = tempfile.mkdtemp(prefix="dbx-bench-")
    path = os.path.join(folder, "probe.sock")
    server = socket.socket(socket.AF_UNIX)
    server.bind(path)
    server.listen()
    stop = threading.Event()

    def serve() -> None:
        server.settimeout(0.2)
        conns: list[socket.socket] = []
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                conn, _ = server.accept()
                conn.sendall(protocol.encode(protocol.PROBE_CONTROL, watching=True))
                conns.append(conn)
                threading.Thread(target=_drain, args=(conn,), daemon=True).start()
        for conn in conns:
            conn.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield path
    finally:
        stop.set()
        thread.join()
        server.close()
        shutil.rmtree(folder, ignore_errors=True)


def _drain(conn: socket.socket) -> None:
    with contextlib.suppress(OSError):
        while conn.recv(1 << 16):
            pass


def wait_connected(watcher: Any) -> None:
    deadline = time.monotonic() + 10
    while not (watcher.link.connected and watcher.watching):
        if time.monotonic() > deadline:
            raise SystemExit("the probe did not connect to the benchmark's sink")
        time.sleep(0.01)
