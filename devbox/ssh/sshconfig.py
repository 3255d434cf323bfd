"""OpenSSH config for boxes: `Host NAME.devbox` blocks, and one Include line in ~/.ssh/config.

With these, plain ssh, scp, sftp, rsync and VS Code Remote-SSH reach a box by name.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

from devbox import paths
from devbox.boxes import Box
from devbox.ssh.known_hosts import alias
from devbox.ssh.openssh import KEX_ALGORITHMS

HEADER = "# Managed by devbox (`devbox ssh-config --write`); edits here are overwritten.\n"


def _quote(value: str) -> str:
    return f'"{value}"' if any(c.isspace() for c in value) else value


# What addresses a box beyond its backend and name: its backend's `proxy_args` (the
# namespace of a pod), so the alias works whatever later commands default to.
ProxyArgs = Callable[[Box], Sequence[str]]


INLINE_HEADER = (
    "# devbox boxes, self-contained (`devbox ssh-config --inline`): for clients that do not\n"
    "# follow Include (paramiko, Fabric). Each block is complete; no Include, no Match.\n"
)


def _proxy_command(box: Box, proxy_args: ProxyArgs) -> str:
    # `python -m devbox`, not a bare `devbox`: VS Code and other tools run ssh with
    # a PATH that may not contain the console script.
    where = "".join(f" {_quote(word)}" for word in proxy_args(box))
    return f"{_quote(sys.executable)} -m devbox proxy --backend {box.backend} {box.name}{where}"


def _block(box: Box, *, host_name: bool, proxy_args: ProxyArgs) -> str:
    # HostName is the alias itself: a client without HostKeyAlias (paramiko) then looks
    # the box up in the known_hosts file under the name devbox pins it by.
    return (
        f"\nHost {alias(box.name)}\n"
        + (f"  HostName {alias(box.name)}\n" if host_name else "")
        + f"  User {box.owner}\n"
        f"  ProxyCommand {_proxy_command(box, proxy_args)}\n"
        f"  IdentityFile {_quote(str(paths.user_key_file()))}\n"
        "  IdentitiesOnly yes\n"
        f"  UserKnownHostsFile {_quote(str(paths.known_hosts_file()))}\n"
        "  StrictHostKeyChecking yes\n"
        f"  HostKeyAlias {alias(box.name)}\n"
        f"  KexAlgorithms {KEX_ALGORITHMS}\n"
        "  ServerAliveInterval 30\n"
    )


def render(boxes: Iterable[Box], *, keep: Iterable[str] = (), proxy_args: ProxyArgs) -> str:
    out = [HEADER, *(_block(box, host_name=False, proxy_args=proxy_args) for box in boxes)]
    out.extend(f"\n{block}\n" for block in keep)
    return "".join(out)


def render_inline(boxes: Iterable[Box], *, proxy_args: ProxyArgs) -> str:
    """Blocks that need nothing else: every setting a connection needs is in its own
    block (HostName too), and nothing relies on Include, Match or a `Host *` default."""
    return INLINE_HEADER + "".join(
        _block(box, host_name=True, proxy_args=proxy_args) for box in boxes
    )


def _kept_blocks(backend: str, unlisted: Sequence[Sequence[str]]) -> list[str]:
    """The managed file's blocks that this write leaves as they are: boxes of other
    backends (one backend's `up` must not drop the aliases of another's boxes), and boxes
    of places this backend could not list just now (a cluster that did not answer): each
    `unlisted` entry is the proxy words that address that place."""
    try:
        text = paths.ssh_config_file().read_text()
    except FileNotFoundError:
        return []
    blocks = re.split(r"\n(?=Host )", text)[1:]
    marks = ["".join(f" {_quote(w)}" for w in words) for words in unlisted]
    return [
        b.strip("\n")
        for b in blocks
        if f" --backend {backend} " not in b or any(f"{m}\n" in b for m in marks)
    ]


def _write_managed(
    boxes: Iterable[Box], backend: str, proxy_args: ProxyArgs, unlisted: Sequence[Sequence[str]]
) -> Path:
    managed = paths.ssh_config_file()
    text = render(boxes, keep=_kept_blocks(backend, unlisted), proxy_args=proxy_args)
    managed.parent.mkdir(parents=True, exist_ok=True)
    tmp = managed.with_name(managed.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, managed)
    return managed


def include_line(path: Path | None = None) -> str:
    return f"Include {_quote(str(path or paths.ssh_config_file()))}"


def write(
    boxes: Iterable[Box],
    backend: str,
    *,
    proxy_args: ProxyArgs,
    unlisted: Sequence[Sequence[str]] = (),
) -> tuple[Path, bool]:
    """Write the managed file (`backend`'s boxes replace that backend's blocks) and make
    sure ~/.ssh/config includes it.

    Returns the managed path and whether ~/.ssh/config was changed. The Include
    goes first: an Include after a Host line would apply only to that host.
    """
    managed = _write_managed(boxes, backend, proxy_args, unlisted)

    user = paths.user_ssh_config()
    if user.is_symlink():  # dotfile managers link it; write through, keep the link
        user = user.resolve()
    line = include_line(managed)
    try:
        current = user.read_text()
    except FileNotFoundError:
        current = ""
    if any(existing.strip() == line for existing in current.splitlines()):
        return managed, False
    user.parent.mkdir(mode=0o700, exist_ok=True)
    mode = user.stat().st_mode & 0o777 if user.exists() else 0o600
    tmp = user.with_name(user.name + ".devbox.tmp")
    tmp.write_text(f"{line}\n{current}")
    os.chmod(tmp, mode)
    os.replace(tmp, user)
    return managed, True


def refresh_if_written(
    boxes: Callable[[], Iterable[Box]],
    backend: str,
    *,
    proxy_args: ProxyArgs,
    unlisted: Callable[[], Sequence[Sequence[str]]] = tuple,
) -> None:
    """Keep the managed file current after up/down, once the user has opted in with --write.
    `boxes` is called only then: listing them is an API request on Kubernetes; `unlisted`
    after it (see _kept_blocks)."""
    if paths.ssh_config_file().exists():
        listed = list(boxes())
        _write_managed(listed, backend, proxy_args, unlisted())
