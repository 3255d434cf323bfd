"""The port-forward's pump (devbox.backends.kubernetes.tunnel) against a scripted API
server on a socketpair: channel framing, bytes read with the 101, pings, large frames in
both directions, the error channel, and both ways a tunnel ends. No cluster needed."""

from __future__ import annotations

import os
import socket
import struct
import threading

from devbox.backends.kubernetes.tunnel import Pump, mask


def server_frame(payload: bytes, opcode: int = 0x2) -> bytes:
    """As the API server writes them: unmasked."""
    n = len(payload)
    if n < 126:
        head = struct.pack("!BB", 0x80 | opcode, n)
    elif n < 1 << 16:
        head = struct.pack("!BBH", 0x80 | opcode, 126, n)
    else:
        head = struct.pack("!BBQ", 0x80 | opcode, 127, n)
    return head + payload


def read_client_frame(sock: socket.socket) -> tuple[int, bytes]:
    def exactly(n: int) -> bytes:
        data = b""
        while len(data) < n:
            chunk = sock.recv(n - len(data))
            assert chunk, "closed mid-frame"
            data += chunk
        return data

    b1, b2 = exactly(2)
    assert b2 & 0x80, "a client's frames are masked"
    n = b2 & 0x7F
    if n == 126:
        n = struct.unpack("!H", exactly(2))[0]
    elif n == 127:
        n = struct.unpack("!Q", exactly(8))[0]
    key = exactly(4)
    return b1 & 0x0F, mask(exactly(n), key)


OPENING = server_frame(b"\x00\xae\x08") + server_frame(b"\x01\xae\x08")  # port 2222


def start(pending: bytes = b"") -> tuple[socket.socket, socket.socket, threading.Thread]:
    """(the API server's end, the local user's end, the pump's thread)."""
    server, wire = socket.socketpair()
    user, local = socket.socketpair()

    def run() -> None:
        try:
            Pump(wire, pending, local.fileno(), local.fileno()).run()
        finally:
            local.close()
            wire.close()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    server.settimeout(10)
    user.settimeout(10)
    return server, user, thread


def recv_exactly(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        assert chunk, f"closed after {len(data)} of {n} bytes"
        data += chunk
    return data


def test_data_both_ways_with_the_opening_frames_read_along_with_the_101() -> None:
    # The opening frames and the first data came in the same read as the 101's head.
    server, user, thread = start(pending=OPENING + server_frame(b"\x00SSH-2.0-agent\r\n"))
    assert recv_exactly(user, 15) == b"SSH-2.0-agent\r\n"
    user.sendall(b"SSH-2.0-OpenSSH\r\n")
    assert read_client_frame(server) == (0x2, b"\x00SSH-2.0-OpenSSH\r\n")
    server.sendall(server_frame(b"\x00more"))
    assert recv_exactly(user, 4) == b"more"
    user.close()  # ssh is done: the port-forward closes
    assert read_client_frame(server)[0] == 0x8
    thread.join(10)
    assert not thread.is_alive()


def test_a_ping_is_answered_and_split_frames_are_joined() -> None:
    server, user, thread = start(pending=OPENING)
    server.sendall(server_frame(b"are you there", 0x9))
    assert read_client_frame(server) == (0xA, b"are you there")
    whole = server_frame(b"\x00" + b"x" * 70_000)  # a 64-bit length, sent in pieces
    for at in range(0, len(whole), 999):
        server.sendall(whole[at : at + 999])
    assert recv_exactly(user, 70_000) == b"x" * 70_000
    server.close()  # the API server went away: the local side sees the end
    assert user.recv(1) == b""
    thread.join(10)


def test_megabytes_both_ways_at_once() -> None:
    """Neither direction waits on the other: the pump reads one side while the other
    is full (a deadlock here would hang the test, not fail it slowly)."""
    server, user, thread = start(pending=OPENING)
    size = 8 << 20
    down = os.urandom(1 << 16) * (size >> 16)
    up = os.urandom(1 << 16) * (size >> 16)
    got_up = bytearray()

    def serve() -> None:
        for at in range(0, size, 32 * 1024):
            server.sendall(server_frame(b"\x00" + down[at : at + 32 * 1024]))
        while len(got_up) < size:
            opcode, payload = read_client_frame(server)
            assert opcode == 0x2 and payload[0] == 0
            got_up.extend(payload[1:])

    def send_up() -> None:
        user.sendall(up)

    threads = [threading.Thread(target=serve), threading.Thread(target=send_up)]
    for t in threads:
        t.start()
    got_down = recv_exactly(user, size)
    for t in threads:
        t.join(60)
    assert got_down == down and bytes(got_up) == up
    user.close()
    thread.join(10)


def test_the_error_channel_ends_the_tunnel_after_what_came_before() -> None:
    server, user, thread = start(pending=OPENING)
    server.sendall(server_frame(b"\x00last words") + server_frame(b"\x01connection refused"))
    assert recv_exactly(user, 10) == b"last words"
    assert user.recv(1) == b""
    thread.join(10)
    assert not thread.is_alive()


def test_a_close_frame_ends_it() -> None:
    server, user, thread = start(pending=OPENING)
    server.sendall(server_frame(b"\x00bye") + server_frame(b"", 0x8))
    assert recv_exactly(user, 3) == b"bye"
    assert user.recv(1) == b""
    thread.join(10)
