"""Connecting to the cluster (kubeconfig, context, namespace) and turning the client's
failures into one-line devbox errors."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import urllib3
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException
from kubernetes.config.config_exception import ConfigException

from devbox.errors import DevboxError, UsageError


@dataclass
class Cluster:
    core: Any
    coord: Any
    namespace: str
    context: str
    api_client: Any


def connect(*, context: str = "", namespace: str = "") -> Cluster:
    """Load credentials as kubectl does: $KUBECONFIG or ~/.kube/config, else in-cluster."""
    configuration = client.Configuration()
    try:
        # Read $KUBECONFIG now: the client reads it once, when it is first imported.
        files = os.environ.get("KUBECONFIG") or os.path.expanduser("~/.kube/config")
        if os.environ.get("KUBECONFIG") or os.path.exists(files):
            config.load_kube_config(
                config_file=files, context=context or None, client_configuration=configuration
            )
            contexts, current = config.list_kube_config_contexts(config_file=files)
            chosen = next(
                (c for c in contexts if c["name"] == (context or current["name"])), current
            )
            default_ns = chosen.get("context", {}).get("namespace", "default")
            context_name = chosen["name"]
        else:
            config.load_incluster_config(client_configuration=configuration)
            context_name = "in-cluster"
            with open("/var/run/secrets/kubernetes.io/serviceaccount/namespace") as f:
                default_ns = f.read().strip()
    except ConfigException as exc:
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else "invalid kubeconfig"
        if context and "context" in text.lower():
            raise UsageError(f"no context {context!r} in your kubeconfig") from None
        raise UsageError(f"cannot load Kubernetes credentials: {text}") from None
    except (OSError, ValueError) as exc:
        raise UsageError(f"cannot load Kubernetes credentials: {exc}") from None
    # Fail fast on an unreachable API server instead of urllib3's long default retries.
    configuration.retries = urllib3.Retry(total=2, connect=2, read=0, backoff_factor=0.1)
    api_client = client.ApiClient(configuration)
    return Cluster(
        core=client.CoreV1Api(api_client),
        coord=client.CoordinationV1Api(api_client),
        namespace=namespace or default_ns or "default",
        context=context_name,
        api_client=api_client,
    )


def reason(exc: ApiException) -> str:
    """The API server's own message, which says exactly what was refused."""
    try:
        body = json.loads(exc.body or "{}")
        return str(body.get("message") or exc.reason)
    except (ValueError, TypeError):
        return str(exc.reason)


@contextlib.contextmanager
def errors(cluster: Cluster) -> Iterator[None]:
    """Translate what the client raises into one line the user can act on."""
    try:
        yield
    except ApiException as exc:
        if exc.status == 403:
            raise DevboxError(f"forbidden by the cluster's RBAC: {reason(exc)}") from None
        if exc.status == 401:
            raise DevboxError(f"the API server rejected your credentials: {reason(exc)}") from None
        if exc.status == 404 and "namespace" in reason(exc).lower():
            raise UsageError(f"namespace {cluster.namespace!r}: {reason(exc)}") from None
        raise DevboxError(f"Kubernetes API error {exc.status}: {reason(exc)}") from None
    except urllib3.exceptions.HTTPError as exc:
        host = cluster.api_client.configuration.host
        raise DevboxError(
            f"cannot reach the Kubernetes API server at {host}: {type(exc).__name__}"
        ) from None
