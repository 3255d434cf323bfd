"""One real node for the test cluster: kubelet + containerd + runc + bridge CNI + a fake GPU
device plugin, on this machine, as root, leaving the host exactly as it was at `down`.

kwok's simulated nodes run nothing; this node runs real containers, so the box image, its
volume mounts, securityContext, PID namespace, the agent's in-cluster credentials and the
kubelet's port-forward are what a real cluster gives.

    python -m tests.cluster.realnode up --cluster-dir DIR --bin BIN
    python -m tests.cluster.realnode down --cluster-dir DIR [--bin BIN]
    python -m tests.cluster.realnode status --cluster-dir DIR

How it stays off the host (see NOTES.md, "The real node"):
- containerd and the kubelet run in a private mount namespace (supervisor.py), where
  /var/lib, /var/log and /run are overlays whose writes land under DIR/node, and the kernel
  settings the kubelet insists on (kernel.panic=10, kernel.panic_on_oops=1,
  vm.overcommit_memory=1) are files bind-mounted over /proc/sys: it reads what it wants and
  the host keeps its own values.
- Pod cgroups live under one root of our own (/devbox-test-node in each hierarchy).
- The pods' network is a bridge of our own, no gateway out, no masquerade, no forwarding;
  its only route is to the service range, and one DNAT sends the `kubernetes` Service to the
  API server on 127.0.0.1 (route_localnet on that bridge alone; no kube-proxy) (host.py).
- `down` kills every process of the node (its cgroups, its mount namespace), removes the
  cgroups, the bridge, and every iptables rule and chain that was not there before `up`.

This module holds what the others share: the node's constants, its folder and the small
process helpers. files.py writes the configuration, host.py touches the host, supervisor.py
runs inside the namespace, __main__.py is up/down/status.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
from pathlib import Path

NODE = "devbox-real-node"
BRIDGE = "dbxnode0"
SUBNET = "10.254.213"  # .0/24: the pods; .1 is the bridge, the node's address
NODE_IP = f"{SUBNET}.1"
SERVICE_RANGE = "10.0.0.0/24"  # the API server's default; its first address is `kubernetes`
SERVICE_IP = "10.0.0.1"
CGROUP_ROOT = "devbox-test-node"
GPUS = 8
LABEL = "devbox-test/node=real"
TAINT_KEY = "devbox-test/real-node"
CHAIN = "DEVBOX-TEST-NODE"
BOX_IMAGE = "devbox/box:test"
PAUSE_IMAGE = "devbox.local/pause:test"
REPO = Path(__file__).resolve().parents[3]
# What the kubelet wants of the kernel (it refuses to start otherwise, with
# protectKernelDefaults) and so finds in files bind-mounted over these.
KERNEL_DEFAULTS = {
    "vm/overcommit_memory": "1",
    "vm/panic_on_oom": "0",
    "kernel/panic": "10",
    "kernel/panic_on_oops": "1",
    "kernel/keys/root_maxkeys": "1000000",
    "kernel/keys/root_maxbytes": "25000000",
}
# Host settings `down` checks are unchanged (and says so loudly if one is not).
WATCHED_SYSCTLS = (
    *KERNEL_DEFAULTS,
    "net/ipv4/ip_forward",
    "net/ipv6/conf/all/forwarding",
    "net/bridge/bridge-nf-call-iptables",
)
# /run first: mount(8) itself writes there. (And -n everywhere: no utab.)
OVERLAID = {"/run": "run", "/var/lib": "varlib", "/var/log": "varlog"}


def log(message: str) -> None:
    print(f"test-node: {message}", file=sys.stderr, flush=True)


class NodeError(Exception):
    pass


class Paths:
    def __init__(self, cluster_dir: Path) -> None:
        self.cluster = cluster_dir
        self.root = cluster_dir / "node"
        self.supervisor_pid = self.root / "supervisor.pid"
        self.mount_ns = self.root / "mount-ns"
        self.log = self.root / "node.log"
        self.containerd_config = self.root / "containerd.toml"
        self.containerd_sock = self.root / "containerd.sock"
        self.kubelet_config = self.root / "kubelet.yaml"
        self.kubelet_kubeconfig = self.root / "kubelet.kubeconfig"
        self.kubelet_dir = self.root / "kubelet"
        self.cni_conf = self.root / "cni/net.d"
        self.gpus = self.root / "gpus"
        self.nvml = self.root / "nvml"
        self.images = self.root / "images"
        self.imported = self.root / ".images-imported"
        self.iptables_before = self.root / "iptables-before.json"
        self.sysctl_before = self.root / "sysctl-before.json"
        self.ready = self.root / ".ready"

    @property
    def pki(self) -> Path:
        return self.cluster / "kwok/clusters/devbox/pki"


def run(*argv: str, check: bool = True, quiet: bool = False) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    if check and done.returncode != 0:
        raise NodeError(f"{' '.join(argv)}: {(done.stderr or done.stdout).strip()[-500:]}")
    if not quiet and done.returncode != 0:
        log(f"{' '.join(argv)} failed: {done.stderr.strip()[-200:]}")
    return done


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def read_pid(path: Path) -> int:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return 0


def tail(path: Path) -> str:
    with contextlib.suppress(OSError):
        lines = path.read_text(errors="replace").strip().splitlines()
        return lines[-1] if lines else ""
    return ""
