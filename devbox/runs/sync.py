"""The working tree into the box: what it is (git commit, dirty or not) and the copy itself.

rsync over the box's SSH (the same key and pinned host key as `devbox ssh`), honouring
.gitignore through a dir-merge filter and never sending .git; SFTP when rsync is missing on
either side. Nothing is deleted in the box: outputs a run wrote next to the code survive
the next sync. DEVBOX_SYNC=rsync|sftp forces one.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from devbox import paths, private
from devbox.backends.base import Backend
from devbox.boxes import Box
from devbox.errors import DevboxError, UsageError

RSYNC_FLAGS = ["-rlpt", "--filter=:- .gitignore", "--exclude=.git", "--itemize-changes"]


@dataclass(frozen=True, kw_only=True)
class Tree:
    path: Path
    commit: str | None  # None: not a git checkout (or git is missing)
    dirty: bool | None


@dataclass(frozen=True, kw_only=True)
class Synced:
    dest: str  # in the box: absolute, or relative to the session's $HOME
    sent: list[str]
    method: str  # "rsync" or "sftp"


def check_readable(path: Path) -> Path:
    """The folder to sync, resolved; UsageError (one line) when it cannot be read."""
    try:
        resolved = path.resolve(strict=True)
        if not resolved.is_dir():
            raise UsageError(f"cannot sync {path}: not a folder")
        os.listdir(resolved)
    except FileNotFoundError:
        raise UsageError(f"cannot sync {path}: no such folder") from None
    except PermissionError:
        raise UsageError(f"cannot sync {path}: permission denied") from None
    if not resolved.name:
        raise UsageError("cannot sync / (name a project folder with --sync)")
    return resolved


def inspect(path: Path) -> Tree:
    """The tree's git commit and whether it has changes git would see (untracked too)."""
    git = shutil.which("git")
    if git is None:
        return Tree(path=path, commit=None, dirty=None)
    done = subprocess.run(
        [git, "-C", str(path), "status", "--porcelain=v2", "--branch"],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        return Tree(path=path, commit=None, dirty=None)
    commit = None
    dirty = False
    for line in done.stdout.splitlines():
        if line.startswith("# branch.oid "):
            oid = line.split()[2]
            commit = None if oid == "(initial)" else oid
        elif not line.startswith("#"):
            dirty = True
    return Tree(path=path, commit=commit, dirty=dirty)


def _method() -> str:
    forced = os.environ.get("DEVBOX_SYNC", "")
    if forced in ("rsync", "sftp"):
        return forced
    return "rsync" if shutil.which("rsync") else "sftp"


def _rsync_shell(backend: Backend, box: Box) -> tuple[list[str], str]:
    from devbox.ssh import openssh, sshconfig

    ssh = shutil.which("ssh")
    if ssh is None:
        raise _NoRsync("the OpenSSH client is missing")
    if backend.direct_ssh:
        return openssh.rsync_shell(ssh, box)
    # Elsewhere the box is reached through `devbox proxy`, as `ssh NAME.devbox` does.
    config = paths.state_dir() / "sync" / f"{box.name}.ssh_config"
    private.ensure_dir(config.parent)
    private.write_text(config, sshconfig.render([box], proxy_args=backend.proxy_args))
    return [ssh, "-F", str(config), "-T", "-o", "BatchMode=yes"], f"{box.name}.devbox"


class _NoRsync(Exception):
    pass


def rsync_argv(rsh: list[str], host: str, src: Path, dest: str) -> list[str]:
    rsync = shutil.which("rsync") or "rsync"
    return [rsync, *RSYNC_FLAGS, "-e", shlex.join(rsh), f"{src}/", f"{host}:{dest}/"]


def _rsync(backend: Backend, box: Box, src: Path, dest: str) -> list[str]:
    rsh, host = _rsync_shell(backend, box)
    done = subprocess.run(
        rsync_argv(rsh, host, src, dest),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        # 127 from the box's shell, or rsync's own "remote command not found".
        if done.returncode == 127 or "command not found" in done.stderr:
            raise _NoRsync("rsync is missing in the box")
        raise _rsync_failure(box, src, done)
    return [line.split(" ", 1)[1] for line in done.stdout.splitlines() if line.startswith("<f")]


def _rsync_failure(box: Box, src: Path, done: subprocess.CompletedProcess[str]) -> DevboxError:
    """rsync's failure as one line: what ssh said when the connection failed (rsync itself
    only reports code 12 or 255, "connection unexpectedly closed"), else rsync's last word."""
    from devbox.ssh import openssh

    what = f"syncing {src} to box {box.name} failed"
    reason = openssh.failure(box, done.stderr)
    if reason is not None:
        return DevboxError(f"{what}: the SSH connection failed: {reason}")
    lines = done.stderr.strip().splitlines()
    last = lines[-1] if lines else f"exit status {done.returncode}"
    if done.returncode in (12, 255) or "connection unexpectedly closed" in done.stderr:
        return DevboxError(f"{what}: the SSH connection to the box ended unexpectedly ({last})")
    return DevboxError(f"{what}: {last}")


def _sftp(backend: Backend, box: Box, src: Path, dest: str) -> list[str]:
    from devbox import connect
    from devbox.runs import ignore
    from devbox.ssh import sftpsync

    try:
        files = list(ignore.walk(src))
    except PermissionError as exc:
        raise UsageError(f"cannot sync {src}: cannot read {exc.filename}") from None
    return sftpsync.push(box, connect.open_socket(backend, box), src, files, dest)


def push(backend: Backend, box: Box, src: Path, *, dest: str | None = None) -> Synced:
    if not dest:
        root = backend.sync_root(box)
        dest = f"{root}/{src.name}" if root else src.name
    if _method() == "rsync":
        try:
            return Synced(dest=dest, sent=_rsync(backend, box, src, dest), method="rsync")
        except _NoRsync:
            pass
    return Synced(dest=dest, sent=_sftp(backend, box, src, dest), method="sftp")
