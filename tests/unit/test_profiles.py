"""Box profiles: parsing, every bad input as one line naming its source and field,
resolution (built in < cluster < user), the spec's JSON (old records too), and the pod a
profile makes."""

from __future__ import annotations

import dataclasses
import json
import subprocess
from pathlib import Path

import pytest

from devbox import config, profiles
from devbox import protocol as p
from devbox.backends.kubernetes import pods
from devbox.backends.kubernetes.identity import Identity
from devbox.boxes import Box, BoxSpec, BoxState, Toleration
from devbox.errors import UsageError
from devbox.profiles import Profile
from tests.conftest import User

FULL = """
[profiles.a100]
gpus = 2
cpu = "500m"
memory = "8Gi"
image = "registry.example/box:cuda12"
node_selector = { "nvidia.com/gpu.product" = "A100", "kubernetes.io/hostname" = "n1" }
tolerations = [
  { key = "nvidia.com/gpu", operator = "Exists", effect = "NoSchedule" },
  { key = "spot", value = "yes", effect = "NoExecute", toleration_seconds = 60 },
]

[profiles.small]
cpu = 2
"""


def test_a_full_profile() -> None:
    a100, small = profiles.parse_document(FULL, source="ConfigMap ns/devbox-profiles")
    assert a100 == Profile(
        name="a100",
        gpus=2,
        cpu="500m",
        memory="8Gi",
        image="registry.example/box:cuda12",
        node_selector=(("kubernetes.io/hostname", "n1"), ("nvidia.com/gpu.product", "A100")),
        tolerations=(
            Toleration(key="nvidia.com/gpu", operator="Exists", effect="NoSchedule"),
            Toleration(key="spot", value="yes", effect="NoExecute", toleration_seconds=60),
        ),
        source="ConfigMap ns/devbox-profiles",
    )
    # Unset fields are the built-in default's.
    assert (small.gpus, small.cpu, small.memory, small.image) == (0, "2", "2Gi", "")
    assert a100.spec(gpus=None).gpus == 2 and a100.spec(gpus=0).gpus == 0


def test_later_sources_replace_a_profile_whole() -> None:
    (cluster,) = profiles.parse_document(
        '[profiles.gpu]\ngpus = 1\nmemory = "16Gi"\n', source="ConfigMap"
    )
    (mine,) = profiles.parse_table({"gpu": {"cpu": "4"}}, source="config file c.toml")
    (default,) = profiles.parse_table({"default": {"cpu": "250m"}}, source="ConfigMap")
    catalog = profiles.resolve([cluster, default], [mine])
    assert catalog["gpu"] == Profile(name="gpu", cpu="4", source="config file c.toml")
    assert catalog["default"].cpu == "250m"
    assert profiles.resolve()["default"] == profiles.BUILT_IN_DEFAULT
    with pytest.raises(UsageError, match=r"unknown profile 'nope': the known profiles are "):
        profiles.choose(catalog, "nope")
    with pytest.raises(UsageError) as caught:
        profiles.choose(catalog, "nope")
    assert caught.value.message.endswith("are default, gpu")


@pytest.mark.parametrize(
    ("table", "message"),
    [
        ("[profiles.A100]", "a profile name must be lowercase letters"),
        ("profiles = 3", "profiles must be tables"),
        ("[profiles.p]\ncolour = 1", "profiles.p: unknown field 'colour'"),
        ("[profiles.p]\ngpus = -1", "profiles.p.gpus must be a whole number, at least 0"),
        ("[profiles.p]\ngpus = true", "profiles.p.gpus must be a whole number"),
        ("[profiles.p]\ngpus = 1.5", "profiles.p.gpus must be a whole number"),
        ('[profiles.p]\ncpu = "lots"', "profiles.p.cpu must be a CPU quantity above 0"),
        ('[profiles.p]\ncpu = "0"', "profiles.p.cpu must be a CPU quantity above 0"),
        ('[profiles.p]\ncpu = "2Gi"', "profiles.p.cpu must be a CPU quantity"),
        ('[profiles.p]\nmemory = "512m"', "profiles.p.memory is '512m', which is millibytes"),
        ("[profiles.p]\nmemory = 8", "profiles.p.memory must be a memory quantity"),
        ('[profiles.p]\nmemory = "8GB"', "profiles.p.memory must be a memory quantity"),
        ('[profiles.p]\nimage = ""', "profiles.p.image must be an image reference"),
        ('[profiles.p]\nimage = "a b"', "profiles.p.image must be an image reference"),
        ("[profiles.p]\nnode_selector = 1", "profiles.p.node_selector must be a table"),
        (
            '[profiles.p]\nnode_selector = { "bad key!" = "x" }',
            "profiles.p.node_selector key 'bad key!' is not a label key",
        ),
        (
            '[profiles.p]\nnode_selector = { "Bad_Prefix/x" = "y" }',
            "its prefix must be a DNS subdomain",
        ),
        (
            '[profiles.p]\nnode_selector = { zone = "-a" }',
            "profiles.p.node_selector.zone '-a' is not a label value",
        ),
        ("[profiles.p]\nnode_selector = { zone = 3 }", "must be a string label value"),
        ('[profiles.p]\ntolerations = { key = "x" }', "profiles.p.tolerations must be an array"),
        ("[profiles.p]\ntolerations = [3]", "profiles.p.tolerations[0] must be a table"),
        (
            '[profiles.p]\ntolerations = [{ key = "x", when = "now" }]',
            "profiles.p.tolerations[0]: unknown field 'when'",
        ),
        (
            '[profiles.p]\ntolerations = [{ key = "x", operator = "In" }]',
            "profiles.p.tolerations[0].operator must be Equal or Exists",
        ),
        (
            '[profiles.p]\ntolerations = [{ value = "x" }]',
            "tolerations[0].key may be empty only with operator Exists",
        ),
        (
            '[profiles.p]\ntolerations = [{ key = "x", operator = "Exists", value = "y" }]',
            "tolerations[0].value must be empty with operator Exists",
        ),
        (
            '[profiles.p]\ntolerations = [{ key = "x", effect = "Never" }]',
            "tolerations[0].effect must be one of NoSchedule, PreferNoSchedule, NoExecute",
        ),
        (
            '[profiles.p]\ntolerations = [{ key = "x", effect = "NoSchedule", '
            "toleration_seconds = 5 }]",
            "tolerations[0].toleration_seconds applies only with effect NoExecute",
        ),
        (
            '[profiles.p]\ntolerations = [{ key = "x", effect = "NoExecute", '
            "toleration_seconds = -1 }]",
            "toleration_seconds must be a whole number of seconds",
        ),
        ("[profiles.p]\ntolerations = [{ key = 5 }]", "tolerations[0].key must be a string"),
    ],
)
def test_bad_profiles_are_one_line_naming_the_file_and_field(
    tmp_path: Path, table: str, message: str
) -> None:
    path = tmp_path / "config.toml"
    path.write_text(table + "\n")
    with pytest.raises(UsageError) as caught:
        config.load(path)
    text = caught.value.message
    assert text.startswith(f"config file {path}: ") and message in text, text
    assert "\n" not in text
    # The ConfigMap's text is read by the same rules, and named instead of the file.
    with pytest.raises(UsageError) as caught:
        profiles.parse_document(table + "\n", source="ConfigMap lab/devbox-profiles")
    assert caught.value.message.startswith("ConfigMap lab/devbox-profiles: ")
    assert message in caught.value.message


def test_the_config_map_holds_profiles_only() -> None:
    with pytest.raises(UsageError, match=r"^ConfigMap x: unknown setting 'image'"):
        profiles.parse_document('image = "x"\n', source="ConfigMap x")
    with pytest.raises(UsageError, match=r"^ConfigMap x is not valid TOML"):
        profiles.parse_document("[profiles.\n", source="ConfigMap x")
    assert profiles.parse_document("", source="ConfigMap x") == ()


def test_config_priority_class_and_the_removed_warm_one(tmp_path: Path) -> None:
    path = tmp_path / "config.toml"
    path.write_text('priority_class = "devbox-box"\n[profiles.gpu]\ngpus = 1\n')
    cfg = config.load(path)
    assert cfg.priority_class == "devbox-box"
    assert cfg.profiles == (Profile(name="gpu", gpus=1, source=f"config file {path}"),)
    path.write_text('warm_priority_class = "devbox-warm"\n')
    with pytest.raises(UsageError, match="warm_priority_class was removed: warm pods now run"):
        config.load(path)
    path.write_text('priority_class = "Not A Name"\n')
    with pytest.raises(UsageError, match="priority_class must be a PriorityClass name"):
        config.load(path)


def test_spec_json_round_trip_and_old_records() -> None:
    spec = Profile(
        name="a100",
        gpus=1,
        cpu="500m",
        memory="8Gi",
        image="img",
        node_selector=(("zone", "a"),),
        tolerations=(
            Toleration(key="k", operator="Exists"),
            Toleration(key="s", value="v", effect="NoExecute", toleration_seconds=5),
        ),
    ).spec()
    box = Box(name="b", owner="o", backend="kubernetes", spec=spec, state=BoxState.RUNNING)
    assert Box.from_json(json.loads(json.dumps(box.to_json()))) == box
    assert box.to_json()["spec"]["node_selector"] == {"zone": "a"}
    # A local record from before profiles had resources.
    old = {
        "name": "b",
        "owner": "o",
        "backend": "local",
        "spec": {"gpus": 2, "profile": "default", "image": ""},
        "state": "running",
    }
    assert Box.from_json(old).spec == BoxSpec(gpus=2)


def test_the_pod_of_a_profile() -> None:
    cfg = config.Config(image="base:1", priority_class="devbox-box")
    (prof,) = profiles.parse_document(FULL, source="x")[:1]
    spec = prof.spec(gpus=None)
    warm = pods.box_pod(cfg, spec=spec)
    claimed = pods.box_pod(
        cfg, spec=spec, box="b1", owner=Identity("ann"), owner_key="ssh-ed25519 K"
    )
    for pod in (warm, claimed):
        (container,) = pod["spec"]["containers"]
        # Requests only: no CPU or memory limit, the GPUs as a limit.
        assert container["resources"] == {
            "requests": {"cpu": "500m", "memory": "8Gi"},
            "limits": {"nvidia.com/gpu": "2"},
        }
        assert container["image"] == "registry.example/box:cuda12"
        assert pod["spec"]["nodeSelector"] == {
            "kubernetes.io/hostname": "n1",
            "nvidia.com/gpu.product": "A100",
        }
        assert pod["spec"]["tolerations"] == [
            {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
            {
                "key": "spot",
                "operator": "Equal",
                "value": "yes",
                "effect": "NoExecute",
                "tolerationSeconds": 60,
            },
        ]
        # Warm or claimed, one priority: a claimed warm pod is never preemptible.
        assert pod["spec"]["priorityClassName"] == "devbox-box"
        # Pod Security "baseline": root with five of its capabilities, until the agent
        # becomes its owner; no runAsUser or fsGroup (see pods.box_pod).
        assert pod["spec"]["securityContext"] == {"seccompProfile": {"type": "RuntimeDefault"}}
        assert container["securityContext"] == {
            "allowPrivilegeEscalation": False,
            "capabilities": {
                "drop": ["ALL"],
                "add": ["CHOWN", "FOWNER", "KILL", "SETGID", "SETPCAP", "SETUID"],
            },
        }
    # A box made for its owner mounts the owner's folder only; a warm pod, the volume.
    assert warm["spec"]["containers"][0]["volumeMounts"][0] == {
        "name": "homes",
        "mountPath": "/homes",
    }
    assert claimed["spec"]["containers"][0]["volumeMounts"][0] == {
        "name": "homes",
        "mountPath": "/homes/u-ann",
        "subPath": "u-ann",
    }
    assert claimed["metadata"]["annotations"][p.ANN_OWNER_NAME] == "ann"
    shape = warm["metadata"]["labels"][pods.LABEL_SHAPE]
    assert claimed["metadata"]["labels"][pods.LABEL_SHAPE] == shape
    # Any change of shape changes the label; the profile's name does not.
    changed = [
        dataclasses.replace(prof, cpu="1").spec(),
        prof.spec(gpus=1),
        dataclasses.replace(prof, image="").spec(),
        dataclasses.replace(prof, tolerations=()).spec(),
        dataclasses.replace(prof, node_selector=()).spec(),
    ]
    assert all(pods.shape(cfg, s) != shape for s in changed)
    assert pods.shape(config.Config(image="base:1"), spec) != shape  # priority class
    assert pods.shape(cfg, dataclasses.replace(prof, name="x").spec()) == shape
    # The built-in default: as before profiles, the config's image, no selector.
    plain = pods.box_pod(config.Config(image="base:1"), spec=BoxSpec())
    assert plain["spec"]["containers"][0]["resources"] == {
        "requests": {"cpu": "1", "memory": "2Gi"}
    }
    assert plain["spec"]["containers"][0]["image"] == "base:1"
    assert not {"nodeSelector", "tolerations", "priorityClassName"} & set(plain["spec"])
    # And back: the box record of the pod carries its shape.
    pod = {**claimed, "metadata": {**claimed["metadata"], "namespace": "ns"}}
    assert pods.to_box(pod).spec == spec


def _one_line(result: subprocess.CompletedProcess[bytes], code: int) -> str:
    err = result.stderr.decode()
    assert result.returncode == code, err
    assert err.startswith("devbox: error: ") and err.count("\n") == 1, err
    return err.strip()


def test_the_cli_says_what_is_wrong_in_one_line(user: User) -> None:
    cfg = user.home / ".config/devbox/config.toml"
    cfg.parent.mkdir(parents=True, exist_ok=True)
    cfg.write_text('[profiles.gpu]\ngpus = 1\nmemory = "512m"\n')
    err = _one_line(user.devbox("ls"), 2)
    assert f"config file {cfg}: profiles.gpu.memory is '512m', which is millibytes" in err
    cfg.write_text('[profiles.gpu]\ngpus = 1\n[profiles.big]\ncpu = "8"\n')
    err = _one_line(user.devbox("up", "--profile", "nope", "--no-attach"), 2)
    assert err == (
        "devbox: error: unknown profile 'nope': the known profiles are big, default, gpu"
    )
    listed = json.loads(user.devbox("profiles", "--json", check=True).stdout)
    assert {p["name"]: p["source"] for p in listed} == {
        "default": "built in",
        "gpu": f"config file {cfg}",
        "big": f"config file {cfg}",
    }
    table = user.devbox("profiles", check=True).stdout.decode()
    assert table.splitlines()[0].split() == [
        "NAME",
        "GPUS",
        "CPU",
        "MEMORY",
        "IMAGE",
        "NODES",
        "SOURCE",
    ]
