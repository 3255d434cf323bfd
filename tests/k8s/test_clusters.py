"""Three real control planes at once, as one user's [clusters]: the shared test cluster
("onprem") and two of this module's own ("cloud", "spare"), each with its own kwok GPU
nodes, pod runner and homes. Placement, failover, `--cluster`, one view across them,
an unreachable cluster, and `devbox move` with its files.

All of it on one xdist worker (the group): the two clusters are started once, and the
tests that cordon, taint or freeze one of them must not overlap."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from devbox import protocol
from tests.conftest import REPO, User, ls_table, make_user
from tests.k8s.conftest import Cluster, new_namespace, start_cluster, stop_cluster

pytestmark = [pytest.mark.xdist_group("clusters"), pytest.mark.timeout(600)]

NAMES = ("onprem", "cloud", "spare")


@dataclass(frozen=True)
class Three:
    by_name: dict[str, Cluster]


@pytest.fixture(scope="module")
def three(cluster: Cluster) -> Iterator[Three]:
    folders = []
    # The lock private_cluster takes: two kwokctl clusters starting at the same moment
    # can pick the same free port for a component. Held for the starts only.
    with open("/tmp/devbox-private-cluster.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            for _ in range(2):
                folders.append(Path(tempfile.mkdtemp(prefix="dbxm", dir="/tmp")) / "cluster")
            made = [start_cluster(folder) for folder in folders]
        except BaseException:
            _down(folders)
            raise
    try:
        yield Three(dict(zip(NAMES, [cluster, *made], strict=True)))
    finally:
        _down(folders)


def _down(folders: list[Path]) -> None:
    for folder in folders:
        stop_cluster(folder)


@dataclass
class Lab:
    """One user with a namespace in each of the three clusters."""

    user: User
    three: Three
    namespaces: dict[str, str]

    def devbox(self, *args: str, **kw: object) -> subprocess.CompletedProcess[bytes]:
        return self.user.devbox(*args, **kw)  # type: ignore[arg-type]

    def kubectl(self, cluster: str, *args: str) -> subprocess.CompletedProcess[bytes]:
        return self.three.by_name[cluster].kubectl_run(*args)

    def pods(self, cluster: str) -> list[str]:
        out = self.kubectl(cluster, "get", "pods", "-n", self.namespaces[cluster], "-o", "name")
        return out.stdout.decode().split()

    def configure(self, order: tuple[str, ...] = NAMES, extra: str = "") -> None:
        text = (
            'home_storage_class = "devbox-sim"\n'
            'image = "devbox/box:test"\n'
            "start_timeout = 120\n"
            # Long enough that a loaded scheduler binds a pod that fits (it takes well under
            # a second when idle), short enough that failover does not drag.
            "schedule_timeout = 12\n"
            # A loaded machine may take a while to answer a list: room for the answering
            # clusters, so that only the frozen one is reported.
            "cluster_wait = 4\n"
            f"{extra}"
        )
        for preference, name in enumerate(order):
            text += (
                f"[clusters.{name}]\n"
                f'kubeconfig = "{self.three.by_name[name].kubeconfig}"\n'
                f'namespace = "{self.namespaces[name]}"\n'
                f"preference = {preference}\n"
            )
        path = self.user.home / ".config/devbox/config.toml"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


@pytest.fixture
def lab(three: Three, tmp_path: Path, nvml_lib_dir: Path) -> Iterator[Lab]:
    namespaces = {name: new_namespace(c) for name, c in three.by_name.items()}
    user = make_user(tmp_path / "lab", nvml_lib_dir)
    user.env.pop("KUBECONFIG", None)  # the config names each cluster's own
    made = Lab(user, three, namespaces)
    made.configure()
    yield made
    for name, ns in namespaces.items():
        made.kubectl(name, "delete", "namespace", ns, "--wait=false")
    user.stop_all()


@contextlib.contextmanager
def nodes(lab: Lab, cluster: str, how: str, taint: str = "") -> Iterator[None]:
    """Every node of `cluster` cordoned (how="cordon") or given `taint`, undone after."""
    if how == "cordon":
        do, undo = ["cordon", "--selector", "type=kwok"], ["uncordon", "--selector", "type=kwok"]
    else:
        do = ["taint", "nodes", "--all", taint, "--overwrite"]
        undo = ["taint", "nodes", "--all", f"{taint.split('=')[0]}-"]
    done = lab.kubectl(cluster, *do)
    assert done.returncode == 0, done.stderr
    try:
        yield
    finally:
        lab.kubectl(cluster, *undo)


def up(lab: Lab, name: str, *extra: str) -> tuple[dict[str, object], str]:
    done = lab.devbox("up", name, "--no-attach", "--json", *extra, timeout=180)
    assert done.returncode == 0, done.stderr.decode()
    return json.loads(done.stdout), done.stderr.decode()


def test_placement_takes_warm_pods_anywhere_then_room_and_cluster_pins(lab: Lab) -> None:
    # A warm pod in the least preferred cluster beats a new pod in a preferred one.
    lab.devbox("pool", "warm", "--cluster", "spare", "--size", "1", check=True, timeout=180)
    warm, said = up(lab, "w1")
    assert warm["cluster"] == "spare", said
    assert "cluster spare: 1 warm pod(s) ready" in said
    # No warm pod left: the most preferred cluster with room, passing over a full one.
    with nodes(lab, "cloud", "cordon"):
        lab.configure(("cloud", "onprem", "spare"))
        placed, said = up(lab, "p1", "--gpus", "1")
    assert placed["cluster"] == "onprem", said
    assert "trying cluster onprem (" in said and "GPU(s) free" in said
    assert "trying cluster cloud" not in said  # full: tried only after the others
    pinned, _ = up(lab, "p2", "--cluster", "cloud")
    assert pinned["cluster"] == "cloud"
    # One view: every box with its cluster; names are unique across clusters.
    table = ls_table(lab.devbox("ls", check=True).stdout.decode())
    assert {n: row["CLUSTER"] for n, row in table.items()} == {
        "w1": "spare",
        "p1": "onprem",
        "p2": "cloud",
    }
    clash = lab.devbox("up", "p1", "--no-attach", "--cluster", "spare")
    assert clash.returncode != 0
    assert b"a box named 'p1' already exists in cluster onprem" in clash.stderr
    # Each command finds the box's cluster by its name, with no flag.
    for name in ("w1", "p1", "p2"):
        ran = lab.devbox("ssh", name, "--", "echo", f"in-{name}", timeout=90)
        assert ran.stdout.decode().strip() == f"in-{name}", ran.stderr
    # stats, run and logs reach a box in another cluster by its name too.
    sample = json.loads(lab.devbox("stats", "p2", "--json", "--count", "1", check=True).stdout)
    assert "gpus" in sample and "processes" in sample
    project = lab.user.home / "proj"
    project.mkdir()
    (project / "data.txt").write_text("from the laptop\n")
    ran = lab.devbox("run", "--box", "p2", "--sync", str(project), "-d", "--", "cat data.txt")
    assert ran.returncode == 0, ran.stderr
    run_id = ran.stdout.decode().split()[0]
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        log = lab.devbox("logs", "p2", run_id).stdout.decode()
        if "from the laptop" in log:
            break
        time.sleep(0.2)
    assert "from the laptop" in log
    lab.devbox("keep", "p2", "--for", "30m", check=True)
    kept = {b["name"]: b for b in json.loads(lab.devbox("ls", "--json", check=True).stdout)}
    assert 1700 < float(kept["p2"]["keep_until"]) - time.time() <= 1800
    # ssh-config pins each alias to its cluster: plain OpenSSH reaches all three.
    lab.devbox("ssh-config", "--write", check=True)
    for name in ("w1", "p1", "p2"):
        ran = lab.user.ssh(f"{name}.devbox", "echo", f"alias-{name}", timeout=90)
        assert ran.stdout.decode().strip() == f"alias-{name}", ran.stderr
    assert "--cluster spare" in lab.user.ssh_config.read_text()
    # A claim pinned to one cluster keeps the other clusters' aliases.
    up(lab, "p3", "--cluster", "cloud")
    aliases = lab.user.ssh_config.read_text()
    assert all(f"Host {n}.devbox" in aliases for n in ("w1", "p1", "p2", "p3"))
    lab.devbox("down", "w1", check=True)
    assert not [p for p in lab.pods("spare") if "w1" in p]
    gone = lab.devbox("ssh", "w1", "--", "true")
    assert gone.returncode != 0 and b"no box named 'w1' in your clusters" in gone.stderr


def test_failover_when_the_chosen_cluster_cannot_schedule(lab: Lab) -> None:
    # cloud looks free (taints are the scheduler's to weigh) but schedules nothing.
    with nodes(lab, "cloud", "taint", "devbox.io/closed=yes:NoSchedule"):
        lab.configure(("cloud", "onprem", "spare"))
        box, said = up(lab, "f1")
        assert box["cluster"] == "onprem", said
        assert "trying cluster cloud (" in said
        assert "was not scheduled within 12s" in said and "trying the next" in said
        # Nothing is left behind where it failed.
        deadline = time.monotonic() + 60
        while [p for p in lab.pods("cloud") if "f1" in p] and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not [p for p in lab.pods("cloud") if "f1" in p]
        # The failure is remembered: the next claim tries cloud last.
        again, said = up(lab, "f2")
        assert again["cluster"] == "onprem"
        assert "trying cluster cloud" not in said


@pytest.fixture
def frozen_lab(lab: Lab) -> Iterator[Lab]:
    """The lab with a "spare" of its own, for a test that stops its API server: the
    module's spare would come back with its pod runner's watch broken, and later tests
    would wait for warm pods that never start (seen under load)."""
    folder = Path(tempfile.mkdtemp(prefix="dbxm", dir="/tmp")) / "cluster"
    try:
        with open("/tmp/devbox-private-cluster.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            own = start_cluster(folder)
        ns = new_namespace(own)
        made = Lab(
            lab.user,
            Three({**lab.three.by_name, "spare": own}),
            {**lab.namespaces, "spare": ns},
        )
        made.configure()
        yield made
    finally:
        stop_cluster(folder)
        lab.configure()


def test_a_stopped_cluster_is_marked_and_holds_nobody_up(frozen_lab: Lab) -> None:
    lab = frozen_lab
    up(lab, "s1", "--cluster", "spare")
    up(lab, "s2", "--cluster", "cloud")
    lab.devbox("ssh-config", "--write", check=True)
    apiserver = _apiserver_pid(lab.three.by_name["spare"])
    os.kill(apiserver, signal.SIGSTOP)  # its port still accepts; nothing answers
    try:
        start = time.monotonic()
        listed = lab.devbox("ls", timeout=60)
        took = time.monotonic() - start
        assert listed.returncode == 1
        assert list(ls_table(listed.stdout.decode())) == ["s2"]
        assert b"cluster spare is unreachable: no answer within 4s" in listed.stderr
        # Bounded by the wait for each cluster, not by the frozen server (30 s requests).
        assert took < 15, took
        # The box in the answering cluster is reached as ever.
        ran = lab.devbox("ssh", "s2", "--", "echo", "still", timeout=90)
        assert ran.stdout.strip() == b"still", ran.stderr
        # A claim elsewhere rewrites the ssh config: the silent cluster's alias stays.
        _, said = up(lab, "s3", "--cluster", "cloud")
        assert "could not check cluster spare for a box named 's3'" in said
        aliases = lab.user.ssh_config.read_text()
        assert "Host s1.devbox" in aliases and "Host s3.devbox" in aliases
    finally:
        os.kill(apiserver, signal.SIGCONT)
    # A cluster whose API server is gone (connection refused) is said as such too.
    lab.configure(extra="")
    config = lab.user.home / ".config/devbox/config.toml"
    config.write_text(
        config.read_text()
        + '[clusters.gone]\nkubeconfig = "'
        + str(_refusing_kubeconfig(lab))
        + '"\n'
    )
    listed = lab.devbox("ls", timeout=60)
    assert listed.returncode == 1
    assert set(ls_table(listed.stdout.decode())) == {"s1", "s2", "s3"}
    assert b"cluster gone is unreachable: cannot reach the Kubernetes API server" in listed.stderr


def test_move_carries_the_home_and_sends_only_changes_back(lab: Lab) -> None:
    up(lab, "mv", "--cluster", "onprem")
    setup = (
        "mkdir -p work/data && echo v1 > work/notes.txt && "
        "head -c 3000000 /dev/urandom > work/data/big.bin && chmod 700 work/data && "
        "sha256sum work/data/big.bin"
    )
    made = lab.devbox("ssh", "mv", "--", "sh", "-c", f"'{setup}'", timeout=90)
    assert made.returncode == 0, made.stderr
    digest = made.stdout.split()[0]
    moved = lab.devbox("move", "mv", "--to", "cloud", "--json", timeout=240)
    assert moved.returncode == 0, moved.stderr.decode()
    first = json.loads(moved.stdout)
    assert first["box"]["cluster"] == "cloud"
    assert {"work/notes.txt", "work/data/big.bin"} <= set(first["sent"])
    # The box is in cloud now, with its files; onprem's pod is gone (its home stays).
    assert [p for p in lab.pods("cloud") if "mv" in p]
    assert not [p for p in lab.pods("onprem") if "mv" in p]
    check = lab.devbox(
        "ssh",
        "mv",
        "--",
        "sh",
        "-c",
        "'cat work/notes.txt; sha256sum work/data/big.bin; stat -c %a work/data'",
        timeout=90,
    )
    lines = check.stdout.decode().split("\n")
    assert lines[0] == "v1" and lines[1].split()[0] == digest.decode() and lines[2] == "700"
    # Work goes on in cloud; moving back sends what changed, not the rest again.
    changed = lab.devbox(
        "ssh",
        "mv",
        "--",
        "sh",
        "-c",
        "'echo v2 > work/notes.txt'",
        timeout=90,
    )
    assert changed.returncode == 0, changed.stderr
    back = lab.devbox("move", "mv", "--to", "onprem", "--json", timeout=240)
    assert back.returncode == 0, back.stderr.decode()
    second = json.loads(back.stdout)
    assert "work/notes.txt" in second["sent"]
    assert "work/data/big.bin" not in second["sent"]
    assert second["sent_bytes"] < 100_000  # not the 3 MB again
    final = lab.devbox("ssh", "mv", "--", "cat", "work/notes.txt", timeout=90)
    assert final.stdout.strip() == b"v2"
    listed = {b["name"]: b["cluster"] for b in json.loads(lab.devbox("ls", "--json").stdout)}
    assert listed == {"mv": "onprem"}


def test_clusters_autoscalers_and_explain_see_each_cluster(lab: Lab) -> None:
    up(lab, "e1", "--cluster", "cloud")
    lab.devbox("pool", "warm", "--cluster", "spare", "--size", "1", check=True, timeout=180)
    shown = json.loads(lab.devbox("clusters", "--json", check=True).stdout)
    by = {c["cluster"]: c for c in shown}
    assert list(by) == list(NAMES) and all(c["reachable"] for c in shown)
    assert (by["cloud"]["boxes"], by["spare"]["warm"], by["onprem"]["boxes"]) == (1, 1, 0)
    # kwok's nodes of scripts/test-cluster: 4 x 8 GPUs and one of 2.
    assert sum(n["allocatable"] for n in by["spare"]["free_gpus"].values()) == 34
    table = lab.devbox("clusters", check=True).stdout.decode()
    assert table.splitlines()[0].split()[:3] == ["CLUSTER", "PREF", "CONTEXT"]
    # One settings file for all, each cluster's own table over it.
    settings = lab.user.home / "autoscaler.toml"
    settings.write_text('idle_timeout = "2h"\nwarning = "5m"\n[clusters.cloud]\ngrace = "0s"\n')
    once = lab.devbox("autoscaler", "--once", "--config", str(settings), timeout=120)
    assert once.returncode == 0, once.stderr.decode()
    passes = [json.loads(line) for line in once.stdout.splitlines()]
    assert [p["cluster"] for p in passes] == list(NAMES)
    # Each cluster's autoscaler sees its own boxes only.
    assert [sorted(p["verdicts"]) for p in passes] == [[], ["e1"], []]
    # explain finds the box's cluster by its name.
    said = lab.devbox("explain", "e1", "--config", str(settings), "--json", timeout=60)
    assert said.returncode == 0, said.stderr.decode()
    assert json.loads(said.stdout)["box"] == "e1"


def test_a_planted_namesake_and_a_wrong_hint_never_take_you_to_another_box(lab: Lab) -> None:
    """Another user's pod of the same box name in a second cluster, and the routing file
    patched to point there: devbox still reaches (and lists) the user's own box only."""
    up(lab, "own", "--cluster", "onprem")
    marked = lab.devbox("ssh", "own", "--", "sh", "-c", "'echo mine > marker'", timeout=90)
    assert marked.returncode == 0, marked.stderr
    planted = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": "devbox-own",
            "namespace": lab.namespaces["cloud"],
            "labels": {
                protocol.LABEL_MANAGED: protocol.MANAGED_BY,
                protocol.LABEL_BOX: "own",
                protocol.LABEL_STATE: "claimed",
                protocol.LABEL_OWNER: "mallory",
            },
            "annotations": {protocol.ANN_OWNER_NAME: "mallory"},
        },
        "spec": {"containers": [{"name": "box", "image": "devbox/box:test"}]},
    }
    made = lab.three.by_name["cloud"].kubectl_run(
        "apply", "-f", "-", input=json.dumps(planted).encode()
    )
    assert made.returncode == 0, made.stderr
    routes = lab.user.home / ".local/state/devbox/clusters.json"
    routes.write_text(json.dumps({"boxes": {"own": "cloud"}, "failed": {}}))
    ran = lab.devbox("ssh", "own", "--", "cat", "marker", timeout=90)
    assert ran.stdout.strip() == b"mine", ran.stderr
    assert json.loads(routes.read_text())["boxes"]["own"] == "onprem"  # the hint is mended
    listed = {b["name"]: b["cluster"] for b in json.loads(lab.devbox("ls", "--json").stdout)}
    assert listed == {"own": "onprem"}


def test_bad_cluster_input_is_one_line(lab: Lab) -> None:
    for args, says in (
        (("ls", "--cluster", "nowhere"), b"no cluster 'nowhere' in your config"),
        (("move", "nobox", "--to", "cloud"), b"no box named 'nobox' in your clusters"),
        (("move", "nobox", "--to", "mars"), b"no cluster 'mars' in your config"),
        (("pool", "ls"), b"warm pools are per cluster: name one with --cluster"),
    ):
        done = lab.devbox(*args, timeout=60)
        assert done.returncode != 0, args
        lines = done.stderr.decode().strip().splitlines()
        assert len(lines) == 1 and says in lines[0].encode(), (args, lines)


def _apiserver_pid(cluster: Cluster) -> int:
    pids = next((cluster.kubeconfig.parent / "kwok/clusters").glob("*/pids"))
    return int((pids / "kube-apiserver.pid").read_text().strip())


def _refusing_kubeconfig(lab: Lab) -> Path:
    """The shared cluster's kubeconfig, pointed at a port where nothing listens."""
    import socket

    import yaml

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    doc = yaml.safe_load(lab.three.by_name["onprem"].kubeconfig.read_text())
    doc["clusters"][0]["cluster"]["server"] = f"https://127.0.0.1:{port}"
    path = lab.user.home / "gone.kubeconfig"
    path.write_text(yaml.safe_dump(doc))
    return path


def test_the_clusters_benchmark_runs_on_these_three(three: Three) -> None:
    """benchmarks/bench_clusters.py, once, on this module's clusters (it makes and deletes
    a namespace of its own in each): it measures what it says, and meets its target."""
    kubeconfigs = [str(three.by_name[n].kubeconfig) for n in NAMES]
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.bench_clusters",
            "--runs",
            "1",
            "--kubeconfigs",
            *kubeconfigs,
        ],
        cwd=REPO,
        capture_output=True,
        timeout=500,
        check=False,
    )
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    result = json.loads(done.stdout)
    claim = result["warm_claim_to_shell"]
    assert claim["one_cluster_s"]["n"] == claim["three_clusters_s"]["n"] == 1
    assert set(result["ls_s"]) == {"one", "three", "three_one_down"}  # not ours to freeze
    assert all(v["median"] > 0 for v in result["ls_s"].values())
    assert set(result["met"]) == {"three_clusters_at_most_100ms_more"}
