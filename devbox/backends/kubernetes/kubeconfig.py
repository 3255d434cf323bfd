"""Where the API server is and how to prove who we are: kubeconfig (as kubectl reads it) or
the pod's service account.

Read here rather than through the official client because importing `kubernetes` costs
0.6-0.9 s, more than the rest of a warm claim (benchmarks/bench_k8s.py). Certificates and
bearer tokens, the kinds kubeadm, kind, k3s and service accounts hand out, are read here;
a kubeconfig whose user runs an exec plugin or an auth provider (cloud logins) is handed to
the official client's loader, which knows them all.
"""

from __future__ import annotations

import base64
import contextlib
import os
import ssl
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from devbox.backends.kubernetes import blockyaml
from devbox.errors import UsageError

SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")


@dataclass(frozen=True)
class Endpoint:
    """One API server and one identity on it."""

    server: str  # https://host:port[/prefix]
    context: str
    namespace: str  # the context's default; "default" when it names none
    ca_pem: str = ""  # PEM text; empty: the system's trust store
    insecure: bool = False
    tls_server_name: str = ""
    cert_pem: bytes = b""
    key_pem: bytes = b""
    token: str = ""
    _ssl: list[ssl.SSLContext] = field(default_factory=list, compare=False, repr=False)

    def ssl_context(self) -> ssl.SSLContext:
        """Built once: loading a chain parses keys, which is worth doing only once."""
        if not self._ssl:
            self._ssl.append(self._build_ssl())
        return self._ssl[0]

    def _build_ssl(self) -> ssl.SSLContext:
        ctx = ssl.create_default_context(cadata=self.ca_pem or None)
        if self.insecure:
            ctx.check_hostname = False
            ctx.verify_mode = ssl.CERT_NONE
        if self.cert_pem:
            with _pem_file(self.cert_pem + b"\n" + self.key_pem) as path:
                ctx.load_cert_chain(path)
        return ctx

    def authorization(self) -> str:
        return f"Bearer {self.token}" if self.token else ""


@contextlib.contextmanager
def _pem_file(data: bytes) -> Iterator[str]:
    """A path to `data` for as long as the block runs. The ssl module loads a chain only
    from a file: on Linux one that lives in memory alone (the key never touches a disk,
    and tempfile's imports stay out of every command), else a private temporary file."""
    memfd = getattr(os, "memfd_create", None)
    if memfd is not None and os.path.isdir("/proc/self/fd"):
        fd = memfd("devbox-kube-pem", getattr(os, "MFD_CLOEXEC", 0))
        try:
            os.write(fd, data)
            yield f"/proc/self/fd/{fd}"
        finally:
            os.close(fd)
        return
    import tempfile

    with tempfile.NamedTemporaryFile(prefix="devbox-kube-", suffix=".pem") as f:
        f.write(data)
        f.flush()
        yield f.name


def load(*, context: str = "", path: str = "") -> Endpoint:
    """`path` (a cluster's own kubeconfig file), else $KUBECONFIG (a list of files, merged
    as kubectl does) or ~/.kube/config, else the pod's service account. Raises UsageError
    with one line when nothing usable is found."""
    listed = path or os.environ.get("KUBECONFIG", "")
    files = [Path(f).expanduser() for f in listed.split(os.pathsep) if f]
    if not listed:
        default = Path("~/.kube/config").expanduser()
        if default.exists() or not SERVICE_ACCOUNT.exists():
            files = [default]
    if not files:
        return _in_cluster()
    try:
        merged = _merge(files)
    except OSError as exc:
        raise UsageError(f"cannot load Kubernetes credentials: {exc}") from None
    except ValueError as exc:
        raise UsageError(f"cannot load Kubernetes credentials: {exc}") from None
    return _from_config(merged, context=context, path=path)


def _merge(files: list[Path]) -> dict[str, Any]:
    """kubectl's rule: the first file that sets a value (or defines a named entry) wins."""
    out: dict[str, Any] = {"clusters": {}, "users": {}, "contexts": {}, "current-context": ""}
    for path in files:
        if not path.exists():
            if len(files) == 1:
                raise OSError(f"no kubeconfig at {path}")
            continue
        doc = _parse(path) or {}
        if not isinstance(doc, dict):
            raise ValueError(f"{path} is not a kubeconfig")
        base = path.parent
        for kind, inner in (("clusters", "cluster"), ("users", "user"), ("contexts", "context")):
            for entry in doc.get(kind) or []:
                if isinstance(entry, dict) and entry.get("name") not in out[kind]:
                    out[kind][entry["name"]] = (entry.get(inner) or {}, base)
        if not out["current-context"]:
            out["current-context"] = doc.get("current-context") or ""
    return out


def _parse(path: Path) -> Any:
    """The file's YAML: the block style kubectl writes is read here (blockyaml), anything
    else by PyYAML (the kubernetes client's own dependency), imported only then."""
    text = path.read_text()
    try:
        return blockyaml.load(text)
    except blockyaml.Unsupported:
        pass
    import yaml

    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ValueError(f"{path} is not valid YAML ({type(exc).__name__})") from None


def _from_config(merged: dict[str, Any], *, context: str, path: str = "") -> Endpoint:
    name = context or merged["current-context"]
    if not name:
        raise UsageError("cannot load Kubernetes credentials: your kubeconfig sets no context")
    if name not in merged["contexts"]:
        if context:
            raise UsageError(f"no context {context!r} in your kubeconfig")
        raise UsageError(f"cannot load Kubernetes credentials: no context {name!r}")
    ctx, _ = merged["contexts"][name]
    cluster_name, user_name = ctx.get("cluster", ""), ctx.get("user", "")
    if cluster_name not in merged["clusters"]:
        raise UsageError(f"cannot load Kubernetes credentials: no cluster {cluster_name!r}")
    cluster, cluster_base = merged["clusters"][cluster_name]
    user, user_base = merged["users"].get(user_name, ({}, Path(".")))
    namespace = ctx.get("namespace") or "default"
    if not cluster.get("server"):
        raise UsageError(f"cannot load Kubernetes credentials: {cluster_name!r} has no server")
    if any(key in user for key in ("exec", "auth-provider", "username")):
        return _official(name, namespace, path)
    try:
        return Endpoint(
            server=str(cluster["server"]).rstrip("/"),
            context=name,
            namespace=namespace,
            ca_pem=_text(cluster, "certificate-authority", cluster_base),
            insecure=bool(cluster.get("insecure-skip-tls-verify")),
            tls_server_name=str(cluster.get("tls-server-name") or ""),
            cert_pem=_text(user, "client-certificate", user_base).encode(),
            key_pem=_text(user, "client-key", user_base).encode(),
            token=str(user.get("token") or "")
            or _text(user, "tokenFile", user_base, data=False).strip(),
        )
    except (OSError, ValueError) as exc:
        raise UsageError(f"cannot load Kubernetes credentials: {exc}") from None


def _text(entry: dict[str, Any], key: str, base: Path, *, data: bool = True) -> str:
    """`key-data` (base64) or the file `key` names, relative to its kubeconfig."""
    if data and entry.get(f"{key}-data"):
        return base64.b64decode(entry[f"{key}-data"]).decode()
    if entry.get(key):
        return (base / Path(entry[key]).expanduser()).read_text()
    return ""


def _in_cluster() -> Endpoint:
    host = os.environ.get("KUBERNETES_SERVICE_HOST")
    port = os.environ.get("KUBERNETES_SERVICE_PORT")
    if not host or not port:
        raise UsageError(
            "cannot load Kubernetes credentials: no kubeconfig (~/.kube/config, $KUBECONFIG) "
            "and not running in a pod"
        )
    try:
        return Endpoint(
            server=f"https://{f'[{host}]' if ':' in host else host}:{port}",
            context="in-cluster",
            namespace=(SERVICE_ACCOUNT / "namespace").read_text().strip() or "default",
            ca_pem=(SERVICE_ACCOUNT / "ca.crt").read_text(),
            token=(SERVICE_ACCOUNT / "token").read_text().strip(),
        )
    except OSError as exc:
        raise UsageError(f"cannot load Kubernetes credentials: {exc}") from None


def _official(context: str, namespace: str, path: str = "") -> Endpoint:
    """Exec plugins and auth providers, through the official client's loader."""
    from kubernetes import client, config
    from kubernetes.config.config_exception import ConfigException

    configuration = client.Configuration()
    try:
        config.load_kube_config(
            config_file=str(Path(path).expanduser()) if path else None,
            context=context,
            client_configuration=configuration,
        )
    except (ConfigException, OSError, ValueError) as exc:
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else "invalid kubeconfig"
        raise UsageError(f"cannot load Kubernetes credentials: {text}") from None
    token = ""
    for key in ("authorization", "BearerToken"):
        value = (configuration.api_key or {}).get(key)
        if value:
            token = str(value).removeprefix("Bearer ").strip()
            break

    def read(path: str | None) -> bytes:
        return Path(path).read_bytes() if path else b""

    return Endpoint(
        server=str(configuration.host).rstrip("/"),
        context=context,
        namespace=namespace,
        ca_pem=read(configuration.ssl_ca_cert).decode(),
        insecure=not configuration.verify_ssl,
        tls_server_name=str(configuration.tls_server_name or ""),
        cert_pem=read(configuration.cert_file),
        key_pem=read(configuration.key_file),
        token=token,
    )
