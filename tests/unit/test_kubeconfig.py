"""Reading kubeconfig as kubectl does, without the official client on the common path."""

from __future__ import annotations

import base64
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from devbox.backends.kubernetes import kubeconfig
from devbox.errors import UsageError


def _write(path: Path, text: str) -> Path:
    path.write_text(textwrap.dedent(text))
    return path


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


@pytest.fixture
def two_files(tmp_path: Path) -> str:
    (tmp_path / "certs").mkdir()
    (tmp_path / "certs/ca.pem").write_text("CA FROM FILE")
    (tmp_path / "token").write_text("file-token\n")
    first = _write(
        tmp_path / "first.yaml",
        """
        current-context: a
        clusters:
        - {name: one, cluster: {server: "https://one:6443/", certificate-authority: certs/ca.pem}}
        users:
        - {name: u1, user: {tokenFile: token}}
        contexts:
        - {name: a, context: {cluster: one, user: u1, namespace: team}}
        """,
    )
    second = _write(
        tmp_path / "second.yaml",
        f"""
        current-context: b
        clusters:
        - {{name: one, cluster: {{server: "https://shadowed:1"}}}}
        - {{name: two, cluster: {{server: "https://two:443", insecure-skip-tls-verify: true,
            tls-server-name: kube.internal}}}}
        users:
        - {{name: u2, user: {{client-certificate-data: {_b64("CERT")},
            client-key-data: {_b64("KEY")}}}}}
        contexts:
        - {{name: b, context: {{cluster: two, user: u2}}}}
        """,
    )
    return f"{first}:{second}"


def test_merged_files_first_wins_and_paths_are_relative(
    two_files: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KUBECONFIG", two_files)
    a = kubeconfig.load()
    assert (a.context, a.server, a.namespace) == ("a", "https://one:6443", "team")
    assert a.ca_pem == "CA FROM FILE"  # relative to the file that names it
    assert a.authorization() == "Bearer file-token"
    b = kubeconfig.load(context="b")
    assert (b.server, b.namespace, b.insecure) == ("https://two:443", "default", True)
    assert (b.cert_pem, b.key_pem, b.tls_server_name) == (b"CERT", b"KEY", "kube.internal")
    assert b.authorization() == ""


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("current-context: x\ncontexts: []\n", "no context 'x'"),
        ("clusters: [\n", "not valid YAML"),
        ("- a list\n", "is not a kubeconfig"),
        ("contexts: [{name: c, context: {cluster: nope}}]\ncurrent-context: c\n", "no cluster"),
        ("kind: Config\n", "sets no context"),
    ],
)
def test_bad_kubeconfigs_are_one_line_errors(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, text: str, message: str
) -> None:
    monkeypatch.setenv("KUBECONFIG", str(_write(tmp_path / "k.yaml", text)))
    with pytest.raises(UsageError, match=message) as err:
        kubeconfig.load()
    assert "\n" not in str(err.value)


def test_unknown_context_and_missing_file(
    two_files: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KUBECONFIG", two_files)
    with pytest.raises(UsageError, match="no context 'zzz' in your kubeconfig"):
        kubeconfig.load(context="zzz")
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "absent.yaml"))
    with pytest.raises(UsageError, match="no kubeconfig at"):
        kubeconfig.load()


def test_an_exec_plugin_goes_through_the_official_loader(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Cloud logins (exec plugins) run as kubectl runs them: the plugin's token is used."""
    plugin = tmp_path / "plugin.py"
    plugin.write_text(
        "import json\nprint(json.dumps({'apiVersion': 'client.authentication.k8s.io/v1',"
        " 'kind': 'ExecCredential', 'status': {'token': 'from-plugin'}}))\n"
    )
    config = _write(
        tmp_path / "k.yaml",
        f"""
        current-context: c
        clusters: [{{name: c, cluster: {{server: "https://cloud:443"}}}}]
        contexts: [{{name: c, context: {{cluster: c, user: u}}}}]
        users:
        - name: u
          user:
            exec:
              apiVersion: client.authentication.k8s.io/v1
              command: {sys.executable}
              args: ["{plugin}"]
              interactiveMode: Never
        """,
    )
    monkeypatch.setenv("KUBECONFIG", str(config))
    endpoint = kubeconfig.load()
    assert endpoint.authorization() == "Bearer from-plugin"
    assert endpoint.server == "https://cloud:443"


def test_the_common_path_does_not_import_the_official_client(
    two_files: str, tmp_path: Path
) -> None:
    probe = (
        "import sys; from devbox.backends import kubernetes as k; "
        "from devbox.backends.kubernetes import kubeconfig; kubeconfig.load(); "
        "print('kubernetes' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe],
        env={"KUBECONFIG": two_files, "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.strip() == "False"
