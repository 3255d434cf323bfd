"""`devbox ssh-config --inline`: blocks complete in themselves, for clients that do not
follow Include (paramiko, Fabric), read by paramiko's parser and by OpenSSH's own."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import paramiko
import pytest

from devbox import paths
from devbox.boxes import Box, BoxSpec, BoxState
from devbox.ssh import sshconfig

SETTINGS = (
    "hostname",
    "user",
    "proxycommand",
    "identityfile",
    "identitiesonly",
    "userknownhostsfile",
    "stricthostkeychecking",
)


@pytest.fixture
def boxes(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> list[Box]:
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config dir"))  # a space: quoted
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    spec = BoxSpec()
    return [
        Box(name="here", owner="ada", backend="local", spec=spec, state=BoxState.RUNNING),
        Box(
            name="pod",
            owner="ada@lab",
            backend="kubernetes",
            spec=spec,
            state=BoxState.RUNNING,
            extra={"namespace": "team-a"},
        ),
    ]


def _place(box: Box) -> list[str]:
    """What the kubernetes backend's proxy_args gives its box (tested in test_backend_seams)."""
    return ["--namespace", "team-a"] if box.name == "pod" else []


def test_every_block_is_complete_with_no_include_or_match(boxes: list[Box]) -> None:
    text = sshconfig.render_inline(boxes, proxy_args=_place)
    lines = [ln.strip() for ln in text.splitlines()]
    settings = [ln.split()[0].lower() for ln in lines if ln and not ln.startswith("#")]
    assert "include" not in settings and "match" not in settings
    config = paramiko.SSHConfig.from_text(text)
    assert config.get_hostnames() - {"*"} == {"here.devbox", "pod.devbox"}
    for box in boxes:
        found = config.lookup(f"{box.name}.devbox")
        assert all(found.get(key) for key in SETTINGS), found
        # The alias as the host name: a client without HostKeyAlias finds the pin by it.
        assert found["hostname"] == f"{box.name}.devbox" and found["user"] == box.owner
        assert found["identityfile"] == [str(paths.user_key_file())]
        assert found["userknownhostsfile"] == str(paths.known_hosts_file())
        assert found["identitiesonly"] == "yes" and found["stricthostkeychecking"] == "yes"
        assert f"-m devbox proxy --backend {box.backend} {box.name}" in found["proxycommand"]
    assert config.lookup("pod.devbox")["proxycommand"].endswith(" --namespace team-a")


@pytest.mark.skipif(shutil.which("ssh") is None, reason="OpenSSH client missing")
def test_openssh_reads_the_same_settings(boxes: list[Box], tmp_path: Path) -> None:
    inline = tmp_path / "inline_config"
    inline.write_text(sshconfig.render_inline(boxes, proxy_args=_place))
    shown = subprocess.run(
        ["ssh", "-G", "-F", str(inline), "pod.devbox"], capture_output=True, text=True, check=True
    ).stdout
    resolved = dict(line.split(" ", 1) for line in shown.splitlines() if " " in line)
    assert resolved["hostname"] == "pod.devbox" and resolved["user"] == "ada@lab"
    assert resolved["identityfile"] == str(paths.user_key_file())
    assert resolved["userknownhostsfile"] == str(paths.known_hosts_file())
    assert resolved["hostkeyalias"] == "pod.devbox"
    assert resolved["stricthostkeychecking"] == "true"
    assert "proxy --backend kubernetes pod --namespace team-a" in resolved["proxycommand"]
