"""A small JSON client for the API server: the few verbs devbox uses, on one kept-alive
connection per thread, returning the API server's own JSON (plain dicts); and the switch
of that same connection to another protocol (the port-forward's WebSocket), so that a
claim and its session cost one TLS handshake.

Why not the official client: importing it costs 0.6-0.9 s per `devbox` command, most of a
warm claim. The API devbox needs is small and stable (pods, PVCs, leases, events, nodes),
so requests are plain HTTP here and objects stay as the API server wrote them.
"""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlencode, urlsplit

from devbox.backends.kubernetes import http1
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


@dataclass
class Switched:
    """The answer to a request to switch protocols: on 101 the socket, now the caller's,
    and the bytes of the new protocol already read; otherwise the refusal."""

    status: int
    reason: str
    sock: socket.socket | None = None
    pending: bytes = b""
    body: bytes = b""


class Rest:
    def __init__(self, endpoint: Endpoint) -> None:
        self.endpoint = endpoint
        url = urlsplit(endpoint.server)
        self._tls = url.scheme == "https"
        self._host = url.hostname or "localhost"
        self._port = url.port or (443 if self._tls else 80)
        self._netloc = url.netloc.rpartition("@")[2]
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
        headers = self._headers(content_type if data is not None else None)
        conn, head = self._exchange(method, self._url(path, query), headers, data)
        try:
            raw = conn.body(head, method=method)
        except OSError as exc:
            self._drop(conn)
            raise self._unreachable(exc) from None
        if not conn.reusable:
            self._drop(conn)
        return self._decode(head.status, raw)

    def switch(self, path: str, headers: dict[str, str]) -> Switched:
        """GET `path` asking to switch protocols (`headers`: Upgrade and its kind's own),
        on this thread's kept-alive connection: the TLS session the REST requests before
        it used. On 101 the connection leaves this client; the next request opens one."""
        target = self._url(path, None)
        conn, head = self._exchange("GET", target, self._headers(None, headers), None)
        if head.status != 101:
            try:
                body = conn.body(head)
            except OSError:
                body = b""
            self._drop(conn)
            return Switched(head.status, head.reason, body=body)
        self._local.conn = None
        sock, pending = conn.detach()
        sock.settimeout(None)
        return Switched(head.status, head.reason, sock=sock, pending=pending)

    def stream(self, path: str, *, timeout: float, **query: Any) -> Iterator[dict[str, Any]]:
        """A watch: one JSON object per line until the server ends it. Its own connection,
        so other requests of this thread go on meanwhile."""
        try:
            conn = self._new_connection(timeout=timeout)
        except OSError as exc:
            raise self._unreachable(exc) from None
        try:
            try:
                conn.send("GET", self._url(path, query), self._headers(None), None)
                head = conn.head()
                if head.status >= 400:
                    self._decode(head.status, conn.body(head))
                lines = conn.lines(head)
                while True:
                    line = next(lines, None)
                    if line is None:
                        return
                    if line.strip():
                        yield json.loads(line)
            except OSError as exc:
                raise self._unreachable(exc) from None
        finally:
            conn.close()

    # --- plumbing ---------------------------------------------------------------------

    def _exchange(
        self, method: str, target: str, headers: dict[str, str], data: bytes | None
    ) -> tuple[http1.Connection, http1.Head]:
        """Sends the request and reads its answer's head. A kept-alive connection the
        server closed in between fails on first use; a fresh one is tried once before
        calling the server unreachable."""
        for attempt in (0, 1):
            conn: http1.Connection | None = None
            try:
                conn = self._connection(fresh=attempt == 1)
                conn.send(method, target, headers, data)
                return conn, conn.head()
            except OSError as exc:
                if conn is not None:
                    self._drop(conn)
                if attempt == 1 or isinstance(exc, (ConnectionRefusedError, socket.timeout)):
                    raise self._unreachable(exc) from None
        raise AssertionError("unreachable")  # the loop returns or raises

    def _url(self, path: str, query: dict[str, Any] | None) -> str:
        pairs = {k: v for k, v in (query or {}).items() if v not in (None, "")}
        return self._prefix + path + (f"?{urlencode(pairs)}" if pairs else "")

    def _headers(
        self, content_type: str | None, extra: dict[str, str] | None = None
    ) -> dict[str, str]:
        headers = {"Host": self._netloc, "User-Agent": "devbox"}
        if extra is None:  # a switch of protocols accepts no JSON (the API server: 406)
            headers["Accept"] = "application/json"
            headers["Accept-Encoding"] = "identity"
        if content_type:
            headers["Content-Type"] = content_type
        headers.update(extra or {})
        auth = self.endpoint.authorization()
        if auth:
            headers["Authorization"] = auth
        return headers

    def _connection(self, *, fresh: bool) -> http1.Connection:
        conn: http1.Connection | None = getattr(self._local, "conn", None)
        if conn is None or fresh or not conn.reusable:
            conn = self._local.conn = self._new_connection(timeout=TIMEOUT)
        return conn

    def _drop(self, conn: http1.Connection) -> None:
        conn.close()
        if getattr(self._local, "conn", None) is conn:
            self._local.conn = None

    def _new_connection(self, *, timeout: float) -> http1.Connection:
        return http1.connect(
            self._host,
            self._port,
            context=self.endpoint.ssl_context() if self._tls else None,
            # tls-server-name names the certificate's host where it is not the one dialled.
            server_name=self.endpoint.tls_server_name or self._host,
            timeout=timeout,
        )

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
            raise ApiError(status, str(message or REASONS.get(status, status)))
        return doc if isinstance(doc, dict) else {}


# The reason phrases of the statuses the API server answers without a Status body.
REASONS = {
    400: "Bad Request",
    401: "Unauthorized",
    403: "Forbidden",
    404: "Not Found",
    405: "Method Not Allowed",
    409: "Conflict",
    410: "Gone",
    413: "Request Entity Too Large",
    415: "Unsupported Media Type",
    422: "Unprocessable Entity",
    429: "Too Many Requests",
    500: "Internal Server Error",
    502: "Bad Gateway",
    503: "Service Unavailable",
    504: "Gateway Timeout",
}
