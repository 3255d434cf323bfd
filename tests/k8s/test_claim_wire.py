"""Issue 22: what a warm claim puts on the wire, seen from outside devbox. A TLS proxy
between devbox and the API server (its certificate signed by the test cluster's CA, so
devbox trusts it as it trusts the API server) counts the connections it accepts and
logs the request line of every HTTP request on them, up to a switch of protocols."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import datetime
import fcntl
import ipaddress
import os
import pty
import select
import ssl
import struct
import subprocess
import sys
import termios
import threading
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from tests.k8s.conftest import KubeUser


@dataclass
class WireLog:
    port: int = 0
    # One list per accepted connection: its requests' "METHOD PATH" lines, in order.
    connections: list[list[str]] = field(default_factory=list)


def _server_context(folder: Path, pki: Path) -> ssl.SSLContext:
    """A serving certificate for 127.0.0.1, signed by the test cluster's CA."""
    with warnings.catch_warnings():  # kwokctl's CA has a serial RFC 5280 frowns upon
        warnings.simplefilter("ignore")
        ca_cert = x509.load_pem_x509_certificate((pki / "ca.crt").read_bytes())
    ca_key = serialization.load_pem_private_key((pki / "ca.key").read_bytes(), password=None)
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "wire-log")]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())  # type: ignore[arg-type]
    )
    pem = folder / "wire-log.pem"
    pem.write_bytes(
        cert.public_bytes(serialization.Encoding.PEM)
        + key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(pem)
    return ctx


@contextlib.contextmanager
def wire_log(kube: KubeUser, folder: Path) -> Iterator[WireLog]:
    """The proxy, and KUBECONFIG pointing devbox at it with the admin's credentials (the
    proxy presents them upstream: devbox's identity stays the same)."""
    doc = yaml.safe_load(kube.cluster.kubeconfig.read_text())
    cluster, user = doc["clusters"][0]["cluster"], doc["users"][0]["user"]
    host, port = cluster["server"].removeprefix("https://").rsplit(":", 1)
    upstream = ssl.create_default_context(
        cadata=base64.b64decode(cluster["certificate-authority-data"]).decode()
    )
    chain = folder / "admin.pem"
    chain.write_bytes(
        base64.b64decode(user["client-certificate-data"])
        + b"\n"
        + base64.b64decode(user["client-key-data"])
    )
    upstream.load_cert_chain(chain)
    pki = next((kube.cluster.kubeconfig.parent / "kwok/clusters").glob("*/pki"))
    serving = _server_context(folder, pki)
    log = WireLog()
    loop = asyncio.new_event_loop()
    started = threading.Event()

    async def pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(Exception):
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        writer.close()

    async def requests(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, lines: list[str]
    ) -> None:
        with contextlib.suppress(Exception):
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines.append(" ".join(head.split(b"\r\n", 1)[0].decode().split()[:2]))
                writer.write(head)
                fields = {
                    k.strip().lower(): v.strip()
                    for k, _, v in (ln.partition(b":") for ln in head.split(b"\r\n")[1:] if ln)
                }
                length = int(fields.get(b"content-length", b"0"))
                if length:
                    writer.write(await reader.readexactly(length))
                await writer.drain()
                if b"upgrade" in fields:
                    break
        await pump(reader, writer)

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        lines: list[str] = []
        log.connections.append(lines)
        up_reader, up_writer = await asyncio.open_connection(
            host, int(port), ssl=upstream, server_hostname=host
        )
        await asyncio.gather(requests(reader, up_writer, lines), pump(up_reader, writer))

    stop = asyncio.Event()

    async def main() -> None:
        server = await asyncio.start_server(serve, "127.0.0.1", 0, ssl=serving)
        log.port = server.sockets[0].getsockname()[1]
        started.set()
        async with server:
            await stop.wait()

    thread = threading.Thread(target=loop.run_until_complete, args=(main(),), daemon=True)
    thread.start()
    assert started.wait(10)
    proxied = dict(doc)
    proxied["clusters"] = [
        {
            "name": doc["clusters"][0]["name"],
            "cluster": dict(cluster, server=f"https://127.0.0.1:{log.port}"),
        }
    ]
    path = folder / "kubeconfig-proxied"
    path.write_text(yaml.safe_dump(proxied))
    before = kube.user.env["KUBECONFIG"]
    kube.user.env["KUBECONFIG"] = str(path)
    try:
        yield log
    finally:
        kube.user.env["KUBECONFIG"] = before
        loop.call_soon_threadsafe(stop.set)
        thread.join(10)


def up_to_shell(kube: KubeUser, name: str, timeout: float = 60) -> bytes:
    """`devbox up NAME` on a terminal, as a user runs it, until a command typed ahead has
    run in the box's shell; then the session is detached. Returns what the terminal got."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    proc = subprocess.Popen(
        [sys.executable, "-m", "devbox", "up", name],
        env=kube.user.env,
        stdin=slave,
        stdout=slave,
        stderr=slave,
        cwd=kube.user.home,
    )
    os.close(slave)
    os.write(master, b"echo READY-$((6*7))\r")
    seen = b""
    deadline = time.monotonic() + timeout
    try:
        while b"READY-42" not in seen:
            left = deadline - time.monotonic()
            assert left > 0 and select.select([master], [], [], left)[0], seen[-800:]
            try:
                seen += os.read(master, 65536)
            except OSError:  # EIO: devbox ended, and the terminal with it
                pytest.fail(f"devbox up ended before its shell: {seen[-800:]!r}")
        os.write(master, b"\x01d")  # detach screen: the box stays
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(master)
    return seen


def test_a_warm_claim_to_a_shell_is_one_tls_connection_and_four_requests(
    kube: KubeUser, tmp_path: Path
) -> None:
    kube.devbox("pool", "warm", "--size", "1", check=True)
    with wire_log(kube, tmp_path) as log:
        kube.devbox("ls", check=True)  # who the user is, asked once and cached
        log.connections.clear()
        seen = up_to_shell(kube, "w1")
    assert b"claimed warm pod devbox-warm-" in seen
    ns = f"/api/v1/namespaces/{kube.namespace}"
    assert len(log.connections) == 1, log.connections
    requests = log.connections[0]
    assert [r.split("?")[0] for r in requests[:1]] == [f"GET {ns}/configmaps/devbox-profiles"]
    # One list answers both "is the name free?" and "which warm pods are ready?".
    assert requests[1].startswith(f"GET {ns}/pods?labelSelector="), requests
    assert requests[2].startswith(f"PATCH {ns}/pods/devbox-warm-"), requests
    assert requests[3].startswith(f"GET {ns}/pods/devbox-warm-"), requests
    assert requests[3].endswith("/portforward?ports=2222"), requests
    assert len(requests) == 4, requests


def test_a_taken_name_is_refused_and_leaves_the_pool_alone(kube: KubeUser) -> None:
    kube.devbox("up", "dup", "--no-attach", check=True)
    pool = kube.devbox("pool", "warm", "--size", "1", "--json", check=True)
    again = kube.devbox("up", "dup", "--no-attach")
    assert again.returncode == 2, again.stderr
    assert (
        f"devbox: error: a box named 'dup' already exists in namespace '{kube.namespace}'"
        in again.stderr.decode()
    )
    after = kube.devbox("pool", "ls", "--json", check=True)
    assert [b["place"] for b in yaml.safe_load(after.stdout)] == [
        b["place"] for b in yaml.safe_load(pool.stdout)
    ]
    # A free name takes the warm pod.
    fresh = kube.devbox("up", "fresh", "--no-attach")
    assert b"claimed warm pod" in fresh.stderr, fresh.stderr


def imported(kube: KubeUser, *args: str) -> set[str]:
    """The modules `devbox ARGS` imports, as `python -X importtime` lists them."""
    done = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "devbox", *args],
        env=kube.user.env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        timeout=60,
        cwd=kube.user.home,
    )
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    lines = done.stderr.decode().splitlines()
    return {ln.rsplit("|", 1)[1].strip() for ln in lines if ln.startswith("import time:")}


# Neither a warm claim nor a session through the port-forward needs these: asyncio (the
# pump is one thread), PyYAML (blockyaml reads kubectl's kubeconfig), http.client and the
# email package (http1), the official client, and the cold path's and watch's modules.
NOT_ON_THE_CLAIM_PATH = {
    "asyncio",
    "yaml",
    "http.client",
    "email.parser",
    "kubernetes",
    "devbox.backends.kubernetes.capacity",
    "devbox.backends.kubernetes.waiting",
    "devbox.backends.kubernetes.watching",
}


def test_a_warm_claim_and_a_session_import_only_what_they_use(kube: KubeUser) -> None:
    kube.devbox("pool", "warm", "--size", "1", check=True)
    claim = imported(kube, "up", "lean", "--no-attach")
    assert "devbox.backends.kubernetes.portforward" in claim
    assert claim & NOT_ON_THE_CLAIM_PATH == set()
    session = imported(kube, "ssh", "lean", "--", "true")
    assert "devbox.backends.kubernetes.tunnel" in session
    assert session & NOT_ON_THE_CLAIM_PATH == set()
