"""Boxes on the test cluster's real node (tests/cluster/realnode/): a real kubelet, containerd
and runc run the box image, mount the home volume, apply the pod's securityContext in a
PID namespace of its own, plug in simulated GPUs through a device plugin, and carry
`devbox ssh` over the kubelet's port-forward. The agent holds only the service account of
images/k8s/agent-rbac.yaml. What kwok's simulated nodes cannot show is shown here."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agent.owner import owner_uid
from devbox.protocol import home_folder, owner_label
from tests import nvml_sim
from tests.conftest import REPO, make_user
from tests.k8s.conftest import (
    CLUSTER_DIR,
    LAB,
    Cluster,
    KubeUser,
    configure,
    identity_kubeconfig,
    lab_namespace,
    new_namespace,
    token_kubeconfig,
)
from tests.waiting import wait_until

NODE = "devbox-real-node"


# Profiles for the real node: small (it has 2 CPUs), placed there, tolerating its taint.
def _real_profile(name: str, gpus: int) -> str:
    return (
        f'[profiles.{name}]\ngpus = {gpus}\ncpu = "100m"\nmemory = "256Mi"\n'
        'node_selector = { "devbox-test/node" = "real" }\n'
        'tolerations = [{ key = "devbox-test/real-node", operator = "Exists", '
        'effect = "NoSchedule" }]\n'
    )


PROFILES = "\n" + "\n".join(
    _real_profile(name, gpus) for name, gpus in (("real", 0), ("real-gpus", 2), ("real-all", 8))
)


@pytest.fixture(scope="session")
def real_node(cluster: Cluster) -> Path:
    """The shared cluster with its real node (`scripts/test-cluster up --real-node`; a
    no-op when it is up already, as scripts/test starts it). Returns the node's folder."""
    up = subprocess.run(
        [str(REPO / "scripts/test-cluster"), "up", "--real-node"],
        capture_output=True,
        text=True,
        timeout=1800,
        check=False,
    )
    assert up.returncode == 0, f"the real test node did not come up:\n{up.stderr[-3000:]}"
    return CLUSTER_DIR / "node"


def _real_user(cluster: Cluster, folder: Path, nvml_lib_dir: Path, *, ns: str = "") -> KubeUser:
    ns = ns or new_namespace(cluster)
    user = make_user(folder, nvml_lib_dir)
    configure(user, ns, cluster.kubeconfig)
    config = user.home / ".config/devbox/config.toml"
    text = config.read_text().replace("start_timeout = 120", "start_timeout = 300")
    config.write_text(text + "save_timeout = 40\n")
    with config.open("a") as f:
        f.write(PROFILES)
    return KubeUser(user, ns, cluster)


@pytest.fixture
def rk(real_node: Path, cluster: Cluster, tmp_path: Path, nvml_lib_dir: Path) -> Iterator[KubeUser]:
    made = _real_user(cluster, tmp_path / "r", nvml_lib_dir)
    yield made
    cluster.kubectl_run("delete", "namespace", made.namespace, "--wait=false")
    made.user.stop_all()


def _pod(kube: KubeUser, pod: str) -> dict[str, Any] | None:
    got = kube.cluster.kubectl_run("get", "pod", pod, "-n", kube.namespace, "-o", "json")
    return json.loads(got.stdout) if got.returncode == 0 else None


def _up(kube: KubeUser, name: str, *extra: str) -> dict[str, Any]:
    done = kube.devbox("up", name, "--no-attach", "--json", *extra, timeout=360)
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    box: dict[str, Any] = json.loads(done.stdout)
    pod = _pod(kube, box["place"])
    assert pod is not None and pod["spec"]["nodeName"] == NODE, "not on the real node"
    return box


def _in_box(kube: KubeUser, name: str, script: str) -> str:
    done = kube.devbox("ssh", name, "--", script, timeout=120)
    assert done.returncode == 0, (script, done.stderr.decode()[-2000:])
    return done.stdout.decode()


def _container_pids(pod_uid: str) -> set[int]:
    """Host PIDs of every process of the pod: its cgroups, under the node's cgroup root."""
    pids: set[int] = set()
    for procs in Path("/sys/fs/cgroup/pids/devbox-test-node").rglob("cgroup.procs"):
        if f"pod{pod_uid}" in str(procs):
            pids.update(int(p) for p in procs.read_text().split())
    return pids


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def test_cold_and_warm_boxes_reached_by_ssh_scp_and_rsync(rk: KubeUser, tmp_path: Path) -> None:
    cold = _up(rk, "rc", "--profile", "real")
    assert cold["state"] == "running"
    assert _in_box(rk, "rc", "echo $DEVBOX_BOX; hostname").split()[0] == "rc"
    rk.devbox("ssh-config", "--write", check=True)
    plain = rk.user.ssh("rc.devbox", "cat /proc/1/cmdline | tr '\\0' ' '")
    assert plain.returncode == 0, plain.stderr
    # scp and rsync through the same kubelet port-forward.
    sent = tmp_path / "sent.bin"
    sent.write_bytes(os.urandom(300_000))
    cfg = ["-F", str(rk.user.ssh_config)]
    scp = subprocess.run(
        ["scp", *cfg, str(sent), "rc.devbox:sent.bin"], env=rk.user.env, capture_output=True
    )
    assert scp.returncode == 0, scp.stderr
    back = tmp_path / "back.bin"
    scp = subprocess.run(
        ["scp", *cfg, "rc.devbox:sent.bin", str(back)], env=rk.user.env, capture_output=True
    )
    assert scp.returncode == 0 and back.read_bytes() == sent.read_bytes(), scp.stderr
    tree = tmp_path / "tree"
    (tree / "sub").mkdir(parents=True)
    (tree / "sub/a.txt").write_text("alpha\n")
    rsync = subprocess.run(
        ["rsync", "-a", "-e", f"ssh -F {rk.user.ssh_config}", f"{tree}/", "rc.devbox:tree/"],
        env=rk.user.env,
        capture_output=True,
    )
    assert rsync.returncode == 0, rsync.stderr
    assert _in_box(rk, "rc", "cat tree/sub/a.txt") == "alpha\n"

    # A warm pod of the same profile, then a claim of it: the agent in a running
    # container adopts its new owner.
    rk.devbox("pool", "warm", "--profile", "real", "--size", "1", timeout=360, check=True)
    warm = rk.devbox("up", "rw", "--profile", "real", "--no-attach", "--json", timeout=120)
    assert warm.returncode == 0, warm.stderr.decode()
    assert b"claimed warm pod" in warm.stderr
    box = json.loads(warm.stdout)
    assert box["place"].startswith("devbox-warm-")
    assert _in_box(rk, "rw", "echo $DEVBOX_BOX").strip() == "rw"
    assert rk.user.ssh("rw.devbox", "true").returncode == 0


def test_inside_the_container(rk: KubeUser) -> None:
    box = _up(rk, "inside", "--profile", "real")
    out = _in_box(
        rk,
        "inside",
        "tr '\\0' ' ' </proc/1/cmdline; echo; id -u; "
        "grep -E '^(CapEff|CapBnd|Seccomp|NoNewPrivs):' /proc/self/status; "
        'awk \'$5 ~ "^/homes" {print "homes-mount", $9}\' /proc/self/mountinfo; pwd; '
        "echo $USER; id -un",
    )
    lines = out.splitlines()
    assert "devbox agent" in lines[0], lines[0]  # PID 1 is the agent
    assert int(lines[1]) == owner_uid(box["owner"])  # the owner's own uid, not root
    fields = dict(line.split(":\t") for line in lines[2:6])
    assert int(fields["CapEff"], 16) == 0 and int(fields["CapBnd"], 16) == 0
    assert fields["Seccomp"] == "2" and fields["NoNewPrivs"] == "1"
    assert lines[6].startswith("homes-mount "), out  # the home is a real volume mount
    home = lines[7]
    assert home == f"/homes/{home_folder(box['owner'])}"
    assert lines[8] == lines[9] == owner_label(box["owner"])  # the session knows who it is
    # What editors' server installers and git need is in the image, and a command's
    # shell is a top-level one of sshd's (so ~/.bashrc is read): SHLVL 1, SSH_CLIENT set.
    tools = _in_box(
        rk,
        "inside",
        "for t in curl wget git tar gzip; do command -v $t >/dev/null && echo have-$t; done; "
        'echo "shlvl=$SHLVL client=${SSH_CLIENT:+set}"',
    ).split()
    assert tools == [f"have-{t}" for t in ("curl", "wget", "git", "tar", "gzip")] + [
        "shlvl=1",
        "client=set",
    ], tools
    _in_box(rk, "inside", "echo kept-across-boxes > notes.txt")
    rk.devbox("down", "inside", check=True, timeout=120)
    _up(rk, "inside", "--profile", "real")
    assert _in_box(rk, "inside", "cat notes.txt") == "kept-across-boxes\n"


def test_the_agent_holds_only_its_service_account(rk: KubeUser) -> None:
    box = _up(rk, "creds", "--profile", "real")
    pod = _pod(rk, box["place"])
    assert pod is not None and pod["spec"]["serviceAccountName"] == "devbox-agent"
    args = pod["spec"]["containers"][0]["command"]
    assert "--kubeconfig" not in args  # in-cluster credentials, nothing else
    # What that token may do, asked of the real API server from inside the box.
    probe = (
        "import json, ssl, urllib.request\n"
        "d = '/var/run/secrets/kubernetes.io/serviceaccount/'\n"
        "tok = open(d + 'token').read()\n"
        "ctx = ssl.create_default_context(cafile=d + 'ca.crt')\n"
        "def call(method, path, body=None):\n"
        "    req = urllib.request.Request('https://kubernetes.default.svc' + path, "
        "method=method, data=body, headers={'Authorization': 'Bearer ' + tok, "
        "'Content-Type': 'application/json'})\n"
        "    try:\n"
        "        with urllib.request.urlopen(req, context=ctx) as r:\n"
        "            return r.status, json.load(r)\n"
        "    except urllib.error.HTTPError as e:\n"
        "        return e.code, {}\n"
        f"ns = {rk.namespace!r}\n"
        "review = call('POST', '/apis/authentication.k8s.io/v1/selfsubjectreviews', "
        'b\'{"apiVersion":"authentication.k8s.io/v1","kind":"SelfSubjectReview"}\')\n'
        "print(review[1]['status']['userInfo']['username'])\n"
        f"print(call('GET', f'/api/v1/namespaces/{{ns}}/pods/{box['place']}')[0])\n"
        "print(call('GET', f'/api/v1/namespaces/{ns}/secrets')[0])\n"
        "print(call('GET', '/api/v1/nodes')[0])\n"
    )
    # kubernetes.default.svc: no cluster DNS here, so name the Service's address.
    script = probe.replace("https://kubernetes.default.svc", "https://10.0.0.1")
    got = _in_box(rk, "creds", f"/opt/devbox/venv/bin/python - <<'EOF'\n{script}EOF")
    user, own_pod, secrets, nodes = got.split()
    assert user == f"system:serviceaccount:{rk.namespace}:devbox-agent"
    assert (own_pod, secrets, nodes) == ("200", "403", "403")


def _gpu_uuids(kube: KubeUser, name: str) -> list[str]:
    out = _in_box(
        kube,
        name,
        "/opt/devbox/venv/bin/python -c 'import pynvml as n; n.nvmlInit(); "
        "print(*[n.nvmlDeviceGetUUID(n.nvmlDeviceGetHandleByIndex(i)) "
        "for i in range(n.nvmlDeviceGetCount())])'",
    )
    return out.split()


def test_gpus_are_the_boxs_own_and_stats_maps_their_processes(
    rk: KubeUser, real_node: Path
) -> None:
    _up(rk, "g1", "--profile", "real-gpus")
    _up(rk, "g2", "--profile", "real-gpus")
    one, two = _gpu_uuids(rk, "g1"), _gpu_uuids(rk, "g2")
    assert len(one) == len(two) == 2 and not set(one) & set(two), (one, two)
    assert all(u.startswith("GPU-real-") for u in one + two)
    # A process of g1 holds its first GPU's device; the simulated driver reports it on
    # that GPU under its host PID, as NVML does for a process in a container.
    minors = sorted(int(u.rsplit("-", 1)[1]) for u in one)
    marker = "devbox-gpu-holder"
    box_pid = int(
        _in_box(
            rk,
            "g1",
            f'nohup python3 -c \'import sys, time; f = open("/dev/nvidia{minors[0]}"); '
            f"time.sleep(600)' {marker} >/dev/null 2>&1 </dev/null & echo $!",
        )
    )

    def host_pid() -> int:
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                if marker.encode() not in (entry / "cmdline").read_bytes():
                    continue
                nspid = (entry / "status").read_text().split("NSpid:")[1].split("\n")[0].split()
            except (OSError, IndexError):
                continue
            if len(nspid) == 2 and int(nspid[1]) == box_pid:
                return int(nspid[0])
        return 0

    pid = wait_until(host_pid, timeout=30, what="the GPU process's host PID")
    assert pid != box_pid
    gpu_file = real_node / "gpus" / f"alloc-{minors[0]}-{minors[1]}" / "gpus"
    sims = [nvml_sim.SimGpu(uuid=u, minor=m) for u, m in zip(sorted(one), minors, strict=True)]
    nvml_sim.write(gpu_file, sims, [nvml_sim.SimProcess(gpu=0, pid=pid, mem=1 << 30)])

    def mapped() -> dict[str, Any] | None:
        out = rk.devbox("stats", "g1", "--json", timeout=60)
        if out.returncode != 0:
            return None
        sample = json.loads(out.stdout.splitlines()[0])
        procs = sample["gpus"][0]["processes"]
        return procs[0] if procs and procs[0]["box_pid"] is not None else None

    held = wait_until(mapped, timeout=60, what="devbox stats to map the GPU process", every=0.5)
    assert (held["pid"], held["box_pid"]) == (pid, box_pid)


def _busy_box(kube: KubeUser, name: str) -> tuple[dict[str, Any], set[int]]:
    """A box with a detached process in it (nobody's child but PID 1's); the box and the
    host PIDs of all its processes, once that one is among them."""
    box = _up(kube, name, "--profile", "real")
    _in_box(kube, name, "nohup setsid sleep 1000 >/dev/null 2>&1 </dev/null & true")
    pod = _pod(kube, box["place"])
    assert pod is not None

    def with_sleep() -> set[int]:
        pids = _container_pids(pod["metadata"]["uid"])
        names = set()
        for p in pids:
            with contextlib.suppress(OSError):
                names.add(Path(f"/proc/{p}/comm").read_text().strip())
        return pids if "sleep" in names else set()

    pids = wait_until(with_sleep, timeout=30, what="the box's processes")
    assert len(pids) >= 4  # at least the sandbox, the agent's init and itself, the sleep
    return box, pids


# Training code's save before release, without torch: probe.on_release needs none. The
# box's own Python is the one devbox is installed in (a researcher's would have it too).
SAVER = """
import os, time
from devbox import probe

def save(reason):
    path = os.path.expanduser("~/saved-by-release.txt")
    with open(path, "w") as f:
        f.write(reason + "\\n")
    return path

probe.on_release(save)
while True:
    time.sleep(1)
"""


def _saver(kube: KubeUser, name: str) -> int:
    """Start a process in the box that saves before release; its pid, once its probe link
    is up (the hub lists it for `devbox probe --stacks`)."""
    _in_box(kube, name, f"cat > ~/saver.py <<'EOF'\n{SAVER}EOF")
    python = '"$(dirname "$(readlink -f "$(command -v devbox)")")/python"'
    out = _in_box(kube, name, f"setsid {python} ~/saver.py >/dev/null 2>&1 </dev/null & echo $!")
    pid = int(out.split()[-1])

    def linked() -> bool:
        stacks = kube.devbox("probe", name, "--stacks", timeout=60)
        return f"process {pid}" in stacks.stdout.decode()

    wait_until(linked, timeout=60, what="the saver's probe link", every=0.5)
    return pid


def _home_on_volume(kube: KubeUser, owner: str) -> Path:
    """The owner's home on the homes volume, as the node's host folder (a hostPath PV)."""
    got = kube.cluster.kubectl_run("get", "pv", "-o", "json")
    for pv in json.loads(got.stdout)["items"]:
        if (pv["spec"].get("claimRef") or {}).get("namespace") == kube.namespace:
            return Path(pv["spec"]["hostPath"]["path"]) / home_folder(owner)
    raise AssertionError(f"no homes volume for namespace {kube.namespace}")


def test_down_ends_every_process_of_the_box_after_it_saved(rk: KubeUser) -> None:
    box, pids = _busy_box(rk, "ends")
    pod = _pod(rk, box["place"])
    assert pod is not None
    # However the pod goes, its processes get save_timeout (the test's: 40 s), plus the
    # agent's margin, as the grace period the kubelet gives the container.
    assert pod["spec"]["terminationGracePeriodSeconds"] == 48
    saver = _saver(rk, "ends")
    done = rk.devbox("down", "ends", check=True, timeout=180)
    said = done.stdout.decode() + done.stderr.decode()
    saved = _home_on_volume(rk, box["owner"]) / "saved-by-release.txt"
    assert f"process {saver}" in said and "saved-by-release.txt" in said, said
    assert saved.read_text() == "deleted\n"  # no warning stood: a deletion, by its owner
    wait_until(lambda: not any(_alive(p) for p in pids), timeout=60, what="every process to end")


def test_a_baseline_namespace_admits_boxes(
    real_node: Path, cluster: Cluster, tmp_path: Path, nvml_lib_dir: Path
) -> None:
    """Pod Security "baseline" is what boxes need: the agent starts as root with five
    capabilities of baseline's list, to become its owner's uid (agent/owner.py)."""
    ns = new_namespace(cluster)
    labelled = cluster.kubectl_run(
        "label", "namespace", ns, "pod-security.kubernetes.io/enforce=baseline"
    )
    assert labelled.returncode == 0, labelled.stderr
    kube = _real_user(cluster, tmp_path / "baseline", nvml_lib_dir, ns=ns)
    try:
        _up(kube, "strict", "--profile", "real")
        assert _in_box(kube, "strict", "echo admitted") == "admitted\n"
        # The namespace does refuse what baseline forbids: this is not a no-op.
        bad = cluster.kubectl_run(
            "run", "priv-pod", "-n", ns, "--image=devbox/box:test", "--restart=Never",
            "--overrides", '{"spec":{"hostPID":true}}',
        )  # fmt: skip
        assert bad.returncode != 0 and b"violates PodSecurity" in bad.stderr, bad.stderr
    finally:
        cluster.kubectl_run("delete", "namespace", ns, "--wait=false")
        kube.user.stop_all()


def test_a_claimed_warm_box_is_not_preempted_by_ordinary_gpu_work(rk: KubeUser) -> None:
    """Warm pods once ran at a lower priority, and a claim cannot change a pod's priority:
    a plain pod needing the GPUs preempted the user's live box. Now both are equal."""
    rk.devbox("pool", "warm", "--profile", "real-all", "--size", "1", timeout=360, check=True)
    up = rk.devbox("up", "held", "--profile", "real-all", "--no-attach", "--json", timeout=120)
    assert up.returncode == 0 and b"claimed warm pod" in up.stderr, up.stderr
    pod_name = json.loads(up.stdout)["place"]
    before = _pod(rk, pod_name)
    assert before is not None
    plain = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "hungry", "namespace": rk.namespace},
        "spec": {
            "nodeSelector": {"devbox-test/node": "real"},
            "tolerations": [{"key": "devbox-test/real-node", "operator": "Exists"}],
            "containers": [
                {
                    "name": "c",
                    "image": "devbox.local/pause:test",
                    "resources": {"limits": {"nvidia.com/gpu": 8}},
                }
            ],
        },
    }
    made = rk.cluster.kubectl_run("apply", "-f", "-", input=json.dumps(plain).encode())
    assert made.returncode == 0, made.stderr

    def refused() -> str:
        events = rk.cluster.kubectl_run(
            "get", "events", "-n", rk.namespace, "--field-selector",
            "involvedObject.name=hungry,reason=FailedScheduling", "-o", "json",
        )  # fmt: skip
        items = json.loads(events.stdout or "{}").get("items", [])
        return next((e["message"] for e in items if "preemption:" in e["message"]), "")

    # The scheduler has tried, preemption included, and found no victim.
    message = wait_until(refused, timeout=60, what="the GPU pod's scheduling attempt")
    assert "Insufficient nvidia.com/gpu" in message, message
    after = _pod(rk, pod_name)
    assert after is not None and not after["metadata"].get("deletionTimestamp")
    assert after["metadata"]["uid"] == before["metadata"]["uid"]
    assert after["spec"].get("priority", 0) == 0
    assert _in_box(rk, "held", "echo alive") == "alive\n"


def test_an_autoscaler_release_saves_then_ends_every_process_of_the_box(
    rk: KubeUser, tmp_path: Path
) -> None:
    box, pids = _busy_box(rk, "idle")
    saver = _saver(rk, "idle")
    saved = _home_on_volume(rk, box["owner"]) / "saved-by-release.txt"
    settings = tmp_path / "autoscaler.toml"
    settings.write_text(
        "idle_timeout = 6\nwarning = 3\ngrace = 0\ninterval = 1\nsave_timeout = 30\n"
    )
    log = tmp_path / "autoscaler.log"
    with open(log, "wb") as out:
        scaler = subprocess.Popen(
            [sys.executable, "-m", "devbox", "autoscaler", "--config", str(settings)],
            env=rk.user.env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=out,
        )
    try:
        wait_until(
            lambda: _pod(rk, box["place"]) is None or scaler.poll() is not None,
            timeout=120,
            what="the autoscaler to release the idle box",
            every=0.5,
        )
        assert scaler.poll() is None, log.read_text()[-2000:]
    finally:
        scaler.terminate()
        scaler.wait(timeout=30)
    assert "released" in log.read_text(), log.read_text()[-2000:]
    # The deletion's grace let the agent ask the saver, which saved before the end.
    assert saved.read_text() == "idle\n"
    events = rk.cluster.kubectl_run(
        "get", "events", "-n", rk.namespace, "--field-selector", "reason=DevboxSaved", "-o", "json"
    )
    messages = [e["message"] for e in json.loads(events.stdout)["items"]]
    assert any(f"process {saver}" in m and "saved-by-release.txt" in m for m in messages), messages
    wait_until(lambda: not any(_alive(p) for p in pids), timeout=60, what="every process to end")


def _real_person(
    cluster: Cluster, folder: Path, nvml_lib_dir: Path, ns: str, name: str
) -> KubeUser:
    """A lab member of their own Kubernetes identity, with the real node's profiles."""
    kube = _real_user(cluster, folder, nvml_lib_dir, ns=ns)
    kube.user.env["KUBECONFIG"] = str(identity_kubeconfig(cluster, folder / "kube", name, LAB))
    return kube


def test_bob_cannot_read_or_write_alices_home(
    real_node: Path, cluster: Cluster, tmp_path: Path, nvml_lib_dir: Path
) -> None:
    """Warm pods mount the whole homes volume (their owner is not known when they start);
    each agent becomes its owner's uid, and a home is that uid's 0700 folder. A box made
    for its owner mounts that owner's folder only."""
    ns = lab_namespace(cluster)
    admin = _real_user(cluster, tmp_path / "admin", nvml_lib_dir, ns=ns)
    alice = _real_person(cluster, tmp_path / "alice", nvml_lib_dir, ns, "alice")
    bob = _real_person(cluster, tmp_path / "bob", nvml_lib_dir, ns, "bob")
    try:
        admin.devbox("pool", "warm", "--profile", "real", "--size", "2", timeout=360, check=True)
        aw, bw = _up(alice, "aw", "--profile", "real"), _up(bob, "bw", "--profile", "real")
        assert aw["place"].startswith("devbox-warm-") and bw["place"].startswith("devbox-warm-")
        # Even a file alice left world-readable, in a world-readable folder of her home.
        _in_box(alice, "aw", "umask 022; echo s3cret > secret.txt; mkdir open; echo hi > open/f")
        out = _in_box(
            bob,
            "bw",
            "id -u; stat -c %a /homes; ls /homes 2>&1; cat /homes/u-alice/secret.txt 2>&1; "
            "cat /homes/u-alice/open/f 2>&1; touch /homes/u-alice/planted 2>&1; echo end",
        ).splitlines()
        assert int(out[0]) == owner_uid("bob") != owner_uid("alice")
        assert out[1] == "711" and "Permission denied" in out[2], out
        assert all("Permission denied" in line for line in out[3:6]) and out[6] == "end", out
        # A box made for bob (the pool is empty now) has no other home mounted at all.
        _up(bob, "bc", "--profile", "real")
        mounts = _in_box(
            bob,
            "bc",
            "test -e /homes/u-alice && echo present || echo absent; "
            "awk '$5 ~ \"^/homes\" {print $5}' /proc/self/mountinfo",
        ).split()
        assert mounts == ["absent", f"/homes/{home_folder('bob')}"], mounts
        # The agent listens on the pod's loopback only: another pod finds nothing there.
        listening = _in_box(alice, "aw", "awk '$4 == \"0A\" {print $2}' /proc/net/tcp").split()
        assert listening == ["0100007F:08AE"], listening  # 127.0.0.1:2222, nothing else
        pod = _pod(alice, aw["place"])
        assert pod is not None
        knock = _in_box(
            bob,
            "bc",
            '/opt/devbox/venv/bin/python -c "import socket\ntry:\n'
            f"    socket.create_connection(('{pod['status']['podIP']}', 2222), 3); print('open')\n"
            'except OSError as e: print(type(e).__name__)"',
        )
        assert knock.strip() != "open", knock
        # bob's session holds its agent's token: it can touch nothing of alice's, nor the
        # owner key of bob's own box.
        token = _in_box(bob, "bw", "cat /var/run/secrets/kubernetes.io/serviceaccount/token")
        stolen = str(token_kubeconfig(cluster, token.strip(), tmp_path / "stolen-kubeconfig"))
        for target, key in (
            (aw["place"], "devbox.io/alerts"),
            (bw["place"], "devbox.io/owner-key"),
        ):
            done = cluster.kubectl_run(
                "annotate",
                "--overwrite",
                "-n",
                ns,
                "pod",
                target,
                f"{key}=x",
                kubeconfig=Path(stolen),
            )
            assert done.returncode != 0 and b"devbox agent may change only" in done.stderr, (
                done.stderr
            )
        assert _in_box(alice, "aw", "cat secret.txt; ls") == "s3cret\nopen\nsecret.txt\n"
    finally:
        cluster.kubectl_run("delete", "namespace", ns, "--wait=false")
        for kube in (admin, alice, bob):
            kube.user.stop_all()
