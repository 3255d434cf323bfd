"""One real node for the test cluster: kubelet + containerd + runc + bridge CNI + a fake GPU
device plugin, on this machine, as root, leaving the host exactly as it was at `down`.

kwok's simulated nodes run nothing; this node runs real containers, so the box image, its
volume mounts, securityContext, PID namespace, the agent's in-cluster credentials and the
kubelet's port-forward are what a real cluster gives.

    python -m tests.cluster.node up --cluster-dir DIR --bin BIN
    python -m tests.cluster.node down --cluster-dir DIR
    python -m tests.cluster.node status --cluster-dir DIR

How it stays off the host (see NOTES.md, "Real node"):
- containerd and the kubelet run in a private mount namespace, where /var/lib, /var/log and
  /run are overlays whose writes land under DIR/node, and the kernel settings the kubelet
  insists on (kernel.panic=10, kernel.panic_on_oops=1, vm.overcommit_memory=1) are files
  bind-mounted over /proc/sys: it reads what it wants and the host keeps its own values.
- Pod cgroups live under one root of our own (/devbox-test-node in each hierarchy).
- The pods' network is a bridge of our own, no gateway out, no masquerade, no forwarding;
  its only route is to the service range, and one DNAT sends the `kubernetes` Service to the
  API server on 127.0.0.1 (route_localnet on that bridge alone; no kube-proxy).
- `down` kills every process of the node (its cgroups, its mount namespace), removes the
  cgroups, the bridge, and every iptables rule and chain that was not there before `up`.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

from tests import nvml_sim

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
REPO = Path(__file__).resolve().parents[2]
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


# --- small helpers ---------------------------------------------------------------------


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


def sysctls() -> dict[str, str]:
    out = {}
    for name in WATCHED_SYSCTLS:
        with contextlib.suppress(OSError):
            out[name] = Path("/proc/sys", name).read_text().strip()
    return out


def cgroup_dirs() -> list[Path]:
    """Our cgroup root in every mounted v1 hierarchy (and v2, where it is unified)."""
    base = Path("/sys/fs/cgroup")
    found = [base / CGROUP_ROOT] if (base / "cgroup.controllers").exists() else []
    for mount in base.iterdir() if base.is_dir() else []:
        if mount.is_dir() and not mount.is_symlink() and (mount / "cgroup.procs").exists():
            found.append(mount / CGROUP_ROOT)
    return found


# --- iptables: remember what was there, remove only what was not ------------------------

TABLES = ("filter", "nat", "mangle", "raw")


def iptables_rules() -> dict[str, dict[str, list[str]]]:
    """`-S` of every table for IPv4 and IPv6 (missing tools or tables: empty)."""
    rules: dict[str, dict[str, list[str]]] = {}
    for tool in ("iptables", "ip6tables"):
        rules[tool] = {}
        for table in TABLES:
            if shutil.which(tool) is None:
                continue
            done = run(tool, "-w", "-t", table, "-S", check=False, quiet=True)
            rules[tool][table] = done.stdout.splitlines() if done.returncode == 0 else []
    return rules


def restore_iptables(before: dict[str, dict[str, list[str]]] | None) -> None:
    """Delete the rules and chains added since `before` (the kubelet's canaries and
    KUBE-FIREWALL, our DNAT). Without a record: every KUBE-* and our own chain."""
    now = iptables_rules()
    for tool, tables in now.items():
        for table, lines in tables.items():
            old = set(((before or {}).get(tool) or {}).get(table) or [])

            def added(line: str, old: set[str] = old) -> bool:
                if before is not None:
                    return line not in old
                words = line.split()
                return any(w.startswith(("KUBE-", CHAIN)) for w in words)

            for line in lines:
                if line.startswith("-A ") and added(line):
                    run(tool, "-w", "-t", table, "-D", *shlex.split(line)[1:], check=False)
            for line in lines:
                if line.startswith("-N ") and added(line):
                    chain = line.split()[1]
                    run(tool, "-w", "-t", table, "-F", chain, check=False)
            for line in lines:
                if line.startswith("-N ") and added(line):
                    run(tool, "-w", "-t", table, "-X", line.split()[1], check=False)


# --- configuration files ----------------------------------------------------------------


def write_files(paths: Paths, *, server: str) -> None:
    root = paths.root
    for d in (paths.kubelet_dir, paths.cni_conf, paths.gpus, paths.images, root / "cni/ipam"):
        d.mkdir(parents=True, exist_ok=True)
    for name in OVERLAID.values():
        for part in ("upper", "work"):
            (root / "overlay" / name / part).mkdir(parents=True, exist_ok=True)
    paths.containerd_config.write_text(
        f"""version = 2
root = "{root}/containerd/root"
state = "{root}/containerd/state"
disabled_plugins = [
  "io.containerd.snapshotter.v1.aufs", "io.containerd.snapshotter.v1.btrfs",
  "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.zfs",
  "io.containerd.tracing.processor.v1.otlp", "io.containerd.internal.v1.tracing",
]
[grpc]
  address = "{paths.containerd_sock}"
[plugins."io.containerd.internal.v1.opt"]
  path = "{root}/containerd/opt"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{PAUSE_IMAGE}"
  netns_mounts_under_state_dir = true
  # These machines withhold CAP_SYS_RESOURCE, so no process may lower its OOM score below
  # ours; without this runc fails to start every sandbox (it asks for -998).
  restrict_oom_score_adj = true
  stream_server_address = "127.0.0.1"
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "{paths.cni_conf}"
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
"""
    )
    conflist = {
        "cniVersion": "1.0.0",
        "name": "devbox-test-node",
        "plugins": [
            {
                "type": "bridge",
                "bridge": BRIDGE,
                # The bridge already has its address (we gave it): the plugin must neither
                # make it a gateway out nor turn on IP forwarding or masquerading.
                "isGateway": False,
                "ipMasq": False,
                "hairpinMode": False,
                "ipam": {
                    "type": "host-local",
                    "ranges": [
                        [
                            {
                                "subnet": f"{SUBNET}.0/24",
                                "rangeStart": f"{SUBNET}.10",
                                "gateway": NODE_IP,
                            }
                        ]
                    ],
                    # Only the service range goes to the node: nothing leaves the machine.
                    "routes": [{"dst": SERVICE_RANGE}],
                    "dataDir": str(root / "cni/ipam"),
                },
            }
        ],
    }
    (paths.cni_conf / "10-devbox-test-node.conflist").write_text(json.dumps(conflist, indent=1))
    kubelet = {
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "kind": "KubeletConfiguration",
        "address": NODE_IP,
        "port": 10250,
        "readOnlyPort": 0,
        "healthzPort": 0,
        # The API server proves itself with its client certificate (kwokctl's admin cert,
        # given to it as --kubelet-client-certificate); anonymous requests get nothing.
        "authentication": {
            "anonymous": {"enabled": False},
            "webhook": {"enabled": True},
            "x509": {"clientCAFile": str(paths.pki / "ca.crt")},
        },
        "authorization": {"mode": "Webhook"},
        "containerRuntimeEndpoint": f"unix://{paths.containerd_sock}",
        # These hosts are cgroup v1 (hybrid), without systemd as init and without swap.
        "cgroupDriver": "cgroupfs",
        "cgroupRoot": f"/{CGROUP_ROOT}",
        "failCgroupV1": False,
        "failSwapOn": False,
        "protectKernelDefaults": True,
        "registerWithTaints": [{"key": TAINT_KEY, "value": "true", "effect": "NoSchedule"}],
        # A CI machine's disk may be fuller than a node's would be: evict only when it is
        # truly out, and never collect the images we imported (there is no registry).
        "evictionHard": {
            "memory.available": "50Mi",
            "nodefs.available": "1%",
            "imagefs.available": "1%",
            "nodefs.inodesFree": "1%",
        },
        "imageGCHighThresholdPercent": 100,
        "imageGCLowThresholdPercent": 99,
        "serializeImagePulls": False,
        "resolvConf": "",
        "clusterDomain": "cluster.local",
        "maxPods": 50,
        "nodeStatusUpdateFrequency": "4s",
        "syncFrequency": "10s",
    }
    import yaml  # here, not at the top: `down` runs with any python3

    paths.kubelet_config.write_text(yaml.safe_dump(kubelet))
    write_node_kubeconfig(paths, server=server)
    nvml_sim.build(paths.nvml)


def write_node_kubeconfig(paths: Paths, *, server: str) -> None:
    """The kubelet's own identity, system:node:NAME in system:nodes, so the Node
    authorizer and NodeRestriction hold it to its own node, as in a real cluster."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    with warnings.catch_warnings():
        # kwokctl's CA has a negative serial number, which cryptography only warns about.
        warnings.simplefilter("ignore")
        ca_cert = x509.load_pem_x509_certificate((paths.pki / "ca.crt").read_bytes())
    ca_key = serialization.load_pem_private_key((paths.pki / "ca.key").read_bytes(), None)
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(
            x509.Name(
                [
                    x509.NameAttribute(NameOID.ORGANIZATION_NAME, "system:nodes"),
                    x509.NameAttribute(NameOID.COMMON_NAME, f"system:node:{NODE}"),
                ]
            )
        )
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=30))
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
        .sign(ca_key, hashes.SHA256())  # type: ignore[arg-type]
    )
    pem = serialization.Encoding.PEM
    (paths.root / "kubelet.crt").write_bytes(cert.public_bytes(pem))
    key_file = paths.root / "kubelet.key"
    key_file.write_bytes(
        key.private_bytes(
            pem, serialization.PrivateFormat.TraditionalOpenSSL, serialization.NoEncryption()
        )
    )
    key_file.chmod(0o600)
    kubeconfig = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": "test",
                "cluster": {"server": server, "certificate-authority": str(paths.pki / "ca.crt")},
            }
        ],
        "users": [
            {
                "name": NODE,
                "user": {
                    "client-certificate": str(paths.root / "kubelet.crt"),
                    "client-key": str(key_file),
                },
            }
        ],
        "contexts": [{"name": "test", "context": {"cluster": "test", "user": NODE}}],
        "current-context": "test",
    }
    import yaml

    paths.kubelet_kubeconfig.write_text(yaml.safe_dump(kubeconfig))
    paths.kubelet_kubeconfig.chmod(0o600)


# --- network ----------------------------------------------------------------------------


def bridge_owner() -> str | None:
    """The node folder that owns the bridge (kept in its alias), or None without one."""
    done = run("ip", "-d", "-j", "link", "show", BRIDGE, check=False, quiet=True)
    if done.returncode != 0:
        return None
    links = json.loads(done.stdout or "[]")
    return str(links[0].get("ifalias", "")) if links else ""


def network_up(paths: Paths, *, apiserver_port: int) -> None:
    run("ip", "link", "add", BRIDGE, "type", "bridge")
    run("ip", "link", "set", BRIDGE, "alias", str(paths.root))
    run("ip", "addr", "add", f"{NODE_IP}/24", "dev", BRIDGE)
    run("ip", "link", "set", BRIDGE, "up")
    # DNAT to 127.0.0.1 needs route_localnet: on this bridge only, and it goes with it.
    Path(f"/proc/sys/net/ipv4/conf/{BRIDGE}/route_localnet").write_text("1")
    run("iptables", "-w", "-t", "nat", "-N", CHAIN)
    run("iptables", "-w", "-t", "nat", "-A", "PREROUTING", "-i", BRIDGE, "-j", CHAIN)
    run(
        "iptables", "-w", "-t", "nat", "-A", CHAIN, "-d", f"{SERVICE_IP}/32", "-p", "tcp",
        "--dport", "443", "-j", "DNAT", "--to-destination", f"127.0.0.1:{apiserver_port}",
    )  # fmt: skip
    # Pods may reach the host only through that DNAT: not the kubelet, not whatever else
    # listens on the host's other addresses. (The API server reaches the kubelet from the
    # host itself, which does not come in through the bridge.)
    run("iptables", "-w", "-N", CHAIN)
    run("iptables", "-w", "-A", "INPUT", "-i", BRIDGE, "-j", CHAIN)
    run("iptables", "-w", "-A", CHAIN, "-m", "conntrack", "--ctstate", "DNAT", "-j", "RETURN")
    run("iptables", "-w", "-A", CHAIN, "-j", "DROP")


# --- the supervisor, inside the private mount namespace ----------------------------------


def supervise(paths: Paths, bin_dir: Path) -> None:
    """Mount the overlays, start containerd (and import the images), the kubelet and the
    GPU plugin; stop them on SIGTERM. Runs as PID of its own mount namespace's leader."""
    root = paths.root
    for target, name in OVERLAID.items():
        upper, work = root / "overlay" / name / "upper", root / "overlay" / name / "work"
        run(
            "mount", "-n", "-t", "overlay", "overlay", "-o",
            f"lowerdir={target},upperdir={upper},workdir={work}", target,
        )  # fmt: skip
    for name, value in KERNEL_DEFAULTS.items():
        stand_in = root / "sysctl" / name.replace("/", ".")
        stand_in.parent.mkdir(parents=True, exist_ok=True)
        stand_in.write_text(value + "\n")
        run("mount", "-n", "--bind", str(stand_in), f"/proc/sys/{name}")
    Path("/var/lib/kubelet/device-plugins").mkdir(parents=True, exist_ok=True)
    children: dict[str, subprocess.Popen[bytes]] = {}

    def start(name: str, argv: list[str]) -> None:
        out = open(root / f"{name}.log", "ab")  # noqa: SIM115 (the child keeps it)
        children[name] = subprocess.Popen(argv, stdout=out, stderr=out, stdin=subprocess.DEVNULL)
        out.close()

    stopping: list[int] = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(1))
    signal.signal(signal.SIGINT, lambda *_: stopping.append(1))
    start("containerd", ["containerd", "--config", str(paths.containerd_config)])
    deadline = time.monotonic() + 60
    while ctr(paths, "version", check=False, quiet=True).returncode != 0:
        if time.monotonic() > deadline or children["containerd"].poll() is not None:
            raise NodeError(f"containerd did not start (see {root / 'containerd.log'})")
        time.sleep(0.1)
    for image in sorted(paths.images.glob("*.tar")):
        ctr(paths, "images", "import", str(image))
    paths.imported.write_text("")
    start(
        "kubelet",
        [
            str(bin_dir / "kubelet"),
            f"--config={paths.kubelet_config}",
            f"--kubeconfig={paths.kubelet_kubeconfig}",
            f"--root-dir={paths.kubelet_dir}",
            f"--cert-dir={paths.kubelet_dir / 'pki'}",
            f"--hostname-override={NODE}",
            f"--node-ip={NODE_IP}",
            f"--node-labels={LABEL},nvidia.com/gpu.present=true",
            "--v=1",
        ],
    )
    start(
        "gpuplugin",
        [
            str(bin_dir / "gpuplugin"),
            f"-gpus={GPUS}",
            f"-nvml-lib={paths.nvml}",
            f"-state={paths.gpus}",
            "-uuid-prefix=real",
        ],
    )
    while not stopping:
        for name, child in children.items():
            if child.poll() is not None:
                log(f"{name} exited with status {child.returncode}; stopping the node")
                stopping.append(1)
                break
        time.sleep(0.2)
    for name in ("gpuplugin", "kubelet", "containerd"):
        child = children[name]
        if child.poll() is None:
            child.terminate()
            try:
                child.wait(timeout=10)
            except subprocess.TimeoutExpired:
                child.kill()


def ctr(
    paths: Paths, *args: str, check: bool = True, quiet: bool = False
) -> subprocess.CompletedProcess[str]:
    sock = str(paths.containerd_sock)
    return run("ctr", "--address", sock, "-n", "k8s.io", *args, check=check, quiet=quiet)


# --- up / down ---------------------------------------------------------------------------


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
            sys.executable, "-m", "tests.cluster.node", "supervise",
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


def tail(path: Path) -> str:
    with contextlib.suppress(OSError):
        lines = path.read_text(errors="replace").strip().splitlines()
        return lines[-1] if lines else ""
    return ""


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
    parser = argparse.ArgumentParser(prog="python -m tests.cluster.node")
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
