"""VS Code Remote-SSH's connection pattern, replayed with the real OpenSSH client against a
local box, as its public logs show it:

1. `ssh -T -D PORT NAME.devbox bash`, the install script on stdin: it finds the editor's server
   in ~/.vscode-server/bin/COMMIT or downloads it (wget, else curl; without a way out, the
   client copies it with scp first), starts it on a loopback port and prints `listeningOn==PORT==`.
2. The editor reaches its server through the SOCKS forward (-D) for as long as the window is
   open: files, language servers and its integrated terminals, which are PTYs the server opens.
3. Forwarded ports (`-L`) for what the user runs (a notebook, TensorBoard).

Nothing here types into an SSH terminal: what keeps the box busy is the traffic through the
forwards, and the idle warning must reach the editor's terminal, which is not screen's.
"""

from __future__ import annotations

import contextlib
import http.server
import io
import json
import os
import select
import shutil
import socket
import struct
import subprocess
import sys
import tarfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import User
from tests.waiting import wait_until

pytestmark = pytest.mark.skipif(shutil.which("ssh") is None, reason="OpenSSH client missing")

# The editor's server: on each connection a first line chooses "echo" (its file and language
# traffic, echoed) or "term" (an integrated terminal: a shell on a PTY of its own).
SERVER = r"""
import os, pty, select, socket, sys, threading
here = os.path.dirname(os.path.abspath(__file__))
listener = socket.socket()
listener.bind(("127.0.0.1", 0))
listener.listen(16)
with open(os.path.join(here, "port.tmp"), "w") as f:
    f.write(str(listener.getsockname()[1]))
os.rename(os.path.join(here, "port.tmp"), os.path.join(here, "port"))

def echo(conn):
    while data := conn.recv(65536):
        conn.sendall(data)

def term(conn):
    pid, master = pty.fork()
    if pid == 0:
        os.execvpe("sh", ["sh", "-i"], {**os.environ, "PS1": "editor-term$ "})
    conn.sendall(b"term-ready\n")
    while True:
        ready, _, _ = select.select([conn, master], [], [])
        if master in ready:
            try:
                data = os.read(master, 65536)
            except OSError:
                return
            if not data:
                return
            conn.sendall(data)
        if conn in ready:
            data = conn.recv(65536)
            if not data:
                return
            os.write(master, data)

def serve(conn):
    with conn:
        mode = b""
        while not mode.endswith(b"\n"):  # byte by byte: what follows is the mode's
            byte = conn.recv(1)
            if not byte:
                return
            mode += byte
        (term if mode == b"term\n" else echo)(conn)

while True:
    conn, _ = listener.accept()
    threading.Thread(target=serve, args=(conn,), daemon=True).start()
"""

# What the editor sends on stdin of `ssh -T -D PORT host bash` (its steps, not its text).
INSTALL = r"""
set -e
DIR="$HOME/.vscode-server/bin/{commit}"
if [ ! -f "$DIR/server.py" ]; then
  mkdir -p "$DIR"
  if [ ! -f "$DIR/vscode-server.tar.gz" ]; then
    case "{downloader}" in
      wget) wget -q -O "$DIR/vscode-server.tar.gz" "{url}" ;;
      curl) curl -fsSL -o "$DIR/vscode-server.tar.gz" "{url}" ;;
      *) echo "no download: the client copies the server"; exit 3 ;;
    esac
  fi
  tar -xzf "$DIR/vscode-server.tar.gz" -C "$DIR"
fi
rm -f "$DIR/port"
nohup python3 "$DIR/server.py" > "$DIR/server.log" 2>&1 < /dev/null &
until [ -s "$DIR/port" ]; do sleep 0.05; done
echo "listeningOn==$(cat "$DIR/port")=="
# The connection stays for as long as the window is open.
cat > /dev/null
"""

SETTINGS = """
idle_timeout = 14
warning = 6
grace = 0
interval = 0.5
unhealthy_after = 60
unhealthy_release_after = 120
"""


def _server_tarball() -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w:gz") as tar:
        data = SERVER.encode()
        info = tarfile.TarInfo("server.py")
        info.size, info.mode = len(data), 0o755
        tar.addfile(info, io.BytesIO(data))
    return out.getvalue()


@contextlib.contextmanager
def _download_site(payload: bytes) -> Iterator[str]:
    """The editor's update server, on this machine (the box is local)."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def log_message(self, *args: object) -> None:
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}/commit/server-linux-x64.tar.gz"
    finally:
        httpd.shutdown()
        httpd.server_close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Editor:
    """The editor's side: the `ssh -T -D` connection running the install script."""

    def __init__(self, user: User, box: str, script: str) -> None:
        self.socks = _free_port()
        self.proc = subprocess.Popen(
            ["ssh", "-F", str(user.ssh_config), "-T", "-D", f"127.0.0.1:{self.socks}",
             f"{box}.devbox", "bash"],
            env=user.env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        )  # fmt: skip
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(script.encode())
        self.proc.stdin.flush()
        line = self.proc.stdout.readline().decode()
        if not line.startswith("listeningOn=="):
            self.close()
            err = self.proc.stderr.read().decode() if self.proc.stderr else ""
            raise AssertionError(f"the server did not start: {line!r} {err}")
        self.port = int(line.strip().removeprefix("listeningOn==").removesuffix("=="))

    def connect(self, mode: str) -> socket.socket:
        """A connection to the editor's server through the SOCKS forward, as VS Code's."""
        sock = socket.create_connection(("127.0.0.1", self.socks), timeout=30)
        sock.sendall(b"\x05\x01\x00")
        assert sock.recv(2) == b"\x05\x00"
        sock.sendall(
            b"\x05\x01\x00\x01" + socket.inet_aton("127.0.0.1") + struct.pack(">H", self.port)
        )
        reply = _recv_exactly(sock, 10)
        assert reply[1] == 0, f"SOCKS connect refused: {reply!r}"
        sock.sendall(mode.encode() + b"\n")
        return sock

    def close(self) -> None:
        with contextlib.suppress(OSError):
            if self.proc.stdin:
                self.proc.stdin.close()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise AssertionError(f"connection closed after {data!r}")
        data += chunk
    return data


def _echo(sock: socket.socket, size: int) -> None:
    payload = os.urandom(size)
    sock.sendall(payload)
    assert _recv_exactly(sock, size) == payload


def _read_until(sock: socket.socket, needle: bytes, timeout: float) -> bytes:
    seen = b""
    deadline = time.monotonic() + timeout
    while needle not in seen:
        left = deadline - time.monotonic()
        if left <= 0:
            raise AssertionError(f"{needle!r} never came; got {seen[-2000:]!r}")
        ready, _, _ = select.select([sock], [], [], left)
        if ready:
            chunk = sock.recv(65536)
            if not chunk:
                raise AssertionError(f"closed before {needle!r}; got {seen[-2000:]!r}")
            seen += chunk
    return seen


def _install(user: User, box: str, downloader: str, commit: str, url: str) -> Editor:
    script = INSTALL.format(commit=commit, downloader=downloader, url=url)
    return Editor(user, box, script)


@pytest.mark.parametrize("downloader", ["wget", "curl", "scp"])
def test_the_editor_installs_its_server_and_reaches_it(
    user: User, tmp_path: Path, downloader: str
) -> None:
    user.up("vs")
    user.devbox("ssh-config", "--write", check=True)
    tarball = _server_tarball()
    commit = f"c0ffee-{downloader}"
    with _download_site(tarball) as url:
        if downloader == "scp":
            # No way out of the box: the editor copies its server over with scp, to `~`.
            local = tmp_path / "vscode-server.tar.gz"
            local.write_bytes(tarball)
            made = user.ssh("vs.devbox", f"mkdir -p ~/.vscode-server/bin/{commit}")
            assert made.returncode == 0, made.stderr
            subprocess.run(
                ["scp", "-F", str(user.ssh_config), str(local),
                 f"vs.devbox:.vscode-server/bin/{commit}/vscode-server.tar.gz"],
                env=user.env, check=True, capture_output=True, timeout=60,
            )  # fmt: skip
        editor = _install(user, "vs", downloader, commit, url)
    try:
        installed = user.home / ".vscode-server/bin" / commit / "server.py"
        assert installed.is_file(), "the server is not in the box's ~"
        with editor.connect("echo") as conn:
            _echo(conn, 100_000)
        # A forwarded port of the user's, as the editor's Ports view opens one.
        local_port = _free_port()
        forward = subprocess.Popen(
            ["ssh", "-F", str(user.ssh_config), "-N", "-o", "ExitOnForwardFailure=yes",
             "-L", f"127.0.0.1:{local_port}:127.0.0.1:{editor.port}", "vs.devbox"],
            env=user.env, stdin=subprocess.DEVNULL, stderr=subprocess.PIPE,
        )  # fmt: skip
        try:
            conn = _connect_when_listening(local_port, forward)
            with conn:
                conn.sendall(b"echo\n")
                _echo(conn, 10_000)
        finally:
            forward.terminate()
            forward.wait(timeout=20)
    finally:
        editor.close()


def _connect_when_listening(port: int, proc: subprocess.Popen[bytes]) -> socket.socket:
    sock: list[socket.socket] = []

    def attempt() -> bool:
        assert proc.poll() is None, proc.stderr.read() if proc.stderr else proc.returncode
        try:
            sock.append(socket.create_connection(("127.0.0.1", port), timeout=30))
        except OSError:
            return False
        return True

    wait_until(attempt, 60, "the -L forward to listen", every=0.1)
    return sock[0]


def _release_at(user: User, box: str) -> float:
    listed = json.loads(user.devbox("ls", "--json", check=True).stdout)
    return float(next(b for b in listed if b["name"] == box)["release_at"])


def test_traffic_through_the_forwards_keeps_the_box_then_the_warning_reaches_the_editor_terminal(
    user: User,
) -> None:
    user.up("ed")
    user.devbox("ssh-config", "--write", check=True)
    with _download_site(_server_tarball()) as url:
        editor = _install(user, "ed", "wget", "feed", url)
    config = user.home / ".config/devbox/autoscaler.toml"
    config.parent.mkdir(parents=True, exist_ok=True)
    config.write_text(SETTINGS)
    log = user.home / "autoscaler.log"
    scaler = None
    try:
        terminal = editor.connect("term")
        _read_until(terminal, b"term-ready", 30)
        work = editor.connect("echo")
        with open(log, "wb") as out:
            scaler = subprocess.Popen(
                [sys.executable, "-m", "devbox", "autoscaler"],
                env=user.env, stdin=subprocess.DEVNULL, stdout=out, stderr=out,
            )  # fmt: skip
        # The user edits for longer than the idle timeout: the editor's traffic (a few KiB
        # every second or two) goes through the SOCKS forward, and nothing else happens.
        busy_until = time.monotonic() + 14 + 8
        while time.monotonic() < busy_until:
            _echo(work, 6_000)
            time.sleep(1.0)
            assert _release_at(user, "ed") == 0, "warned while the editor was in use"
        explained = user.devbox("explain", "ed", check=True).stdout.decode()
        assert ": busy: in use: forwards recently" in explained, explained
        forwards = next(line for line in explained.splitlines() if line.startswith("  forwards"))
        assert "last active" in forwards and "port-forward traffic" in forwards, explained
        # The user stops: the forwards go quiet, the box goes idle, and the warning shows
        # in the editor's terminal, a PTY that is not the screen/tmux session.
        seen = _read_until(terminal, b"devbox: box ed has been idle", 60)
        assert b"devbox keep" in seen[seen.index(b"devbox: box ed has been idle") :]
        assert _release_at(user, "ed") > time.time()
        work.close()
        terminal.close()
    finally:
        if scaler is not None:
            scaler.terminate()
            scaler.wait(timeout=20)
        editor.close()
