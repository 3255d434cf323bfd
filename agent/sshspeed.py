"""What the agent changes in asyncssh for bulk transfers (benchmarks/bench_throughput.py):
a 32 KiB packet each way at 200-300 MB/s is 10,000 packets a second, so microseconds per
packet are a good part of a core, on the agent's side and on the client's.

- The cipher OpenSSH's client takes. It takes the first of its own list that the server
  offers: chacha20-poly1305 (slow in asyncssh), then AES-CTR, and AES-GCM only after
  those. With CTR it needs a MAC too, and on a CPU with AES-NI that pair cost OpenSSH's
  client 1.9-2.2 ms of CPU a MiB against 1.1 for AES-GCM (chacha20-poly1305: 1.7-2.0),
  and the agent a MAC per packet besides. So an OpenSSH client (>= 6.2 has AES-GCM) is
  offered AES-GCM alone; every other client (paramiko < 3.5, older Go and JSch have no
  GCM) the whole list.
- asyncssh sends an empty SSH_MSG_IGNORE before every packet once encryption is on: the
  old countermeasure against CBC mode's predictable IV. The agent offers no CBC cipher
  (only AES-CTR and AES-GCM: agent.server), so it buys nothing here and doubled the
  packets: an encryption, a MAC, a random pad and a send() each.
- asyncssh keeps what it has received and not yet parsed in one bytes object, and slices
  the rest off it after every packet: asyncio's reads of up to 256 KiB (eight 32 KiB
  packets) were copied about four times over, each copy above 128 KiB a fresh mmap and
  its page faults (a fifth of the agent's CPU in an upload, perf). Fed to it in 64 KiB
  slices, the rest it copies is under a packet.

asyncssh names relied on (pyproject.toml pins asyncssh's range for the private ones):
SSHServerConnection.send_packet(pkttype, *args, handler=None), through which asyncssh
itself sends the IGNORE, and asyncssh.constants.MSG_IGNORE; SSHServerConnection.
data_received(data, datatype=None), asyncio's protocol method, which takes any bytes-like
object (it appends it to its buffer with +=); private:
SSHServerConnection._send_kexinit(), which asyncssh calls once the client's version line
is in (get_extra_info("client_version")), for the first and every later key exchange,
and its list self._enc_algs, which both the KEXINIT and the choice of cipher read.
"""

from __future__ import annotations

import re
from typing import Any

import asyncssh
from asyncssh.constants import MSG_IGNORE

_MARK = "_devbox_patched"  # on what install() put in place: it is put once


def install(*, openssh_ciphers: list[str]) -> None:
    """Apply all three, once per process (the agent calls it where it sets up its server);
    `openssh_ciphers` is what an OpenSSH client is offered."""
    _offer_openssh(openssh_ciphers)
    _skip_ignore_packets()
    _feed_in_slices()


# OpenSSH's version line: "SSH-2.0-OpenSSH_9.2p1 Debian-2", "SSH-2.0-OpenSSH_for_Windows_8.1".
_OPENSSH = re.compile(r"SSH-2\.0-OpenSSH_(?:for_Windows_)?(\d+)\.(\d+)")
_OPENSSH_GCM = (6, 2)  # the first OpenSSH with aes128-gcm@openssh.com


def has_aes_gcm(client_version: str | None) -> bool:
    """Whether a client's version line is an OpenSSH's that has AES-GCM."""
    match = _OPENSSH.match(client_version or "")
    return match is not None and (int(match[1]), int(match[2])) >= _OPENSSH_GCM


def _offer_openssh(ciphers: list[str]) -> None:
    cls: Any = asyncssh.SSHServerConnection
    if getattr(cls._send_kexinit, _MARK, False):
        return
    send_kexinit = cls._send_kexinit
    offer = [name.encode() for name in ciphers]

    def _send_kexinit(self: Any) -> None:
        if has_aes_gcm(self.get_extra_info("client_version")):
            self._enc_algs = offer
        send_kexinit(self)

    setattr(_send_kexinit, _MARK, True)
    cls._send_kexinit = _send_kexinit


def _skip_ignore_packets() -> None:
    cls: Any = asyncssh.SSHServerConnection
    if getattr(cls.send_packet, _MARK, False):
        return
    send = cls.send_packet

    def send_packet(self: Any, pkttype: int, *args: bytes, handler: Any = None) -> None:
        if pkttype != MSG_IGNORE:  # the agent itself never sends one
            send(self, pkttype, *args, handler=handler)

    setattr(send_packet, _MARK, True)
    cls.send_packet = send_packet


# Under glibc's mmap threshold (128 KiB): every copy of the input buffer stays on the heap.
_SLICE = 64 * 1024


def _feed_in_slices() -> None:
    cls: Any = asyncssh.SSHServerConnection
    if getattr(cls.data_received, _MARK, False):
        return
    received = cls.data_received

    def data_received(self: Any, data: bytes, datatype: Any = None) -> None:
        if len(data) <= _SLICE:
            received(self, data, datatype)
            return
        view = memoryview(data)  # slices of it are not copies; asyncssh's += copies once
        for start in range(0, len(data), _SLICE):
            received(self, view[start : start + _SLICE], datatype)

    setattr(data_received, _MARK, True)
    cls.data_received = data_received
