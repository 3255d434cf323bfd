"""The REST client's HTTP/1.1 (devbox.backends.kubernetes.http1 and rest.Rest) against a
scripted server on loopback: bodies of every framing the API server uses, kept-alive
reuse, a server that closed the kept-alive connection, and the switch to another
protocol keeping the bytes that came with the 101. No cluster needed."""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterator

import pytest

from devbox.backends.kubernetes import http1
from devbox.backends.kubernetes.kubeconfig import Endpoint
from devbox.backends.kubernetes.rest import ApiError, Rest, Unreachable

Handler = Callable[[socket.socket, int], None]


class Server:
    """Accepts connections on loopback; `handler(conn, index)` answers each in a thread."""

    def __init__(self, handler: Handler) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.accepted = 0
        self.requests: list[bytes] = []
        self.handler = handler
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            index = self.accepted
            self.accepted += 1
            threading.Thread(target=self.handler, args=(conn, index), daemon=True).start()

    def read_request(self, conn: socket.socket) -> bytes:
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = conn.recv(65536)
            if not chunk:
                return b""
            data += chunk
        head, _, body = data.partition(b"\r\n\r\n")
        for line in head.split(b"\r\n"):
            if line.lower().startswith(b"content-length:"):
                while len(body) < int(line.split(b":")[1]):
                    body += conn.recv(65536)
        self.requests.append(head)
        return head


@pytest.fixture
def serve() -> Iterator[Callable[[Handler], Server]]:
    made: list[Server] = []

    def start(handler: Handler) -> Server:
        made.append(Server(handler))
        return made[-1]

    yield start
    for server in made:
        server.listener.shutdown(socket.SHUT_RDWR)  # wakes its accept()
        server.listener.close()


def rest_for(server: Server) -> Rest:
    return Rest(Endpoint(server=f"http://127.0.0.1:{server.port}", context="t", namespace="ns"))


def test_bodies_by_length_and_chunked_on_one_kept_alive_connection(
    serve: Callable[[Handler], Server],
) -> None:
    def handler(conn: socket.socket, _: int) -> None:
        server.read_request(conn)
        conn.sendall(b'HTTP/1.1 200 OK\r\nContent-Length: 11\r\n\r\n{"a": "b"}\n')
        server.read_request(conn)
        conn.sendall(
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
            b'5\r\n{"c":\r\n4;ext=1\r\n "d"\r\n1\r\n}\r\n0\r\n\r\n'
        )
        server.read_request(conn)
        conn.sendall(b'HTTP/1.1 404 Not Found\r\nContent-Length: 22\r\n\r\n{"message": "no such"}')
        conn.recv(1)

    server = serve(handler)
    rest = rest_for(server)
    assert rest.get("/one") == {"a": "b"}
    assert rest.patch("/two", {"x": 1}) == {"c": "d"}
    with pytest.raises(ApiError) as refused:
        rest.get("/three", labelSelector="a in (,b)")
    assert refused.value.status == 404 and refused.value.message == "no such"
    assert server.accepted == 1, "three requests, one connection"
    assert server.requests[1].startswith(b"PATCH /two HTTP/1.1")
    assert b"Content-Type: application/merge-patch+json" in server.requests[1]
    assert server.requests[2].startswith(b"GET /three?labelSelector=a+in+%28%2Cb%29 HTTP/1.1")


def test_a_kept_alive_connection_the_server_closed_is_replaced_once(
    serve: Callable[[Handler], Server],
) -> None:
    def handler(conn: socket.socket, index: int) -> None:
        server.read_request(conn)
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}")
        if index == 0:
            conn.close()  # idle timeout: the client learns of it on its next request
            return
        server.read_request(conn)

    server = serve(handler)
    rest = rest_for(server)
    assert rest.get("/a") == {}
    assert rest.get("/b") == {}
    assert server.accepted == 2


def test_connection_close_is_honoured_and_a_dead_server_is_unreachable(
    serve: Callable[[Handler], Server],
) -> None:
    def handler(conn: socket.socket, _: int) -> None:
        server.read_request(conn)
        conn.sendall(b'HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n{"until": "closed"}')
        conn.close()

    server = serve(handler)
    rest = rest_for(server)
    assert rest.get("/a") == {"until": "closed"}
    assert rest.get("/b") == {"until": "closed"}
    assert server.accepted == 2
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))  # bound, never listening: refused
        nobody = Endpoint(
            server=f"http://127.0.0.1:{unused.getsockname()[1]}", context="t", namespace="ns"
        )
        with pytest.raises(Unreachable):
            Rest(nobody).get("/c")


def test_the_switch_hands_over_the_socket_with_the_bytes_that_came_with_the_101(
    serve: Callable[[Handler], Server],
) -> None:
    def handler(conn: socket.socket, index: int) -> None:
        server.read_request(conn)
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}")
        server.read_request(conn)
        # The new protocol's first bytes in the same segment as the 101's head.
        conn.sendall(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\n\r\nFIRST")
        assert conn.recv(100) == b"ping"
        conn.sendall(b"pong")
        conn.recv(1)

    server = serve(handler)
    rest = rest_for(server)
    assert rest.get("/pods") == {}
    switched = rest.switch("/pods/x/portforward", {"Upgrade": "websocket"})
    assert switched.status == 101 and switched.sock is not None
    assert switched.pending == b"FIRST"
    switched.sock.sendall(b"ping")
    assert switched.sock.recv(100) == b"pong"
    assert server.accepted == 1, "the REST request's connection was the one switched"
    assert b"Upgrade: websocket" in server.requests[1]
    switched.sock.close()


def test_a_refused_switch_says_why_and_the_next_request_connects_anew(
    serve: Callable[[Handler], Server],
) -> None:
    def handler(conn: socket.socket, _: int) -> None:
        while server.read_request(conn):
            if len(server.requests) == 1:
                conn.sendall(b"HTTP/1.1 403 Forbidden\r\nContent-Length: 6\r\n\r\nno way")
            else:
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}")

    server = serve(handler)
    rest = rest_for(server)
    switched = rest.switch("/pods/x/portforward", {"Upgrade": "websocket"})
    assert (switched.status, switched.reason, switched.body) == (403, "Forbidden", b"no way")
    assert switched.sock is None
    assert rest.get("/pods") == {}


def test_watch_lines_across_chunks() -> None:
    ours, theirs = socket.socketpair()
    conn = http1.Connection(ours)
    theirs.sendall(
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
        b'6\r\n{"a":1\r\n4\r\n}\n{"\r\n7\r\nb":2}\n\n\r\n3\r\n{}\n\r\n0\r\n\r\n'
    )
    head = conn.head()
    assert list(conn.lines(head)) == [b'{"a":1}', b'{"b":2}', b"", b"{}"]
    assert conn.reusable
    ours.close()
    theirs.close()


def test_interim_answers_are_skipped_and_garbage_is_a_protocol_error() -> None:
    ours, theirs = socket.socketpair()
    conn = http1.Connection(ours)
    theirs.sendall(
        b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 201 Created\r\nContent-Length: 0\r\n\r\n"
    )
    head = conn.head()
    assert head.status == 201 and conn.body(head) == b""
    theirs.sendall(b"SSH-2.0-OpenSSH\r\n\r\n")
    with pytest.raises(http1.ProtocolError):
        conn.head()
    ours.close()
    theirs.close()
