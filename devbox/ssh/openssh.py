"""`devbox ssh` to a local box through the OpenSSH client, when one is installed.

OpenSSH runs `ssh box -- true` in ~0.07 s here, where devbox's own asyncssh client
needs ~0.45 s (0.2 s of it importing asyncssh): benchmarks/bench_startup.py. It also
brings the terminal handling users know (escape keys, agent, ControlMaster). The pins
are the same: devbox's key, its known_hosts file under the box's alias, strict
checking. OpenSSH's own messages are silenced: what devbox can know it checks first
(`preflight`: the key's mode and owner, the pin against the box's published key), and
when ssh exits 255 anyway, a connect-only probe with the built-in client names the
failure in devbox's one line (a remote command that itself exits 255 passes through
unchanged). DEVBOX_SSH_CLIENT=builtin forces the built-in client.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal

from devbox import paths
from devbox.boxes import Box
from devbox.ssh import keys, known_hosts
from devbox.ssh.known_hosts import alias

# The key exchanges devbox's own OpenSSH runs (and the `Host NAME.devbox` blocks) take: the
# client's defaults less sntrup761x25519. OpenSSH 9.0-9.8 prefer it (macOS 14 and 15,
# Debian 12, Ubuntu 22.04 and 24.04), and make its key pair in 30-70 ms a connection, a
# `devbox ssh NAME -- true` 5x slower (benchmarks/bench_startup.py); `devbox run` opens
# two. On these paths it protects nothing the transport around it leaves open: a local
# box is on loopback, a pod's stream rides the API server's port-forward, whose TLS is
# not post-quantum either. ML-KEM (OpenSSH >= 9.9's default, fast) stays first where
# the client has it; the agent still offers sntrup761 to whoever asks for it. A removal
# list ("-...") names algorithms a client may not know without an error.
KEX_ALGORITHMS = "-sntrup761x25519-sha512@openssh.com,sntrup761x25519-sha512"


def available() -> str | None:
    if os.environ.get("DEVBOX_SSH_CLIENT", "auto") == "builtin":
        return None
    return shutil.which("ssh")


def preflight(box: Box, *, key_missing_ok: bool = False) -> None:
    """What OpenSSH would refuse, and devbox can see before it connects, as one line: a
    key file's mode or owner (its own key's mode is fixed, and said), a changed pin."""
    keys.check_user_key(missing_ok=key_missing_ok)
    known_hosts.check(box)


def argv(ssh: str, box: Box, command: str | None, *, tty: bool) -> list[str]:
    """ssh's command line for `box`, after `preflight`: every OpenSSH run of devbox's
    (sessions, `devbox run`'s helper, rsync's shell) goes through here."""
    preflight(box)
    opts = [
        ssh,
        "-F",
        "/dev/null",  # the user's config must not redirect a devbox alias
        "-i",
        str(paths.user_key_file()),
        "-o",
        "IdentitiesOnly=yes",
        "-o",
        f"UserKnownHostsFile={paths.known_hosts_file()}",
        "-o",
        "GlobalKnownHostsFile=/dev/null",
        "-o",
        "StrictHostKeyChecking=yes",
        "-o",
        f"HostKeyAlias={alias(box.name)}",
        "-o",
        f"KexAlgorithms={KEX_ALGORITHMS}",
        "-o",
        "BatchMode=yes",
        "-o",
        "LogLevel=QUIET",
        "-o",
        "ServerAliveInterval=30",
        "-l",
        box.owner,
    ]
    opts += ["-p", str(box.port), box.host]
    if tty:
        opts.insert(1, "-t")
    elif command is None:
        opts.insert(1, "-T")
    return opts + ([command] if command is not None else [])


def run(ssh: str, box: Box, command: str | None, *, tty: bool) -> int:
    """ssh on this terminal, its exit status. posix_spawn, not subprocess: importing that
    module is 5% of a `devbox ssh` (benchmarks/bench_startup.py)."""
    # As subprocess does: Python ignores SIGPIPE and SIGXFSZ; ssh gets their defaults.
    defaults = (signal.SIGPIPE, signal.SIGXFSZ)
    pid = os.posix_spawn(ssh, argv(ssh, box, command, tty=tty), os.environ, setsigdef=defaults)
    try:
        _, status = os.waitpid(pid, 0)
    except BaseException:  # ctrl-c (ssh got it too) or worse: never leave ssh behind
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        # ssh, which got the same ctrl-c, may have ended and been reaped by the waitpid
        # above just before Python raised KeyboardInterrupt: then there is none to wait for.
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)
        raise
    return os.waitstatus_to_exitcode(status)


def rsync_shell(ssh: str, box: Box) -> tuple[list[str], str]:
    """rsync's `-e` command and the host to name: the same key and pins as `devbox ssh`.
    rsync's output is captured, not shown: ssh's errors stay in it for `failure`."""
    full = argv(ssh, box, None, tty=False)
    full[full.index("LogLevel=QUIET")] = "LogLevel=ERROR"
    return full[:-1], full[-1]


_UNREACHABLE = (
    "Connection refused",
    "Connection closed",
    "Connection reset",
    "Connection timed out",
    "No route to host",
    "kex_exchange_identification",
    "Could not resolve",
)


def failure(box: Box, stderr: str) -> str | None:
    """Why OpenSSH failed, from what it wrote (under rsync, say), as devbox's one line;
    None when it wrote none of its errors. Its banner is never repeated."""
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    for line in lines:
        if line.startswith("devbox: error: "):  # `devbox proxy`'s own line, as the ProxyCommand
            return line.removeprefix("devbox: error: ")
    if any("Host key verification failed" in ln for ln in lines):
        # The banner's fingerprint line follows "...key sent by the remote host is".
        after = [
            ln for i, ln in enumerate(lines) if i and "sent by the remote host" in lines[i - 1]
        ]
        sent = after[0].rstrip(".") if after else "another key"
        keys = known_hosts.pinned(box.name)
        pinned = ", ".join(map(known_hosts.fingerprint, keys)) or box.host_key_fingerprint
        return (  # the words of the built-in client's refusal (devbox.ssh.client)
            f"box {box.name} presented a host key that does not match the pinned {pinned} "
            f"(it presented {sent}); refusing to connect: something else may be answering "
            "at its address"
        )
    if any("Permission denied (" in ln for ln in lines):
        return f"box {box.name} refused your key {paths.user_key_file()}"
    for line in lines:
        if any(word in line for word in _UNREACHABLE):
            return f"cannot reach box {box.name}: {line.removeprefix('ssh: ')}"
    return None
