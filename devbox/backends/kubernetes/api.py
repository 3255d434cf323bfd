"""Connecting to the cluster (kubeconfig, context, namespace), the paths of the objects
devbox uses, and turning the API server's refusals into one-line devbox errors."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from urllib.parse import quote

from devbox.backends.kubernetes import kubeconfig
from devbox.backends.kubernetes.rest import ApiError, Rest
from devbox.errors import DevboxError, UsageError


@dataclass
class Cluster:
    rest: Rest
    namespace: str
    context: str

    @property
    def endpoint(self) -> kubeconfig.Endpoint:
        return self.rest.endpoint

    # Paths in the box's namespace; `name` empty gives the collection.
    def pods(self, name: str = "") -> str:
        return self._path("api/v1", "pods", name)

    def claims(self, name: str = "") -> str:
        return self._path("api/v1", "persistentvolumeclaims", name)

    def events(self) -> str:
        return self._path("api/v1", "events", "")

    def config_maps(self, name: str = "") -> str:
        return self._path("api/v1", "configmaps", name)

    def leases(self, name: str = "") -> str:
        return self._path("apis/coordination.k8s.io/v1", "leases", name)

    def _path(self, group: str, kind: str, name: str) -> str:
        tail = f"/{quote(name)}" if name else ""
        return f"/{group}/namespaces/{quote(self.namespace)}/{kind}{tail}"


def connect(*, context: str = "", namespace: str = "", path: str = "") -> Cluster:
    """Credentials as kubectl finds them: $KUBECONFIG or ~/.kube/config, else in-cluster;
    `path`, a kubeconfig file of the cluster's own, instead of the first two."""
    endpoint = kubeconfig.load(context=context, path=path)
    return Cluster(
        rest=Rest(endpoint),
        namespace=namespace or endpoint.namespace,
        context=endpoint.context,
    )


@contextlib.contextmanager
def errors(cluster: Cluster) -> Iterator[None]:
    """Translate what the API server refuses into one line the user can act on. (An
    unreachable server already raises one: rest.Unreachable.)"""
    try:
        yield
    except ApiError as exc:
        if exc.status == 403 and "denied request: " in exc.message:
            # An admission policy (images/k8s/policies.yaml) said why; that is the line.
            why = exc.message.split("denied request: ", 1)[1]
            raise DevboxError(f"refused by the cluster's devbox policy: {why}") from None
        if exc.status == 403:
            raise DevboxError(f"forbidden by the cluster's RBAC: {exc.message}") from None
        if exc.status == 401:
            raise DevboxError(f"the API server rejected your credentials: {exc.message}") from None
        if exc.status == 404 and "namespace" in exc.message.lower():
            raise UsageError(f"namespace {cluster.namespace!r}: {exc.message}") from None
        raise DevboxError(f"Kubernetes API error {exc.status}: {exc.message}") from None
