"""`python -m tests.cluster.realnode up|down|status|supervise`: bring the node up and wait
for it to be Ready with its GPUs, take it down leaving the host as it was."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.cluster.realnode import (
    BRIDGE,
    GPUS,
    NODE,
    REPO,
    NodeError,
    Paths,
    alive,
    log,
    read_pid,
    run,
    tail,
)
from tests.cluster.realnode.files import write_files
from tests.cluster.realnode.host import (
    bridge_owner,
    cgroup_dirs,
    iptables_rules,
    network_up,
    restore_iptables,
    sysctls,
)
from tests.cluster.realnode.supervisor import supervise


def apiserver(cluster_dir: Path) -> tuple[str, int]:
    import yaml

    kubeconfig = yaml.safe_load((cluster_dir / "kubeconfig").read_text())
    server = str(kubeconfig["clusters"][0]["cluster"]["server"])
    return server, int(server.rsplit(":", 1)[1])


def kubectl(bin_dir: Path, cluster_dir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return run(
        str(bin_dir / "kubectl"), "--kubeconfig", str(cluster_dir / "kubeconfig"), *args,
        check=False, quiet=True,
    )  # fmt: skip


def build_images(paths: Paths, bin_dir: Path) -> None:
    py = sys.executable
    for what, extra in (("pause", ["--binary", str(bin_dir / "pause")]), ("box", [])):
        out = paths.images / f"{what}.tar"
        done = subprocess.run(
            [py, "-m", "tests.cluster.boximage", what, "--out", str(out), *extra],
            cwd=REPO,
            stdout=subprocess.PIPE,
            text=True,
            check=False,
        )
        if done.returncode != 0:
            raise NodeError(f"building the {what} image failed (see the lines above)")


def up(cluster_dir: Path, bin_dir: Path, *, timeout: float = 300) -> None:
    paths = Paths(cluster_dir)
    t0 = time.monotonic()
    if os.geteuid() != 0:
        raise NodeError("the real test node needs root (containerd, the kubelet, mounts)")
    for tool in ("containerd", "runc", "ctr", "iptables", "ip", "unshare", "mount"):
        if shutil.which(tool) is None:
            raise NodeError(f"{tool} is not installed (scripts/test installs it)")
    if not Path("/usr/lib/cni/bridge").exists():
        raise NodeError("the CNI plugins are missing (Debian: containernetworking-plugins)")
    if is_up(paths):
        log("already up")
        return
    owner = bridge_owner()
    if owner is not None and owner != str(paths.root):
        raise NodeError(f"a real test node of {owner or 'someone else'} holds {BRIDGE}")
    down(cluster_dir, quiet=True)  # whatever a broken earlier `up` left
    paths.root.mkdir(parents=True)
    paths.iptables_before.write_text(json.dumps(iptables_rules()))
    paths.sysctl_before.write_text(json.dumps(sysctls()))
    server, port = apiserver(cluster_dir)
    write_files(paths, server=server)
    build_images(paths, bin_dir)
    for d in cgroup_dirs():
        d.mkdir(exist_ok=True)
        for name in ("cpuset.cpus", "cpuset.mems"):  # a new cpuset starts empty: no CPU
            if (d / name).exists() and not (d / name).read_text().strip():
                (d / name).write_text((d.parent / name).read_text())
    network_up(paths, apiserver_port=port)
    log_file = open(paths.log, "ab")  # noqa: SIM115 (the supervisor keeps it)
    supervisor = subprocess.Popen(
        [
            "unshare", "--mount", "--propagation", "private", "--",
            sys.executable, "-m", "tests.cluster.realnode", "supervise",
            "--cluster-dir", str(cluster_dir), "--bin", str(bin_dir),
        ],
        cwd=REPO,
        stdin=subprocess.DEVNULL,
        stdout=log_file,
        stderr=log_file,
        start_new_session=True,
    )  # fmt: skip
    log_file.close()
    paths.supervisor_pid.write_text(str(supervisor.pid))
    deadline = time.monotonic() + timeout
    while not mount_ns_known(paths, supervisor.pid):
        if supervisor.poll() is not None or time.monotonic() > deadline:
            raise NodeError(f"the node supervisor did not start (see {paths.log})")
        time.sleep(0.05)
    last = ""
    while True:
        if supervisor.poll() is not None:
            raise NodeError(f"the node stopped while starting: {tail(paths.log)}")
        done = kubectl(bin_dir, cluster_dir, "get", "node", NODE, "-o", "json")
        if done.returncode == 0:
            node = json.loads(done.stdout)
            ready = any(
                c["type"] == "Ready" and c["status"] == "True"
                for c in node.get("status", {}).get("conditions", [])
            )
            gpus = node.get("status", {}).get("allocatable", {}).get("nvidia.com/gpu", "0")
            if ready and gpus == str(GPUS):
                break
            last = f"ready={ready}, nvidia.com/gpu={gpus}"
        if time.monotonic() > deadline:
            raise NodeError(
                f"node {NODE} not ready with {GPUS} GPUs within {timeout:g}s "
                f"({last or 'not registered'}); see {paths.root}/kubelet.log"
            )
        time.sleep(0.2)
    paths.ready.write_text("")
    log(f"{NODE} ready with {GPUS} GPUs in {time.monotonic() - t0:.1f}s")


def mount_ns_known(paths: Paths, pid: int) -> bool:
    """Records the supervisor's mount namespace once `unshare` has made it."""
    try:
        ns = os.readlink(f"/proc/{pid}/ns/mnt")
    except OSError:
        return False
    if ns == os.readlink("/proc/self/ns/mnt"):
        return False  # still unshare, before the unshare(2) call
    paths.mount_ns.write_text(ns)
    return True


def is_up(paths: Paths) -> bool:
    pid = read_pid(paths.supervisor_pid)
    return paths.ready.exists() and pid > 0 and alive(pid)


def node_pids(paths: Paths) -> set[int]:
    """Every process of the node: in its cgroups (the containers), in its mount namespace
    (containerd, the kubelet, the plugin, shims), or naming its folder (a leftover)."""
    found: set[int] = set()
    for d in cgroup_dirs():
        if d.is_dir():
            for procs in d.rglob("cgroup.procs"):
                with contextlib.suppress(OSError, ValueError):
                    found.update(int(x) for x in procs.read_text().split())
    ns = ""
    with contextlib.suppress(OSError):
        ns = paths.mount_ns.read_text().strip()
    marker = str(paths.root).encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        with contextlib.suppress(OSError):
            if ns and os.readlink(entry / "ns/mnt") == ns:
                found.add(int(entry.name))
                continue
            if marker in (entry / "cmdline").read_bytes():
                found.add(int(entry.name))
    found.discard(os.getpid())
    return found


def down(cluster_dir: Path, *, bin_dir: Path | None = None, quiet: bool = False) -> None:
    paths = Paths(cluster_dir)
    owner = bridge_owner()
    if not paths.root.exists() and owner != str(paths.root):
        # Not ours: the cgroup root and the bridge are the machine's one real node's,
        # and another cluster's `down` must never touch them.
        if not quiet:
            log(f"no real node of {cluster_dir}")
        return
    if bin_dir is not None and (cluster_dir / "kubeconfig").exists():
        # As a node that is taken out of a cluster: its pods go first, then its Node.
        kubectl(bin_dir, cluster_dir, "delete", "node", NODE, "--wait=false", "--timeout=10s")
    pid = read_pid(paths.supervisor_pid)
    if pid and alive(pid):
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 15
        while alive(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
    for _ in range(100):
        pids = node_pids(paths)
        if not pids:
            break
        for p in pids:
            with contextlib.suppress(OSError):
                os.kill(p, signal.SIGKILL)
        time.sleep(0.1)
    else:
        raise NodeError(f"processes of the node survive SIGKILL: {sorted(node_pids(paths))}")
    for d in cgroup_dirs():
        if d.is_dir():
            # Deepest first: a cgroup goes only once its children have.
            for sub in sorted((p for p in d.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
                with contextlib.suppress(OSError):
                    sub.rmdir()
            with contextlib.suppress(OSError):
                d.rmdir()
    if owner == str(paths.root):
        run("ip", "link", "del", BRIDGE, check=False)
    before = None
    with contextlib.suppress(OSError, ValueError):
        before = json.loads(paths.iptables_before.read_text())
    if before is not None or paths.root.exists():
        restore_iptables(before)
    with contextlib.suppress(OSError, ValueError):
        old = json.loads(paths.sysctl_before.read_text())
        for name, value in sysctls().items():
            if old.get(name) not in (None, value):
                log(f"{name} changed from {old[name]} to {value} while the node ran; restoring")
                Path("/proc/sys", name).write_text(old[name])
    if paths.root.exists():
        shutil.rmtree(paths.root)
    if not quiet:
        log("down")


def status(cluster_dir: Path) -> bool:
    return is_up(Paths(cluster_dir))


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.cluster.realnode")
    parser.add_argument("command", choices=("up", "down", "status", "supervise"))
    parser.add_argument("--cluster-dir", type=Path, required=True)
    parser.add_argument("--bin", type=Path)
    parser.add_argument("--timeout", type=float, default=300)
    args = parser.parse_args()
    cluster_dir = args.cluster_dir.resolve()
    try:
        if args.command == "up":
            if args.bin is None:
                raise NodeError("up needs --bin (the folder tests/cluster/build.sh printed)")
            try:
                up(cluster_dir, args.bin, timeout=args.timeout)
            except BaseException:
                log(f"up failed; the logs are in {Paths(cluster_dir).root} until `down`")
                raise
        elif args.command == "down":
            down(cluster_dir, bin_dir=args.bin)
        elif args.command == "status":
            return 0 if status(cluster_dir) else 1
        else:
            supervise(Paths(cluster_dir), args.bin)
    except NodeError as exc:
        log(f"error: {exc}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
