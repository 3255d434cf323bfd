"""The one session service: from parsed arguments to a backend, and from a box to a socket,
an SSH session or a connect-only probe, with connection failures said in one line.

Every command that reaches into a box goes through here: the handlers in devbox.commands,
the laptop side of `devbox run` (devbox.runs), and the dashboard (tui.feed). The SSH
clients themselves stay in devbox.ssh; this module picks one and says what went wrong. It
imports neither asyncssh nor the official Kubernetes client at import.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
from typing import TYPE_CHECKING, Any

from devbox import config as config_mod
from devbox.backends import get as get_backend
from devbox.backends.base import Backend
from devbox.boxes import Box
from devbox.errors import DevboxError, UsageError

if TYPE_CHECKING:
    import socket
    import subprocess

    from devbox.backends.clusters import Clusters


def backend_for(args: argparse.Namespace) -> Backend:
    """The backend the command's flags and the user's config name, with the flags' overrides:
    with [clusters] in the config, all of them as one (devbox.backends.clusters)."""
    cfg, overrides = _config(args)
    chosen = config_mod.select_backend(getattr(args, "backend", None), cfg)
    cluster = getattr(args, "cluster", None)
    # --context or --namespace address one cluster directly, as without [clusters].
    direct = "context" in overrides or "namespace" in overrides
    if chosen == "kubernetes" and cfg.clusters and not direct:
        return _clusters(cfg, overrides, cluster)
    if cluster is not None:
        raise UsageError(
            f"--cluster {cluster}: your config lists no clusters ([clusters.NAME] tables; "
            "see the README)"
            if chosen == "kubernetes"
            else "--cluster applies to the kubernetes backend only"
        )
    return get_backend(chosen, cfg)


def clusters_for(args: argparse.Namespace) -> Clusters:
    """The user's clusters, for what only several clusters have (`devbox clusters`, `move`);
    a one-line UsageError when the config lists none."""
    cfg, overrides = _config(args)
    if not cfg.clusters:
        raise UsageError(
            f"devbox {args.command} needs your clusters: list them as [clusters.NAME] "
            "tables in your config (see the README)"
        )
    return _clusters(cfg, overrides, getattr(args, "cluster", None))


def _config(args: argparse.Namespace) -> tuple[config_mod.Config, dict[str, Any]]:
    cfg = config_mod.load()
    overrides = {
        key: value
        for key, value in (
            ("context", getattr(args, "context", None)),
            ("namespace", getattr(args, "namespace", None)),
            ("start_timeout", getattr(args, "timeout", None)),
            ("port", getattr(args, "port", None)),
        )
        if value is not None
    }
    return dataclasses.replace(cfg, **overrides), overrides


def _clusters(cfg: config_mod.Config, overrides: dict[str, Any], pinned: str | None) -> Clusters:
    from devbox.backends.clusters import Clusters

    each = tuple(
        dataclasses.replace(c, config=dataclasses.replace(c.config, **overrides))
        for c in cfg.clusters
    )
    return Clusters(config=dataclasses.replace(cfg, clusters=each), pinned=pinned)


def refresh_ssh_config(backend: Backend) -> None:
    """Rewrite the boxes' ssh-config entries, if the user wrote them (`ssh-config --write`)."""
    from devbox.ssh import sshconfig

    sshconfig.refresh_if_written(
        backend.list, backend.name, proxy_args=backend.proxy_args, unlisted=backend.unlisted
    )


def open_socket(backend: Backend, box: Box) -> socket.socket:
    """A blocking byte stream to the box's SSH server; "cannot reach box NAME: ..." if none."""
    try:
        sock = backend.open_socket(box)
    except OSError as exc:
        raise DevboxError(f"cannot reach box {box.name}: {exc.strerror or exc}") from None
    sock.settimeout(None)
    return sock


def session(backend: Backend, box: Box, command: str | None, *, interactive: bool) -> int:
    """`command` in the box (None: the login shell) on this terminal's stdin, stdout and
    stderr, through OpenSSH where it is installed, else devbox's own client; its exit status."""
    from devbox.ssh import openssh

    ssh = openssh.available()
    if ssh is None:
        return _builtin(backend, box, command, interactive=interactive)
    if backend.direct_ssh:
        status = openssh.run(ssh, box, command, tty=interactive)
    else:
        # Through the API server: this process pumps the port-forward and OpenSSH dials it
        # on loopback, not through a ProxyCommand (a second Python process and a second
        # port-forward), and without importing asyncssh (0.3 s, most of a warm claim).
        from devbox.ssh.proxy import loopback

        port = loopback(open_socket(backend, box))
        here = dataclasses.replace(box, host="127.0.0.1", port=port)
        status = openssh.run(ssh, here, command, tty=interactive)
    if status == 255:
        # OpenSSH's own failures are 255 (silenced); so is a command that exits 255.
        # A connect-only probe tells them apart and names a failure in one line.
        probe(backend, box)
    return status


def spawn(backend: Backend, box: Box, command: str) -> subprocess.Popen[bytes] | None:
    """`command` in the box through OpenSSH, started and left running with its stdin,
    stdout and stderr as pipes of this process (a status of 255 is `probe`'s to explain);
    None where OpenSSH is missing, for the caller to do it another way."""
    import subprocess

    from devbox.ssh import openssh

    ssh = openssh.available()
    if ssh is None:
        return None
    here = box
    if not backend.direct_ssh:  # as in session: a loopback port joined to the port-forward
        from devbox.ssh.proxy import loopback

        here = dataclasses.replace(box, host="127.0.0.1", port=loopback(open_socket(backend, box)))
    return subprocess.Popen(
        openssh.argv(ssh, here, command, tty=False),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )


def _builtin(backend: Backend, box: Box, command: str | None, *, interactive: bool) -> int:
    from devbox.ssh import client

    return client.run(box, open_socket(backend, box), command, interactive_=interactive)


def probe(backend: Backend, box: Box) -> None:
    """Connect and authenticate, run nothing: returns if the box takes a session, else
    raises the failure's one line ("lost the connection to box NAME (...)" for a dead link)."""
    from devbox.ssh import client

    try:
        client.probe(box, open_socket(backend, box))
    except DevboxError as exc:
        if exc.message.startswith("cannot reach"):
            raise DevboxError(
                f"lost the connection to box {box.name} ({exc.message.split(': ', 1)[-1]})"
            ) from None
        raise


def prefetch_client(backend: Backend) -> None:
    """Where the built-in SSH client will carry the session (no OpenSSH; see session),
    start its import (asyncssh, 0.25 to 0.4 s) now, so that it overlaps the waits on the
    API server and the agent (a claim, a look-up, the port-forward's handshake)."""
    from devbox.ssh import openssh

    if not backend.direct_ssh and openssh.available() is None:
        import threading

        threading.Thread(
            target=importlib.import_module, args=("devbox.ssh.client",), daemon=True
        ).start()
