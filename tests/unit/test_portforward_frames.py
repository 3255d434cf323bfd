from __future__ import annotations

import struct

import pytest

from devbox.backends.kubernetes.portforward import _frame, _mask


def _unframe(frame: bytes) -> tuple[int, bytes]:
    b1, b2 = frame[0], frame[1]
    n, at = b2 & 0x7F, 2
    if n == 126:
        n, at = struct.unpack("!H", frame[2:4])[0], 4
    elif n == 127:
        n, at = struct.unpack("!Q", frame[2:10])[0], 10
    assert b2 & 0x80, "client frames must be masked (RFC 6455 5.3)"
    key = frame[at : at + 4]
    payload = frame[at + 4 :]
    assert len(payload) == n
    return b1 & 0x0F, _mask(payload, key)


@pytest.mark.parametrize("size", [0, 1, 125, 126, 65535, 65536, 300_000])
def test_frames_round_trip_at_every_length_encoding(size: int) -> None:
    payload = bytes(i % 251 for i in range(size))
    opcode, back = _unframe(_frame(payload))
    assert opcode == 0x2 and back == payload


def test_mask_is_an_involution_with_leading_zero_bytes() -> None:
    data = b"\x00\x00\x00abc\x00"
    assert _mask(_mask(data, b"\x01\x02\x03\x04"), b"\x01\x02\x03\x04") == data


def test_the_proxys_pipes_are_widened_and_other_fds_left_alone() -> None:
    import fcntl
    import os
    import socket

    from devbox.backends.kubernetes.portforward import widen_pipes

    get_size = getattr(fcntl, "F_GETPIPE_SZ", 1032)
    read, write = os.pipe()
    a, b = socket.socketpair()
    try:
        before = fcntl.fcntl(read, get_size)
        widen_pipes(read, a.fileno())  # a socket is not a pipe: no error, nothing changed
        assert before < 1 << 20 and fcntl.fcntl(write, get_size) == 1 << 20
    finally:
        for fd in (read, write):
            os.close(fd)
        a.close()
        b.close()


def test_loopback_joins_its_first_connection_to_the_socket() -> None:
    import socket

    from devbox.ssh.proxy import loopback

    box_side, ours = socket.socketpair()
    port = loopback(ours, timeout=10)
    client = socket.create_connection(("127.0.0.1", port), timeout=10)
    box_side.settimeout(10)
    try:
        client.sendall(b"to the box")
        assert box_side.recv(100) == b"to the box"
        box_side.sendall(b"to ssh")
        assert client.recv(100) == b"to ssh"
        client.shutdown(socket.SHUT_WR)  # ssh ends: the box's side sees the end too
        assert box_side.recv(100) == b""
    finally:
        client.close()
        box_side.close()
