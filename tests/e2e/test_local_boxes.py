"""The local backend end to end: real `devbox` processes, real agents, real sockets."""

from __future__ import annotations

import json
import os
import pwd
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from tests.conftest import User, new_gpu_namespace


def _ls(user: User) -> dict[str, dict[str, Any]]:
    out = user.devbox("ls", "--json", check=True).stdout
    return {b["name"]: b for b in json.loads(out)}


def test_up_ls_ssh_down(user: User) -> None:
    box = user.up("alpha")
    assert box["name"] == "alpha" and box["state"] == "running" and box["backend"] == "local"
    assert str(box["host_key_fingerprint"]).startswith("SHA256:")
    assert _ls(user)["alpha"]["state"] == "running"

    table = user.devbox("ls", check=True).stdout.decode().splitlines()
    header = ["NAME", "BACKEND", "STATE", "GPUS", "AGE", "IDLE", "RELEASE", "KEPT", "ALERTS"]
    assert table[0].split() == header
    assert table[1].split()[:4] == ["alpha", "local", "running", "0"]

    hello = user.devbox("ssh", "alpha", "--", "echo", "hello", "$DEVBOX_BOX", check=True)
    assert hello.stdout == b"hello alpha\n"

    assert user.devbox("down", "alpha", check=True).returncode == 0
    assert "alpha" not in _ls(user)
    # The home folder outlives the box.
    assert (user.box_dir("alpha") / "home").is_dir()


def test_the_owner_is_the_kernels_account_not_user(user: User) -> None:
    user.env.update(USER="alice", LOGNAME="alice")
    box = json.loads(user.devbox("up", "who", "--no-attach", "--json", check=True).stdout)
    assert box["owner"] == pwd.getpwuid(os.getuid()).pw_name != "alice"


def test_generated_name_is_a_dns_label(user: User) -> None:
    result = user.devbox("up", "--no-attach", "--json", check=True)
    name = json.loads(result.stdout)["name"]
    assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", name) and len(name) <= 63


def test_ssh_command_passes_streams_and_status_through(user: User, ssh_client: str) -> None:
    user.up("streams")
    result = user.devbox("ssh", "streams", "--", "cat; echo oops >&2; exit 7", input=b"from stdin")
    assert result.returncode == 7
    assert result.stdout == b"from stdin"
    assert result.stderr == b"oops\n"
    # Words are joined and parsed by the login shell, as `ssh host CMD` does.
    joined = user.devbox("ssh", "streams", "--", "echo", "a  b", "|", "tr", "a", "x", check=True)
    assert joined.stdout == b"x b\n"
    binary = bytes(range(256)) * 4096
    echoed = user.devbox("ssh", "streams", "--", "cat", input=binary, check=True)
    assert echoed.stdout == binary


def test_signal_exit_status(user: User, ssh_client: str) -> None:
    user.up("sig")
    result = user.devbox("ssh", "sig", "--", "kill -TERM $$")
    assert result.returncode == 255  # what OpenSSH's ssh reports for a killed command


def test_concurrent_claims_get_distinct_names_and_gpus(user: User) -> None:
    user.gpus(4)

    def claim(_: int) -> subprocess.CompletedProcess[bytes]:
        return user.devbox("up", "--gpus", "1", "--no-attach", "--json")

    with ThreadPoolExecutor(max_workers=6) as pool:
        results = list(pool.map(claim, range(6)))
    ok = [json.loads(r.stdout) for r in results if r.returncode == 0]
    failed = [r for r in results if r.returncode != 0]
    assert len(ok) == 4, [r.stderr for r in failed]
    assert len({b["name"] for b in ok}) == 4
    assert len({b["gpu_ids"][0] for b in ok}) == 4
    for r in failed:
        assert r.returncode == 1
        assert r.stderr.decode().startswith("devbox: error: asked for 1 GPU(s) but only 0 of 4")


def test_same_name_at_the_same_moment_only_one_wins(user: User) -> None:
    with ThreadPoolExecutor(max_workers=4) as pool:
        results = list(pool.map(lambda _: user.devbox("up", "dup", "--no-attach"), range(4)))
    codes = sorted(r.returncode for r in results)
    assert codes == [0, 2, 2, 2], [r.stderr for r in results]


def test_gpus_are_exclusive_and_visible_in_sessions(user: User) -> None:
    user.gpus(3)
    a = user.up("ga", "--gpus", "2")
    assert len(a["gpu_ids"]) == 2
    seen = user.devbox("ssh", "ga", "--", "echo $CUDA_VISIBLE_DEVICES", check=True).stdout
    assert seen.decode().strip() == ",".join(a["gpu_ids"])

    too_many = user.devbox("up", "gb", "--gpus", "2", "--no-attach")
    assert too_many.returncode == 1
    # The refusal names who holds each taken GPU, as the kernel tells it (SO_PEERCRED).
    pid = (user.box_dir("ga") / "agent.lock").read_text()
    who = f"held by uid {os.getuid()} ({pwd.getpwuid(os.getuid()).pw_name}), pid {pid}"
    gpu0, gpu1 = a["gpu_ids"]
    assert too_many.stderr.decode() == (
        "devbox: error: asked for 2 GPU(s) but only 1 of 3 are free: "
        f"GPU 0 ({gpu0}) is {who}; GPU 1 ({gpu1}) is {who}\n"
    )
    b = user.up("gb", "--gpus", "1")
    assert set(b["gpu_ids"]).isdisjoint(a["gpu_ids"])

    # A box without GPUs sees none, not the machine's.
    user.up("nogpu")
    assert user.devbox("ssh", "nogpu", "--", "echo [$CUDA_VISIBLE_DEVICES]").stdout == b"[]\n"

    # Releasing frees the GPUs for the next claim.
    user.devbox("down", "ga", check=True)
    assert len(user.up("gc", "--gpus", "2")["gpu_ids"]) == 2


def test_more_gpus_than_the_machine_has(user: User) -> None:
    user.gpus(0)
    result = user.devbox("up", "big", "--gpus", "1", "--no-attach")
    assert result.returncode == 1
    assert result.stderr.decode() == "devbox: error: asked for 1 GPU(s) but this machine has 0\n"
    assert "big" not in _ls(user)


def test_two_users_never_share_a_gpu(user_factory) -> None:  # type: ignore[no-untyped-def]
    machine = new_gpu_namespace()
    alice = user_factory("alice", gpu_namespace=machine)
    bob = user_factory("bob", gpu_namespace=machine)
    alice.gpus(2)
    bob.gpus(2)
    a = alice.up("mine", "--gpus", "1")
    b = bob.up("mine", "--gpus", "1")  # the same box name is fine for another user
    assert a["gpu_ids"] != b["gpu_ids"]
    assert bob.devbox("up", "more", "--gpus", "1", "--no-attach").returncode == 1


def test_dead_agent_is_failed_and_frees_its_gpus(user: User) -> None:
    user.gpus(1)
    user.up("doomed", "--gpus", "1")
    pid = int((user.box_dir("doomed") / "agent.lock").read_text())
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while _ls(user)["doomed"]["state"] != "failed":
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert "agent is not running" in user.devbox("ls").stderr.decode()
    # Its GPU went back to the pool the moment it died.
    assert len(user.up("next", "--gpus", "1")["gpu_ids"]) == 1
    ssh = user.devbox("ssh", "doomed", "--", "true")
    assert ssh.returncode == 2 and b"is failed" in ssh.stderr
    assert user.devbox("down", "doomed").returncode == 0
    assert "doomed" not in _ls(user)


def test_sigterm_shuts_the_agent_down_cleanly(user: User, ssh_client: str) -> None:
    user.up("term")
    pid = int((user.box_dir("term") / "agent.lock").read_text())
    # A long command is running when the box is stopped.
    runner = subprocess.Popen(
        [sys.executable, "-m", "devbox", "ssh", "term", "--", "echo started; sleep 60"],
        env=user.env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert runner.stdout is not None and runner.stdout.readline() == b"started\n"
    os.kill(pid, signal.SIGTERM)
    _, err = runner.communicate(timeout=15)
    assert runner.returncode == 1
    assert err.startswith(b"devbox: error: lost the connection to box term")
    assert err.count(b"\n") == 1
    deadline = time.monotonic() + 10
    while True:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        assert time.monotonic() < deadline, "agent did not exit on SIGTERM"
        time.sleep(0.05)
    log = (user.box_dir("term") / "agent.log").read_text()
    assert "shutting down" in log and "Traceback" not in log


def test_backend_selection(user: User) -> None:
    env_k8s = user.devbox("ls")
    assert env_k8s.returncode == 0
    user.env["DEVBOX_BACKEND"] = "nonsense"
    bad = user.devbox("ls")
    assert bad.returncode == 2 and bad.stderr.startswith(b"devbox: error: unknown backend")
    # The flag wins over the environment.
    assert user.devbox("ls", "--backend", "local").returncode == 0
    del user.env["DEVBOX_BACKEND"]
    config = user.home / ".config/devbox/config.toml"
    config.parent.mkdir(parents=True, exist_ok=True)
    config.write_text('backend = "local"\n')
    assert user.devbox("ls").returncode == 0
    # XDG_CONFIG_HOME is honoured.
    other = user.home / "elsewhere"
    (other / "devbox").mkdir(parents=True)
    (other / "devbox/config.toml").write_text('backend = "mars"\n')
    user.env["XDG_CONFIG_HOME"] = str(other)
    moved = user.devbox("ls")
    assert moved.returncode == 2 and b"backend must be one of" in moved.stderr


def test_piped_script_without_a_command_runs_in_the_login_shell(
    user: User, ssh_client: str
) -> None:
    user.up("piped")
    result = user.devbox("ssh", "piped", input=b"echo on-$DEVBOX_BOX\nexit 6\n")
    assert result.returncode == 6
    assert result.stdout == b"on-piped\n"


def test_idle_time_follows_input(user: User) -> None:
    user.up("idler")
    time.sleep(2.5)
    before = _ls(user)["idler"]
    idle_before = time.time() - float(before["last_activity"])
    assert idle_before >= 2
    user.devbox("ssh", "idler", "--", "cat", input=b"typing", check=True)
    after = _ls(user)["idler"]
    assert time.time() - float(after["last_activity"]) < idle_before
    assert float(after["last_activity"]) > float(before["last_activity"])


def test_keep_holds_a_box_and_off_ends_it(user: User) -> None:
    user.up("kept")
    before = time.time()
    user.devbox("keep", "kept", "--for", "2h", check=True)
    until = float(_ls(user)["kept"]["keep_until"])
    assert before + 7200 <= until <= time.time() + 7200
    row = user.devbox("ls", check=True).stdout.decode().splitlines()[1].split()
    assert row[0] == "kept" and row[-2:] == ["1h", "-"]  # 1 h 59 min left; no model alerts
    user.devbox("keep", "kept", "--off", check=True)
    assert _ls(user)["kept"]["keep_until"] == 0
    assert user.devbox("ls", check=True).stdout.decode().splitlines()[1].split()[-2] == "-"


def test_keep_bad_input(user: User) -> None:
    user.up("k2")
    for args in (["--for", "5"], ["--for", "0h"], ["--for", "31d"], ["--for", "soon"]):
        result = user.devbox("keep", "k2", *args)
        assert result.returncode == 2, args
        assert result.stderr.startswith(b"devbox: error:") and result.stderr.count(b"\n") == 1
    missing = user.devbox("keep", "nobox")
    assert missing.returncode == 2 and b"no box named 'nobox'" in missing.stderr
    assert _ls(user)["k2"]["keep_until"] == 0  # nothing half-written


def test_a_profile_gives_its_gpus_locally_and_gpus_overrides_it(user: User) -> None:
    # Locally only a profile's GPU count applies; cpu, memory and the rest are ignored.
    user.gpus(3)
    cfg = user.home / ".config/devbox/config.toml"
    cfg.parent.mkdir(parents=True, exist_ok=True)
    cfg.write_text('[profiles.pair]\ngpus = 2\ncpu = "8"\nmemory = "64Gi"\n')
    box = user.up("pp", "--profile", "pair")
    assert len(box["gpu_ids"]) == 2
    assert box["spec"]["profile"] == "pair" and box["spec"]["gpus"] == 2
    one = user.up("po", "--profile", "pair", "--gpus", "1")
    assert len(one["gpu_ids"]) == 1
