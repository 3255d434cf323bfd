"""What the Kubernetes benchmarks share: claim to a shell prompt on a terminal (devbox's,
and its peer's: the same requests from a minimal Python client, benchmarks/k8s_raw_claim.py),
devbox's two bytecode modes, download rates through two paths to one agent, and kubectl
port-forward as the peer path."""

from __future__ import annotations

import base64
import contextlib
import fcntl
import io
import json
import os
import pty
import select
import shutil
import socket
import struct
import subprocess
import sys
import termios
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import yaml

from benchmarks.harness import (
    REPO,
    Sandbox,
    bytecode_env,
    devbox_command,
    free_port,
    installed_devbox,
    interleaved,
    machine,
    met,
    ssh_base,
    summary,
)
from devbox import protocol
from devbox.ssh.openssh import KEX_ALGORITHMS


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


def claim_to_shell(
    argv: list[str],
    env: dict[str, str],
    timeout: float = 60,
    *,
    cpu: list[float] | None = None,
    ready_at: list[float] | None = None,
) -> float:
    """Seconds from `devbox up NAME` on a terminal (it attaches in the same process, as a
    user runs it) to a command typed at once having run in the box's shell. `cpu` gets
    the CPU seconds (user + system) the command and its ssh used, to its exit after the
    detach: what the client itself costs, whatever the load; `ready_at` the wall-clock
    time (time.time()) the shell's answer came."""
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
            try:
                seen += os.read(master, 65536)
            except OSError:  # EIO: the command ended, and the terminal with it
                raise SystemExit(f"{argv} ended before its shell: {seen[-800:]!r}") from None
        elapsed = time.perf_counter() - start
        if ready_at is not None:
            ready_at.append(time.time())
        os.write(master, b"\x01d")  # detach screen: the box stays, the client ends
        deadline = time.monotonic() + 30
        while proc.returncode is None and time.monotonic() < deadline:
            # wait4, not wait: its usage counts the command's threads and its ssh.
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                proc.returncode = os.waitstatus_to_exitcode(status)
                if cpu is not None:
                    cpu.append(usage.ru_utime + usage.ru_stime)
            else:
                # Drain the terminal: a client blocked writing to it would never end.
                if select.select([master], [], [], 0.01)[0]:
                    with contextlib.suppress(OSError):
                        os.read(master, 65536)
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


# devbox's start-up in the two ways a user meets it. Each mode has a bytecode folder of its
# own (PYTHONPYCACHEPREFIX), so what other work on this checkout leaves in devbox's
# __pycache__ folders changes neither figure.
CACHED = "bytecode_cached"  # `pip install .`: every module's bytecode is there
COMPILED = "devbox_compiled_each_run"  # PYTHONDONTWRITEBYTECODE=1 in an editable install
INSTALLED = "installed"  # as `pip install .` leaves it: no editable hook, bytecode cached


def bytecode_modes(
    env: dict[str, str],
    root: Path,
    warm_up: Callable[[list[str], dict[str, str]], None],
    *,
    installed: list[str],
    source: Path = REPO,
    prefix: str = "",
) -> dict[str, dict[str, str]]:
    """{prefix + mode: env} for devbox's code in `source` (another checkout: a baseline
    measured in the same rounds); `installed`: the console script of installed_devbox.
    `warm_up(argv, env)` runs the measured command once per mode, writing the bytecode of
    every module it imports; then, for COMPILED, devbox's own (everything under `source`)
    is removed and nothing may be written again: the standard library and the
    dependencies stay compiled, as in any install, devbox's modules are compiled by every
    run."""
    modes = {}
    for mode in (INSTALLED, CACHED, COMPILED):
        folder = root / f"pyc-{prefix}{mode}"
        base = dict(env, PYTHONPATH=str(source))
        made = dict(bytecode_env(base, write=True), PYTHONPYCACHEPREFIX=str(folder))
        warm_up(installed if mode == INSTALLED else devbox_command(), made)
        if mode == COMPILED:
            shutil.rmtree(folder / str(source).lstrip("/"), ignore_errors=True)
            made = dict(bytecode_env(base, write=False), PYTHONPYCACHEPREFIX=str(folder))
        modes[prefix + mode] = made
    return modes


def raw_claim_spec(sb: Sandbox, kubeconfig: Path, namespace: str, *, profile: str) -> Path:
    """The peer's credentials as PEM files and its owner as devbox names it (the API
    server's name for the kubeconfig's user, which devbox cached on its first claim)."""
    doc = yaml.safe_load(kubeconfig.read_text())
    cluster, user = doc["clusters"][0]["cluster"], doc["users"][0]["user"]
    folder = sb.root / "raw"
    folder.mkdir(exist_ok=True)
    for name, data in (
        ("ca.pem", cluster["certificate-authority-data"]),
        ("cert.pem", user["client-certificate-data"]),
        ("key.pem", user["client-key-data"]),
    ):
        (folder / name).write_bytes(base64.b64decode(data))
    (folder / "key.pem").chmod(0o600)
    cached = next((Path(sb.env["HOME"]) / ".local/state/devbox/identity").glob("*.json"))
    owner = json.loads(cached.read_text())["username"]
    server = cluster["server"].removeprefix("https://")
    host, _, port = server.rpartition(":")
    spec = {
        "host": host,
        "port": int(port),
        "ca": str(folder / "ca.pem"),
        "cert": str(folder / "cert.pem"),
        "key": str(folder / "key.pem"),
        "namespace": namespace,
        "profile": profile,
        "owner": owner,
        "owner_label": protocol.owner_label(owner),
        "owner_key": (sb.key.with_suffix(".pub")).read_text().strip(),
        "ssh_key": str(sb.key),
        "kex": KEX_ALGORITHMS,  # what devbox's own ssh runs take: like for like
        "known_hosts": str(folder / "known_hosts"),
        "timeline": str(folder / "switched"),  # NAME and when its port-forward opened
    }
    path = folder / "spec.json"
    path.write_text(json.dumps(spec))
    return path


def raw_claim_command(spec: Path, name: str) -> list[str]:
    """The peer: no site (no .pth files, no editable-install hook), no environment."""
    return [sys.executable, "-S", "-E", str(REPO / "benchmarks/k8s_raw_claim.py"), str(spec), name]


def warm_claims(
    sb: Sandbox,
    modes: dict[str, dict[str, str]],
    raw_spec: Path,
    *,
    profile: list[str],
    tag: str,
    installed: list[str] | None = None,
    cpu: dict[str, list[float]] | None = None,
    session: list[float] | None = None,
) -> dict[str, Callable[[], float]]:
    """One take per way of claiming a warm pod to a shell: devbox in each bytecode mode,
    and the raw peer. Each take first tops the pool up to one ready pod (not timed) and
    releases its box after (not timed either); `cpu` gets each take's client CPU seconds
    by take name, `session` the raw peer's seconds from its port-forward to the shell."""
    count = iter(range(1_000_000))
    cpu = cpu if cpu is not None else {}
    session = session if session is not None else []

    def command_of(mode: str) -> list[str]:
        return installed if installed and mode.endswith(INSTALLED) else devbox_command()

    switched = Path(json.loads(raw_spec.read_text())["timeline"])

    def take(
        mode: str, argv_of: Callable[[str], list[str]], env: dict[str, str]
    ) -> Callable[[], float]:
        def run() -> float:
            name = f"{tag}{next(count)}"
            sb.devbox("pool", "warm", *profile, "--size", "1")  # waits until the pod serves
            ready: list[float] = []
            took = claim_to_shell(argv_of(name), env, cpu=cpu.setdefault(mode, []), ready_at=ready)
            if mode == "raw_peer":
                # The raw peer's session alone: from its port-forward's 101 to the shell's
                # answer (OpenSSH, the agent, screen), which no client-side work shortens.
                at = dict(line.split() for line in switched.read_text().splitlines())
                session.append(ready[0] - float(at[name]))
            sb.devbox("down", name, "--now", check=False)
            return took

        return run

    def up_with(command: list[str]) -> Callable[[str], list[str]]:
        return lambda name: [*command, "up", name, *profile]

    takes = {mode: take(mode, up_with(command_of(mode)), env) for mode, env in modes.items()}
    takes["raw_peer"] = take("raw_peer", lambda n: raw_claim_command(raw_spec, n), sb.env)
    return takes


TARGET_S = 0.25  # issue 22: a warm claim to a shell prompt

# What `devbox up` on a warm pool imports (python -X importtime), in the order it does.
CLAIM_MODULES = (
    "devbox.cli",
    "devbox.commands.boxes",
    "devbox.connect",
    "devbox.backends.kubernetes",
    "devbox.ssh.openssh",
    "devbox.ssh.proxy",
    "devbox.ssh.sshconfig",
)


def start_up(
    modes: dict[str, dict[str, str]], installed: list[str], runs: int
) -> dict[str, dict[str, float]]:
    """The client-side floor's parts, CPU seconds of a process that does only that,
    interleaved: Python without site (the raw peer's start), this venv's Python with site
    (the editable hook's .pth included), the installed venv's, and the claim's imports of
    devbox in each mode."""
    python = sys.executable
    installed_python = str(Path(installed[0]).with_name("python"))
    load = "import " + ", ".join(CLAIM_MODULES)

    def cpu_of(argv: list[str], env: dict[str, str]) -> Callable[[], float]:
        def run() -> float:
            proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL)
            _, status, usage = os.wait4(proc.pid, 0)
            proc.returncode = os.waitstatus_to_exitcode(status)
            assert proc.returncode == 0, argv
            return usage.ru_utime + usage.ru_stime

        return run

    takes = {
        "python_-S": cpu_of([python, "-S", "-E", "-c", "pass"], modes[CACHED]),
        "python_with_site_editable": cpu_of([python, "-c", "pass"], modes[CACHED]),
        "python_with_site_installed": cpu_of([installed_python, "-c", "pass"], modes[INSTALLED]),
    }
    for mode in (INSTALLED, CACHED, COMPILED):
        runner = installed_python if mode == INSTALLED else python
        takes[f"claim_imports_{mode}"] = cpu_of([runner, "-c", load], modes[mode])
    return {name: summary(s) for name, s in interleaved(runs, takes).items()}


def measure(
    sb: Sandbox,
    *,
    kubeconfig: Path,
    kubectl: list[str],
    namespace: str,
    profile: str,
    runs: int,
    mib: int,
    warm_only: bool,
    baseline: Path | None,
) -> dict[str, object]:
    """Both Kubernetes benchmarks' figures for boxes of `profile`: warm claims to a shell
    (devbox installed, cached and compiled, a baseline checkout's alike, the raw peer) and
    cold ones, interleaved round by round; then throughput against kubectl port-forward."""
    chosen = [] if profile == "default" else ["--profile", profile]
    # The namespace's first pod makes the homes claim; the first command caches who the
    # user is (the SelfSubjectReview): neither is part of a claim's cost.
    sb.devbox("up", "warmup", "--no-attach", *chosen)
    sb.devbox("down", "warmup", "--now")
    raw = raw_claim_spec(sb, kubeconfig, namespace, profile=profile)

    def warm_up(argv: list[str], env: dict[str, str]) -> None:
        sb.devbox("pool", "warm", *chosen, "--size", "1")
        claim_to_shell([*argv, "up", "bytecode", *chosen], env)
        sb.devbox("down", "bytecode", "--now")

    installed = installed_devbox(sb.root)
    modes = bytecode_modes(sb.env, sb.root, warm_up, installed=installed)
    if baseline:
        modes |= bytecode_modes(
            sb.env,
            sb.root,
            warm_up,
            installed=installed,
            source=baseline.resolve(),
            prefix="baseline_",
        )
    cpu: dict[str, list[float]] = {}
    session: list[float] = []
    takes = warm_claims(
        sb, modes, raw, profile=chosen, tag="w", installed=installed, cpu=cpu, session=session
    )
    colds = iter(range(1_000_000))

    def cold() -> float:
        # The warm takes before it left the pool empty: this one makes a pod.
        name = f"cold{next(colds)}"
        took = claim_to_shell([*devbox_command(), "up", name, *chosen], modes[CACHED])
        assert not str(sb.box(name)["place"]).startswith("devbox-warm-"), "not a cold claim"
        sb.devbox("down", name, "--now")
        return took

    if not warm_only:
        takes["cold"] = cold
    interleaved(1, takes)  # a first round of each, not counted
    cpu.clear()
    session.clear()
    samples = interleaved(runs, takes)
    result: dict[str, object] = {
        "machine": machine(),
        "runs": runs,
        "claim_to_shell_s": {name: summary(s) for name, s in samples.items()},
        # The claiming process's and its ssh's CPU time, load or not.
        "client_cpu_s": {name: summary(s) for name, s in cpu.items()},
        # Of the raw peer's claim, the part after its port-forward opened: OpenSSH, the
        # agent and the shell's start, the same for every client.
        "raw_peer_session_s": summary(session),
    }
    median = {name: float(summary(s)["median"]) for name, s in samples.items()}
    result["devbox_over_raw_peer"] = {mode: median[mode] / median["raw_peer"] for mode in modes}
    result["start_up_cpu_s"] = start_up(modes, installed, max(runs, 10))
    targets = {
        f"warm_claim_to_shell_{mode}_median_s": met(median[mode], "<=", TARGET_S)
        for mode in (INSTALLED, CACHED, COMPILED)
    }
    if not warm_only:
        result["warm_over_cold"] = median[CACHED] / median["cold"]
        targets["warm_over_cold"] = met(median[CACHED] / median["cold"], "<=", 0.3)
        # Throughput: both paths end at the same agent and use the same OpenSSH client.
        box = json.loads(sb.devbox("up", "tput", "--no-attach", "--json", *chosen).stdout)
        sb.devbox("ssh-config", "--write")
        home = Path(sb.env["HOME"])
        ours = ["ssh", "-F", str(home / ".config/devbox/ssh_config"), "tput.devbox"]
        port = free_port()
        with kubectl_forward(kubectl, namespace, box["place"], port):
            known = home / ".local/state/devbox/known_hosts"
            theirs = ssh_base(sb.key, known, port, alias="tput.devbox")
            devbox_mbps, kubectl_mbps = downloads([ours, theirs], modes[CACHED], mib, 5)
        sb.devbox("down", "tput", "--now")
        result["throughput_MiBps"] = {
            "devbox_port_forward": devbox_mbps,
            "kubectl_port_forward": kubectl_mbps,
        }
        result["throughput_ratio"] = devbox_mbps / kubectl_mbps
        targets["throughput_ratio"] = met(devbox_mbps / kubectl_mbps, ">=", 1.0)
    result["met"] = targets
    return result
