"""Several clusters: the [clusters.NAME] tables, the placement policy, and the routing file,
without a cluster (tests/k8s/test_clusters.py drives three real ones)."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from devbox import config
from devbox.backends import placement
from devbox.backends.placement import Seen
from devbox.errors import UsageError

THREE = """
image = "lab/box:1"
schedule_timeout = 4
[clusters.onprem]
context = "lab"
namespace = "devbox"
profiles = ["a100", "default"]
[clusters.cloud]
kubeconfig = "~/.kube/cloud.yaml"
image = "gcr.io/lab/box:1"
preference = 5
[clusters.spare]
namespace = "spare"
"""


def load(tmp_path: Path, text: str) -> config.Config:
    path = tmp_path / "config.toml"
    path.write_text(text)
    return config.load(path)


def test_clusters_are_read_in_preference_order_with_their_own_settings(tmp_path: Path) -> None:
    cfg = load(tmp_path, THREE)
    assert cfg.backend == "kubernetes"  # clusters are Kubernetes clusters
    assert cfg.schedule_timeout == 4.0
    # preference: given, else the table's place in the file (0, 1, 2); ties keep file order.
    assert [c.name for c in cfg.clusters] == ["onprem", "spare", "cloud"]
    onprem, spare, cloud = cfg.clusters
    assert (onprem.config.context, onprem.config.namespace) == ("lab", "devbox")
    assert onprem.offers("a100") and not onprem.offers("cpu")
    assert spare.offers("anything")
    assert cloud.config.kubeconfig == "~/.kube/cloud.yaml"
    assert cloud.config.image == "gcr.io/lab/box:1"
    assert spare.config.image == "lab/box:1"  # the top level's, where a cluster says nothing


def test_an_explicit_local_backend_stays_local(tmp_path: Path) -> None:
    cfg = load(tmp_path, 'backend = "local"\n' + THREE)
    assert cfg.backend == "local"
    assert len(cfg.clusters) == 3


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("[clusters.Bad_Name]\n", "cluster name 'Bad_Name'"),
        ("[clusters.a]\nport = 3\n", "[clusters.a]: unknown setting 'port'"),
        ("[clusters.a]\npreference = -1\n", "preference must be a whole number"),
        ("[clusters.a]\npreference = true\n", "preference must be a whole number"),
        ("[clusters.a]\nprofiles = 'a100'\n", "profiles must be a list"),
        ("[clusters.a]\nprofiles = ['A 100']\n", "a profile name must be"),
        ("[clusters.a]\nnamespace = 3\n", "namespace must be a str"),
        ("[clusters.a]\npriority_class = 'Not OK'\n", "priority_class must be"),
        ("clusters = 3\n", "clusters must be tables"),
        ("clusters = {}\n", "clusters must be tables"),
        ("schedule_timeout = 0\n", "schedule_timeout must be in (0, 3600]"),
        ("failure_memory = nan\n", "failure_memory must be in (0, 3600]"),
        ("cluster_wait = 61\n", "cluster_wait must be in (0, 60]"),
    ],
)
def test_bad_cluster_settings_are_one_line_errors(tmp_path: Path, text: str, says: str) -> None:
    with pytest.raises(UsageError) as raised:
        load(tmp_path, text)
    assert says in raised.value.message
    assert "\n" not in raised.value.message


def seen(cluster: str, preference: int, **kw: object) -> Seen:
    return Seen(cluster=cluster, preference=preference, **kw)  # type: ignore[arg-type]


def test_a_warm_pod_anywhere_beats_a_preferred_cluster_with_room() -> None:
    clusters = [
        seen("onprem", 0, free=[8, 8]),
        seen("cloud", 1, warm=2),
        seen("spare", 2, warm=1),
    ]
    choice = placement.warm_choice(clusters)
    assert choice is not None and choice.cluster == "cloud"
    assert placement.warm_choice([seen("a", 0, warm=3, unusable="unreachable")]) is None


def test_new_pods_go_where_they_fit_then_unknown_then_full_then_recently_failed() -> None:
    clusters = [
        seen("full", 0, free=[1, 0]),
        seen("failed", 1, free=[8]),
        seen("unknown", 2, free=None),
        seen("fits", 3, free=[2, 4]),
        seen("down", 4, unusable="unreachable"),
    ]
    order = placement.order(clusters, gpus=2, failed={"failed": 12.0})
    assert [c.cluster for c in order] == ["fits", "unknown", "full", "failed"]
    reasons = {c.cluster: c.reason for c in order}
    assert reasons["fits"] == "6 GPU(s) free, 4 on one node"
    assert reasons["full"] == "full: at most 1 GPU(s) free on one node"
    assert "did not schedule a pod 12s ago" in reasons["failed"]


def test_preference_orders_clusters_that_fit_alike() -> None:
    clusters = [seen("b", 2, free=[8]), seen("a", 1, free=[8]), seen("c", 1, free=[8])]
    assert [c.cluster for c in placement.order(clusters, gpus=1, failed={})] == ["a", "c", "b"]
    # A CPU-only box fits anywhere that answers.
    assert [c.cluster for c in placement.order([seen("x", 0, free=[])], gpus=0, failed={})] == ["x"]


def test_the_routing_file_is_private_and_a_broken_one_is_an_empty_one(tmp_path: Path) -> None:
    """Run in a child with its own XDG state folder: the file's mode, and what a planted
    garbage file does (nothing: it is only a hint)."""
    state = tmp_path / "state"
    code = (
        "from devbox.backends import clusters as c\n"
        "c._routes.remember('box-a', 'onprem')\n"
        "c._routes.update({'cloud': ['box-b'], 'onprem': []})\n"
        "print(c._routes.cluster_of('box-a'), c._routes.cluster_of('box-b'))\n"
    )
    env = dict(os.environ, XDG_STATE_HOME=str(state))
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    # onprem answered with no boxes: box-a is gone from it; box-b is where cloud says.
    assert out.stdout.split() == ["None", "cloud"]
    path = state / "devbox/clusters.json"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert json.loads(path.read_text())["boxes"] == {"box-b": "cloud"}
    path.write_text("{not json")
    again = subprocess.run(
        [
            sys.executable,
            "-c",
            "from devbox.backends import clusters as c\nprint(c._routes.cluster_of('box-b'))",
        ],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    assert again.stdout.strip() == "None"


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["ls", "--cluster", "x"], "--cluster applies to the kubernetes backend only"),
        (["ls", "--backend", "kubernetes", "--cluster", "x"], "your config lists no clusters"),
        (["clusters"], "devbox clusters needs your clusters"),
        (["move", "box", "--to", "x"], "devbox move needs your clusters"),
    ],
)
def test_cluster_commands_without_clusters_say_so_in_one_line(
    tmp_path: Path, args: list[str], says: str
) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XDG_", "DEVBOX_"))}
    env["HOME"] = str(tmp_path)
    done = subprocess.run(
        [sys.executable, "-m", "devbox", *args], env=env, capture_output=True, text=True
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr.count("\n") == 1 and says in done.stderr


def test_a_bad_cluster_table_fails_every_command_in_one_line(tmp_path: Path) -> None:
    config = tmp_path / ".config/devbox/config.toml"
    config.parent.mkdir(parents=True)
    config.write_text("[clusters.a]\nnamespcae = 'x'\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XDG_", "DEVBOX_"))}
    env["HOME"] = str(tmp_path)
    done = subprocess.run(
        [sys.executable, "-m", "devbox", "ls"], env=env, capture_output=True, text=True
    )
    assert done.returncode == 2
    assert done.stderr.strip().endswith("[clusters.a]: unknown setting 'namespcae'")
    assert done.stderr.count("\n") == 1
