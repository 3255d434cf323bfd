"""`devbox ssh` to a local box through the OpenSSH client, when one is installed.

OpenSSH runs `ssh box -- true` in ~0.07 s here, where devbox's own asyncssh client
needs ~0.45 s (0.2 s of it importing asyncssh): benchmarks/bench_startup.py. It also
brings the terminal handling users know (escape keys, agent, ControlMaster). The pins
are the same: devbox's key, its known_hosts file under the box's alias, strict
checking. OpenSSH's own messages are silenced; when it exits 255, a connect-only probe
with the built-in client names the failure in devbox's one line (a remote command
that itself exits 255 passes through unchanged). DEVBOX_SSH_CLIENT=builtin forces
the built-in client.
"""

from __future__ import annotations

import os
import shutil
import subprocess

from devbox import paths
from devbox.boxes import Box
from devbox.ssh.known_hosts import alias


def available() -> str | None:
    if os.environ.get("DEVBOX_SSH_CLIENT", "auto") == "builtin":
        return None
    return shutil.which("ssh")


def argv(ssh: str, box: Box, command: str | None, *, tty: bool) -> list[str]:
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
    return subprocess.call(argv(ssh, box, command, tty=tty))


def rsync_shell(ssh: str, box: Box) -> tuple[list[str], str]:
    """rsync's `-e` command and the host to name: the same key and pins as `devbox ssh`."""
    full = argv(ssh, box, None, tty=False)
    return full[:-1], full[-1]
