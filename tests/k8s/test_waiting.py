"""`devbox up` says what a pod that does not start waits for: the scheduler's and the
volume controller's own reasons, on the real control plane, in words."""

from __future__ import annotations

from tests.k8s.conftest import KubeUser


def _config(kube: KubeUser) -> str:
    path = kube.user.home / ".config/devbox/config.toml"
    return str(path)


def test_a_box_short_of_cpu_does_not_wait_for_gpus(kube: KubeUser) -> None:
    with open(_config(kube), "a") as f:
        f.write('\n[profiles.huge-cpu]\ncpu = "1000"\n')
    done = kube.devbox("up", "cpu", "--profile", "huge-cpu", "--no-attach", "--timeout", "8")
    err = done.stderr.decode()
    assert done.returncode == 1, err
    assert "waiting for free CPU (" in err and "nodes short of CPU" in err, err
    assert "GPU" not in err.split("waiting for free CPU", 1)[1].split("\n")[0], err
    last = err.strip().splitlines()[-1]
    assert last.startswith("devbox: error: box pod devbox-cpu was not ready within 8s"), last
    assert "waiting for free CPU" in last


def test_a_missing_storage_class_says_what_to_set(kube: KubeUser) -> None:
    path = _config(kube)
    with open(path) as f:
        text = f.read().replace('home_storage_class = "devbox-sim"', 'home_storage_class = "nope"')
    with open(path, "w") as f:
        f.write(text)
    done = kube.devbox("up", "vol", "--no-attach", "--timeout", "8")
    err = done.stderr.decode()
    assert done.returncode == 1, err
    assert (
        "the homes volume cannot be made: storage class 'nope' does not exist; "
        f"set home_storage_class in {path}"
    ) in err, err
    assert "GPU" not in err, err
