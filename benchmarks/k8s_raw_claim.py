"""The peer of `devbox up NAME` for a warm claim: the same requests, as little Python as
can make them. Run as `python -S -E k8s_raw_claim.py SPEC.json NAME` on a terminal.

One TLS connection: GET the namespace's profiles ConfigMap, GET the pool and any box of
that name (one label selector), PATCH the first ready warm pod (resourceVersion
precondition), pin its host key, switch the connection to the pod's port-forward
(WebSocket), and run OpenSSH on a loopback port joined to it, as `devbox up` attaches.
Credentials come ready in SPEC.json (PEM files, no kubeconfig, no YAML): it is the floor
a Python client with minimal imports can reach, not a way to use a cluster.
"""

import base64
import json
import os
import select
import socket
import ssl
import struct
import subprocess
import sys
import time


def main() -> int:
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    name = sys.argv[2]
    ctx = ssl.create_default_context(cafile=spec["ca"])
    ctx.load_cert_chain(spec["cert"], spec["key"])
    raw = socket.create_connection((spec["host"], spec["port"]))
    raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    tls = ctx.wrap_socket(raw, server_hostname=spec["host"])
    conn = Http(tls, f"{spec['host']}:{spec['port']}")
    ns = f"/api/v1/namespaces/{spec['namespace']}"
    conn.request("GET", f"{ns}/configmaps/devbox-profiles")
    selector = f"app.kubernetes.io/managed-by=devbox,devbox.io/box in (,{name})"
    status, listed = conn.request("GET", f"{ns}/pods?labelSelector={quote(selector)}")
    pods = json.loads(listed)["items"]
    if any(p["metadata"]["labels"].get("devbox.io/box") == name for p in pods):
        raise SystemExit(f"a box named {name} exists")
    for pod in pods:
        meta = pod["metadata"]
        labels = meta["labels"]
        if (
            labels.get("devbox.io/state") != "warm"
            or labels.get("devbox.io/profile") != spec["profile"]
        ):
            continue
        if not (meta.get("annotations") or {}).get("devbox.io/host-key"):
            continue
        patch = {
            "metadata": {
                "resourceVersion": meta["resourceVersion"],
                "labels": {
                    "devbox.io/state": "claimed",
                    "devbox.io/box": name,
                    "devbox.io/owner": spec["owner_label"],
                },
                "annotations": {
                    "devbox.io/owner-key": spec["owner_key"],
                    "devbox.io/owner-name": spec["owner"],
                    "devbox.io/claimed-at": f"{time.time():.3f}",
                },
            }
        }
        status, answer = conn.request(
            "PATCH",
            f"{ns}/pods/{meta['name']}",
            json.dumps(patch).encode(),
            "application/merge-patch+json",
        )
        if status == 200:
            claimed = json.loads(answer)
            break
    else:
        raise SystemExit("no warm pod")
    pod_name = claimed["metadata"]["name"]
    host_key = " ".join(claimed["metadata"]["annotations"]["devbox.io/host-key"].split()[:2])
    with open(spec["known_hosts"], "a") as f:
        f.write(f"{name}.devbox {host_key}\n")
    key = base64.b64encode(os.urandom(16)).decode()
    tls.sendall(
        (
            f"GET {ns}/pods/{pod_name}/portforward?ports=2222 HTTP/1.1\r\nHost: {conn.host}\r\n"
            "Upgrade: websocket\r\nConnection: Upgrade\r\n"
            f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n"
            "Sec-WebSocket-Protocol: v4.channel.k8s.io\r\n\r\n"
        ).encode()
    )
    head = conn.head()
    if b" 101 " not in head.split(b"\r\n", 1)[0]:
        raise SystemExit(f"port-forward refused: {head[:200]!r}")
    with open(spec["timeline"], "a") as f:  # where the requests end and ssh begins
        f.write(f"{name} {time.time()}\n")
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    port = listener.getsockname()[1]
    ssh = subprocess.Popen(
        [
            "ssh", "-t", "-F", "/dev/null", "-i", spec["ssh_key"], "-o", "IdentitiesOnly=yes",
            "-o", f"UserKnownHostsFile={spec['known_hosts']}", "-o",
            "GlobalKnownHostsFile=/dev/null", "-o", "StrictHostKeyChecking=yes", "-o",
            f"HostKeyAlias={name}.devbox", "-o", "BatchMode=yes", "-o", "LogLevel=QUIET",
            "-o", f"KexAlgorithms={spec['kex']}",
            "-l", spec["owner"], "-p", str(port), "127.0.0.1",
        ]
    )  # fmt: skip
    local, _ = listener.accept()
    local.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    pump(tls, conn.buf, local)
    return ssh.wait()


def quote(text: str) -> str:
    return "".join(c if c.isalnum() or c in "-._~" else f"%{ord(c):02X}" for c in text)


class Http:
    def __init__(self, sock: ssl.SSLSocket, host: str) -> None:
        self.sock, self.host, self.buf = sock, host, b""

    def request(
        self, method: str, path: str, body: bytes = b"", kind: str = ""
    ) -> tuple[int, bytes]:
        lines = [f"{method} {path} HTTP/1.1", f"Host: {self.host}", "Accept: application/json"]
        if body:
            lines += [f"Content-Type: {kind}", f"Content-Length: {len(body)}"]
        self.sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode() + body)
        head = self.head().decode("latin-1").lower()
        status = int(head.split(" ", 2)[1])
        if "transfer-encoding: chunked" in head:
            out = b""
            while True:
                size = int(self.line().split(b";")[0], 16)
                if not size:
                    self.line()
                    return status, out
                out += self.read(size + 2)[:-2]
        length = int(head.split("content-length:", 1)[1].split("\r\n", 1)[0])
        return status, self.read(length)

    def head(self) -> bytes:
        while b"\r\n\r\n" not in self.buf:
            self.buf += self.sock.recv(65536)
        head, self.buf = self.buf.split(b"\r\n\r\n", 1)
        return head

    def line(self) -> bytes:
        while b"\r\n" not in self.buf:
            self.buf += self.sock.recv(65536)
        line, self.buf = self.buf.split(b"\r\n", 1)
        return line

    def read(self, n: int) -> bytes:
        while len(self.buf) < n:
            self.buf += self.sock.recv(65536)
        out, self.buf = self.buf[:n], self.buf[n:]
        return out


def pump(tls: ssl.SSLSocket, pending: bytes, local: socket.socket) -> None:
    """WebSocket frames <-> the local connection, one thread, until either side ends."""
    buf, seen = bytearray(pending), set()
    tls.setblocking(False)
    while True:
        while True:  # whole frames out of buf
            if len(buf) < 2:
                break
            n, at = buf[1] & 0x7F, 2
            if n == 126:
                n, at = struct.unpack("!H", buf[2:4])[0], 4
            elif n == 127:
                n, at = struct.unpack("!Q", buf[2:10])[0], 10
            if len(buf) < at + n:
                break
            opcode, payload = buf[0] & 0x0F, bytes(buf[at : at + n])
            del buf[: at + n]
            if opcode == 0x8:
                return
            if opcode == 0x2 and payload:
                skip = 1 if payload[0] in seen else 3
                seen.add(payload[0])
                if payload[0] == 0 and payload[skip:]:
                    local.sendall(payload[skip:])
        ready = [tls] if tls.pending() else select.select([tls, local], [], [])[0]
        if tls in ready:
            try:
                data = tls.recv(262144)
                if not data:
                    return
                buf += data
            except ssl.SSLWantReadError:
                pass
        if local in ready:
            data = local.recv(262144)
            if not data:
                return
            send(tls, frame(b"\x00" + data))


def frame(payload: bytes) -> bytes:
    key, n = os.urandom(4), len(payload)
    head = (
        struct.pack("!BB", 0x82, 0x80 | n)
        if n < 126
        else struct.pack("!BBH", 0x82, 0xFE, n)
        if n < 65536
        else struct.pack("!BBQ", 0x82, 0xFF, n)
    )
    mask = (key * (n // 4 + 1))[:n]
    masked = (int.from_bytes(payload, "big") ^ int.from_bytes(mask, "big")).to_bytes(n, "big")
    return head + key + masked


def send(tls: ssl.SSLSocket, data: bytes) -> None:
    while True:
        try:
            tls.send(data)
            return
        except (ssl.SSLWantWriteError, ssl.SSLWantReadError):
            select.select([tls], [tls], [])


if __name__ == "__main__":
    sys.exit(main())
