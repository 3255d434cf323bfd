"""A small JSON client for the API server: the few verbs devbox uses, on one kept-alive
connection per thread, returning the API server's own JSON (plain dicts).

Why not the official client: importing it costs 0.6-0.9 s per `devbox` command, most of a
warm claim. The API devbox needs is small and stable (pods, PVCs, leases, events, nodes),
so requests are plain HTTP here and objects stay as the API server wrote them.
"""

from __future__ import annotations

import http.client
import json
import socket
import threading
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlencode, urlsplit

from devbox.backends.kubernetes.kubeconfig import Endpoint
from devbox.errors import DevboxError

TIMEOUT = 30.0  # seconds for one request; a watch sets its own
MERGE_PATCH = "application/merge-patch+json"


class ApiError(DevboxError):
    """The API server answered with an error status."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class Unreachable(DevboxError):
    """No answer at all: refused, reset, timed out, TLS failed."""


class Rest:
    def __init__(self, endpoint: Endpoint) -> None:
        self.endpoint = endpoint
        url = urlsplit(endpoint.server)
        self._tls = url.scheme == "https"
        self._host = url.hostname or "localhost"
        self._port = url.port or (443 if self._tls else 80)
        self._prefix = url.path.rstrip("/")
        self._local = threading.local()

    # --- verbs ------------------------------------------------------------------------

    def get(self, path: str, **query: Any) -> dict[str, Any]:
        return self.request("GET", path, query=query)

    def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        return self.request("POST", path, body=body)

    def patch(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        return self.request("PATCH", path, body=body, content_type=MERGE_PATCH)

    def delete(self, path: str, *, body: dict[str, Any] | None = None) -> dict[str, Any]:
        return self.request("DELETE", path, body=body)

    def request(
        self,
        method: str,
        path: str,
        *,
        query: dict[str, Any] | None = None,
        body: dict[str, Any] | None = None,
        content_type: str = "application/json",
    ) -> dict[str, Any]:
        data = json.dumps(body).encode() if body is not None else None
        # A kept-alive connection the server closed in between fails on first use; a fresh
        # one is tried once before calling the server unreachable.
        for attempt in (0, 1):
            conn = self._connection(fresh=attempt == 1)
            try:
                conn.request(method, self._url(path, query), data, self._headers(content_type))
                response = conn.getresponse()
                raw = response.read()
                break
            except (OSError, http.client.HTTPException) as exc:
                conn.close()
                if attempt == 1 or isinstance(exc, (ConnectionRefusedError, socket.timeout)):
                    raise self._unreachable(exc) from None
        return self._decode(response.status, raw)

    def stream(self, path: str, *, timeout: float, **query: Any) -> Iterator[dict[str, Any]]:
        """A watch: one JSON object per line until the server ends it. Its own connection,
        so other requests of this thread go on meanwhile."""
        conn = self._new_connection(timeout=timeout)
        try:
            try:
                conn.request("GET", self._url(path, query), None, self._headers(None))
                response = conn.getresponse()
            except (OSError, http.client.HTTPException) as exc:
                raise self._unreachable(exc) from None
            if response.status >= 400:
                self._decode(response.status, response.read())
            while True:
                try:
                    line = response.readline()
                except (OSError, http.client.HTTPException) as exc:
                    raise self._unreachable(exc) from None
                if not line:
                    return
                if line.strip():
                    yield json.loads(line)
        finally:
            conn.close()

    # --- plumbing ---------------------------------------------------------------------

    def _url(self, path: str, query: dict[str, Any] | None) -> str:
        pairs = {k: v for k, v in (query or {}).items() if v not in (None, "")}
        return self._prefix + path + (f"?{urlencode(pairs)}" if pairs else "")

    def _headers(self, content_type: str | None) -> dict[str, str]:
        headers = {"Accept": "application/json", "User-Agent": "devbox"}
        if content_type:
            headers["Content-Type"] = content_type
        auth = self.endpoint.authorization()
        if auth:
            headers["Authorization"] = auth
        return headers

    def _connection(self, *, fresh: bool) -> http.client.HTTPConnection:
        conn: http.client.HTTPConnection | None = getattr(self._local, "conn", None)
        if conn is None or fresh:
            conn = self._local.conn = self._new_connection(timeout=TIMEOUT)
        return conn

    def _new_connection(self, *, timeout: float) -> http.client.HTTPConnection:
        if not self._tls:
            return http.client.HTTPConnection(self._host, self._port, timeout=timeout)
        ctx = self.endpoint.ssl_context()
        conn = http.client.HTTPSConnection(self._host, self._port, timeout=timeout, context=ctx)
        if self.endpoint.tls_server_name:
            # http.client checks the certificate against the host it dials; tls-server-name
            # names the one the certificate carries instead.
            name = self.endpoint.tls_server_name

            def connect() -> None:
                http.client.HTTPConnection.connect(conn)
                conn.sock = ctx.wrap_socket(conn.sock, server_hostname=name)

            conn.connect = connect  # type: ignore[method-assign]
        return conn

    def _unreachable(self, exc: BaseException) -> Unreachable:
        return Unreachable(
            f"cannot reach the Kubernetes API server at {self.endpoint.server}: "
            f"{type(exc).__name__}"
        )

    @staticmethod
    def _decode(status: int, raw: bytes) -> dict[str, Any]:
        try:
            doc = json.loads(raw) if raw else {}
        except ValueError:
            doc = {"message": raw[:200].decode(errors="replace")}
        if status >= 400:
            message = doc.get("message") if isinstance(doc, dict) else None
            raise ApiError(status, str(message or http.client.responses.get(status, status)))
        return doc if isinstance(doc, dict) else {}
