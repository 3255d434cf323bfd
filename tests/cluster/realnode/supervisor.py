"""The real node's processes, run inside its private mount namespace: mount the overlays
and the kernel settings' stand-ins, start containerd (and import the images), the kubelet
and the GPU plugin, and stop them on SIGTERM."""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

from tests.cluster.realnode import (
    GPUS,
    KERNEL_DEFAULTS,
    LABEL,
    NODE,
    NODE_IP,
    OVERLAID,
    NodeError,
    Paths,
    log,
    run,
)


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
