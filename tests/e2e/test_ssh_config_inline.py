"""paramiko, which does not follow Include, reaches a real box from the blocks of
`devbox ssh-config --inline` alone: its ProxyCommand, key and pinned host key."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import User

pytest.importorskip("paramiko")

# What a paramiko (or Fabric) user writes: every setting comes from the config file.
CLIENT = """
import sys
import paramiko

config = paramiko.SSHConfig.from_path(sys.argv[1]).lookup(sys.argv[2])
client = paramiko.SSHClient()
client.load_host_keys(config["userknownhostsfile"])
client.set_missing_host_key_policy(paramiko.RejectPolicy())  # StrictHostKeyChecking yes
client.connect(
    config["hostname"],
    username=config["user"],
    key_filename=config["identityfile"],
    sock=paramiko.ProxyCommand(config["proxycommand"]),
    look_for_keys=False,  # IdentitiesOnly yes
    allow_agent=False,
)
_, out, _ = client.exec_command("echo box=$DEVBOX_BOX; exit 4")
sys.stdout.write(out.read().decode())
print("status", out.channel.recv_exit_status())
client.close()
"""


def paramiko_client(user: User, config: Path, host: str) -> subprocess.CompletedProcess[str]:
    # In the user's environment: the ProxyCommand runs `devbox proxy` as that user.
    return subprocess.run(
        [sys.executable, "-c", CLIENT, str(config), host],
        env=user.env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_paramiko_connects_with_the_inline_blocks(user: User, tmp_path: Path) -> None:
    user.up("para")
    printed = user.devbox("ssh-config", "--inline", check=True).stdout.decode()
    settings = [ln.split()[0] for ln in printed.splitlines() if ln and not ln.startswith("#")]
    assert "Include" not in settings and "Host" in settings
    config = tmp_path / "paramiko_config"
    config.write_text(printed)
    done = paramiko_client(user, config, "para.devbox")
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:2] == ["box=para", "status 4"]


def test_inline_and_write_are_one_or_the_other(user: User) -> None:
    done = user.devbox("ssh-config", "--inline", "--write")
    assert done.returncode == 2
    assert done.stderr.decode().count("\n") == 1 and b"not allowed with" in done.stderr
