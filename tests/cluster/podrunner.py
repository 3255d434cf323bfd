"""Plays kubelet-and-container-runtime for kwok's simulated nodes, for devbox pods only
(pods on the real node, tests/cluster/realnode/, have a real kubelet).

kwok marks pods Running but runs nothing. For each Running devbox pod this starts a real
local `devbox agent` with the pod's identity (it talks to the API server exactly as in a
pod), points a kwok PortForward at it so that the API server's port-forward to the pod
reaches it, gives it simulated GPUs (the NVML simulator, as many as the pod requested) and
its home volume (a folder standing for the PersistentVolume). It stops the agent when the
pod goes. It is also the provisioner of the `devbox-sim` StorageClass: a pending claim of
that class gets a hostPath PersistentVolume made for it.

    python -m tests.cluster.podrunner --kubeconfig K --data-dir D
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kubernetes import client, config, watch
from kubernetes.client.exceptions import ApiException

from tests import nvml_sim

log = logging.getLogger("podrunner")
REPO = Path(__file__).resolve().parents[2]
STORAGE_CLASS = "devbox-sim"
# Pods labelled devbox.io/no-agent get no agent: benchmarks/bench_autoscaler.py makes a
# thousand box pods, and a thousand real agents would not fit on the machine.
SELECTOR = "app.kubernetes.io/managed-by=devbox,!devbox.io/no-agent"
SSH_PORT = 2222
REAL_NODE = "devbox-test/node=real"  # tests/cluster/realnode/'s kubelet labels its node so
# The longest a change waits for a pass when no pod event announces it (an agent that
# died, a volume to bind): pod events wake the runner at once.
IDLE = 1.0


@dataclass
class Agent:
    proc: subprocess.Popen[bytes]
    port: int
    uid: str
    folder: Path


class Runner:
    def __init__(self, kubeconfig: str, data: Path) -> None:
        config.load_kube_config(config_file=kubeconfig)
        self.kubeconfig = kubeconfig
        self.core = client.CoreV1Api()
        self.custom = client.CustomObjectsApi()
        self.data = data
        self.agents: dict[tuple[str, str], Agent] = {}
        # Agents told to stop: each with when its grace ends and whether its pod is being
        # deleted (then deleted for good once the agent is gone).
        self.ending: dict[tuple[str, str], tuple[Agent, float, bool]] = {}
        self.resource_version = ""
        self.nvml_dir = data / "nvml"
        nvml_sim.build(self.nvml_dir)
        # Unix sockets (screen, tmux) need short paths.
        self.short = Path("/tmp/dbxr") / hashlib.sha1(str(data).encode()).hexdigest()[:6]

    # --- storage ----------------------------------------------------------------------

    def provision(self) -> None:
        for pvc in self.core.list_persistent_volume_claim_for_all_namespaces().items:
            if pvc.spec.storage_class_name != STORAGE_CLASS or pvc.status.phase != "Pending":
                continue
            ns, name = pvc.metadata.namespace, pvc.metadata.name
            pv_name = f"sim-{ns}-{name}"[:63]
            path = self.data / "volumes" / pv_name
            path.mkdir(parents=True, exist_ok=True)
            path.chmod(0o777)
            body = {
                "apiVersion": "v1",
                "kind": "PersistentVolume",
                "metadata": {"name": pv_name, "labels": {"devbox.io/sim": "true"}},
                "spec": {
                    "capacity": {"storage": pvc.spec.resources.requests["storage"]},
                    "accessModes": pvc.spec.access_modes,
                    "storageClassName": STORAGE_CLASS,
                    "persistentVolumeReclaimPolicy": "Retain",
                    "hostPath": {"path": str(path)},
                    "claimRef": {"namespace": ns, "name": name, "uid": pvc.metadata.uid},
                },
            }
            try:
                self.core.create_persistent_volume(body)
                log.info("provisioned %s for %s/%s", pv_name, ns, name)
            except ApiException as exc:
                if exc.status != 409:
                    raise

    def _home_root(self, pod: Any) -> Path | None:
        for volume in pod.spec.volumes or []:
            if volume.name == "homes" and volume.persistent_volume_claim:
                pvc = self.core.read_namespaced_persistent_volume_claim(
                    volume.persistent_volume_claim.claim_name, pod.metadata.namespace
                )
                if not pvc.spec.volume_name:
                    return None
                pv = self.core.read_persistent_volume(pvc.spec.volume_name)
                return Path(pv.spec.host_path.path) if pv.spec.host_path else None
        return None

    # --- agents -----------------------------------------------------------------------

    def start(self, pod: Any) -> None:
        ns, name = pod.metadata.namespace, pod.metadata.name
        home_root = self._home_root(pod)
        if home_root is None:
            return  # its volume is not bound yet; next round
        gpus = 0
        for c in pod.spec.containers:
            gpus += int(
                ((c.resources.limits or {}) if c.resources else {}).get("nvidia.com/gpu", 0)
            )
        key = hashlib.sha1(f"{ns}/{name}/{pod.metadata.uid}".encode()).hexdigest()[:8]
        folder = self.short / key
        folder.mkdir(parents=True, exist_ok=True)
        screens = folder / "s"
        screens.mkdir(mode=0o700, exist_ok=True)
        nvml_sim.write_gpus(folder / "gpus", gpus)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("STY", "TMUX"))}
        env.update(
            DEVBOX_NVML_SIM=str(folder / "gpus"),
            LD_LIBRARY_PATH=str(self.nvml_dir),
            SCREENDIR=str(screens),
            TMUX_TMPDIR=str(folder),
            TMPDIR=str(folder),  # the probe socket's folder too: all of it goes with the pod
            PYTHONPATH=str(REPO),
            POD_NAME=name,
            POD_NAMESPACE=ns,
        )
        log_file = open(folder / "agent.log", "ab")  # noqa: SIM115 (the agent keeps it)
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "devbox",
                "agent",
                "--pod",
                name,
                "--namespace",
                ns,
                "--kubeconfig",
                self.kubeconfig,
                "--listen",
                "127.0.0.1",
                "--port",
                "0",
                "--home-root",
                str(home_root),
                "--host-key",
                str(folder / "host_key"),
                # This "pod" shares the test machine's PID namespace: show its own
                # processes only, as a real pod's namespace would.
                "--processes",
                "box",
            ],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=log_file,
            cwd=folder,
            start_new_session=True,
        )
        log_file.close()
        assert proc.stdout is not None
        line = proc.stdout.readline()
        proc.stdout.close()
        try:
            frame = json.loads(line)
            port = int(frame["port"])
        except (ValueError, KeyError):
            log.error("agent for %s/%s did not start: %r", ns, name, line)
            proc.kill()
            return
        self.agents[(ns, name)] = Agent(proc, port, pod.metadata.uid, folder)
        self._forward(ns, name, port)
        log.info("started agent for %s/%s on port %d (%d GPUs)", ns, name, port, gpus)

    def _forward(self, ns: str, name: str, port: int) -> None:
        body = {
            "apiVersion": "kwok.x-k8s.io/v1alpha1",
            "kind": "PortForward",
            "metadata": {"name": name, "namespace": ns},
            "spec": {
                "forwards": [
                    {"ports": [SSH_PORT], "target": {"address": "127.0.0.1", "port": port}}
                ]
            },
        }
        with contextlib.suppress(ApiException):
            self.custom.delete_namespaced_custom_object(
                "kwok.x-k8s.io", "v1alpha1", ns, "portforwards", name
            )
        self.custom.create_namespaced_custom_object(
            "kwok.x-k8s.io", "v1alpha1", ns, "portforwards", body
        )

    def begin_stop(self, key: tuple[str, str], *, grace: float, deleted: bool = False) -> None:
        """SIGTERM the agent, as a kubelet does its container, and give it `grace` seconds
        (the deletion's grace period, in which it asks its probed processes to save);
        `finish_stops` sees it end. Never waited for here: other pods' agents go on."""
        agent = self.agents.pop(key)
        agent.proc.terminate()
        self.ending[key] = (agent, time.monotonic() + grace, deleted)

    def finish_stops(self) -> None:
        """Agents that ended (or whose grace is over: killed) are cleaned up, and their
        pod is deleted for good, as a kubelet does once the containers are gone: kwok
        alone would wait a random part of the grace period."""
        for key, (agent, deadline, deleted) in list(self.ending.items()):
            if agent.proc.poll() is None:
                if time.monotonic() < deadline:
                    continue
                agent.proc.kill()
                agent.proc.wait()
            del self.ending[key]
            self._cleanup(key, agent)
            if not deleted:  # an agent that died in a live pod: the next pass restarts it
                continue
            with contextlib.suppress(ApiException):  # gone already, or another pod now
                self.core.delete_namespaced_pod(
                    key[1],
                    key[0],
                    grace_period_seconds=0,
                    body=client.V1DeleteOptions(
                        grace_period_seconds=0, preconditions=client.V1Preconditions(uid=agent.uid)
                    ),
                )

    def stop(self, key: tuple[str, str]) -> None:
        self.begin_stop(key, grace=15)
        agent, _, _ = self.ending[key]
        try:
            agent.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            agent.proc.kill()
            agent.proc.wait()
        del self.ending[key]
        self._cleanup(key, agent)

    def _cleanup(self, key: tuple[str, str], agent: Agent) -> None:
        # Unless a new pod of the name has its own agent (and port-forward) by now.
        if key not in self.agents:
            with contextlib.suppress(ApiException):
                self.custom.delete_namespaced_custom_object(
                    "kwok.x-k8s.io", "v1alpha1", key[0], "portforwards", key[1]
                )
        _end_sessions(agent.folder)
        shutil.rmtree(agent.folder, ignore_errors=True)
        log.info("stopped agent for %s/%s", *key)

    def sync(self) -> None:
        self.provision()
        listed = self.core.list_pod_for_all_namespaces(label_selector=SELECTOR)
        self.resource_version = listed.metadata.resource_version
        pods = listed.items
        # The real node's kubelet runs its own pods' containers: not ours to play.
        real = {n.metadata.name for n in self.core.list_node(label_selector=REAL_NODE).items}
        live, deleting = {}, {}
        for pod in pods:
            key = (pod.metadata.namespace, pod.metadata.name)
            if pod.spec.node_name in real:
                continue
            if pod.metadata.deletion_timestamp:
                deleting[key] = (pod.metadata.uid, pod.metadata.deletion_grace_period_seconds)
                continue
            if pod.status.phase != "Running":
                continue
            live[key] = pod.metadata.uid
        for key in list(self.agents):
            agent = self.agents[key]
            uid, grace = deleting.get(key, ("", None))
            if uid == agent.uid and agent.proc.poll() is None:
                # A pod's graceful deletion: the agent gets the grace, then the pod goes.
                self.begin_stop(key, grace=float(grace or 0), deleted=True)
            elif live.get(key) != agent.uid or agent.proc.poll() is not None:
                self.begin_stop(key, grace=15)
        self.finish_stops()
        for key in live:
            if key not in self.agents:
                pod = next(p for p in pods if (p.metadata.namespace, p.metadata.name) == key)
                try:
                    self.start(pod)
                except Exception:
                    log.exception("starting the agent for %s/%s failed", *key)

    def wait_for_change(self) -> None:
        """Until a devbox pod changes after the last pass's list, or IDLE seconds. A watch:
        polling as often as the tests need (every 0.1 s) took a third of a CPU."""
        stream = watch.Watch().stream(
            self.core.list_pod_for_all_namespaces,
            label_selector=SELECTOR,
            resource_version=self.resource_version,
            timeout_seconds=int(IDLE),
            _request_timeout=IDLE + 5,
        )
        try:
            next(stream, None)
        except Exception as exc:  # 410 Gone, a restarting API server: the next pass lists
            log.debug("pod watch ended: %s", exc)
        finally:
            stream.close()

    def run(self) -> None:
        stopping = []
        signal.signal(signal.SIGTERM, lambda *_: stopping.append(1))
        while not stopping:
            try:
                self.sync()
            except Exception as exc:  # API server restarting, say: keep going
                log.warning("sync failed: %s", exc)
                time.sleep(1)
                continue
            self.wait_for_change()
        for key in list(self.agents):
            self.stop(key)
        for key, (agent, _, _) in list(self.ending.items()):
            agent.proc.kill()
            agent.proc.wait()
            self._cleanup(key, agent)
        shutil.rmtree(self.short, ignore_errors=True)


def _end_sessions(folder: Path) -> None:
    """A deleted pod's processes all die with its container; here the screen and tmux
    servers the box started have detached from the agent, so end them by their sockets."""
    for sock in (folder / "s").glob("*.*"):  # screen names its socket PID.NAME
        with contextlib.suppress(ValueError, OSError):
            os.kill(int(sock.name.split(".", 1)[0]), signal.SIGKILL)
    for sock in folder.glob("tmux-*/*"):
        subprocess.run(["tmux", "-S", str(sock), "kill-server"], capture_output=True, check=False)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--kubeconfig", required=True)
    parser.add_argument("--data-dir", required=True, type=Path)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    args.data_dir.mkdir(parents=True, exist_ok=True)
    Runner(args.kubeconfig, args.data_dir.resolve()).run()


if __name__ == "__main__":
    main()
