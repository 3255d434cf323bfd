"""`devbox ssh`, `proxy` (OpenSSH's ProxyCommand) and `ssh-config`: reaching a box."""

from __future__ import annotations

import argparse
import sys

from devbox.commands import say
from devbox.connect import backend_for, open_socket, prefetch_client, session
from devbox.errors import UsageError


def ssh(args: argparse.Namespace) -> int:
    words = list(args.cmd)
    if words[:1] == ["--"]:
        words = words[1:]
    backend = backend_for(args)
    prefetch_client(backend)
    box = backend.get(args.name)
    if box.state.value not in ("running", "idle"):
        raise UsageError(f"box {box.name} is {box.state.value}: {box.reason or 'not reachable'}")
    # As ssh does: the words are joined with spaces and the login shell parses them.
    command = " ".join(words) if words else None
    # Like ssh: no command and a terminal is the interactive session; no command and
    # piped input runs the login shell on that input (`echo make | devbox ssh NAME`).
    tty = sys.stdin.isatty() and sys.stdout.isatty()
    return session(backend, box, command, interactive=command is None and tty)


def proxy(args: argparse.Namespace) -> int:
    from devbox.ssh import openssh
    from devbox.ssh.proxy import bridge, watch_release

    backend = backend_for(args)
    box = backend.get(args.name)
    # A desktop notification if the box is warned, for as long as the connection lasts.
    watch_release(box, lambda: backend.get(box.name), every=backend.look_interval)
    # As ssh's ProxyCommand, before ssh sees a byte of the box: a changed pin stops here in
    # one line (not OpenSSH's banner), and the key's mode is fixed before ssh loads the key,
    # which it does only after the key exchange. The config may name a key of the user's own.
    openssh.preflight(box, key_missing_ok=True)
    if not backend.proxy_stdio(box):  # kubernetes pumps its WebSocket onto stdio itself
        bridge(open_socket(backend, box))
    return 0


def ssh_config(args: argparse.Namespace) -> int:
    from devbox.ssh import known_hosts, sshconfig

    backend = backend_for(args)
    boxes = backend.list()
    for box in boxes:  # the config is only as good as the pins it points at
        if box.host_key:
            replaced = known_hosts.pin(box.name, box.host_key)
            if replaced:  # the way out of a changed-pin error: said, never silent
                was = ", ".join(known_hosts.fingerprint(k) for k in replaced)
                new_fp = known_hosts.fingerprint(box.host_key)
                say(f"devbox: warning: box {box.name}'s pinned host key is now {new_fp}, was {was}")
    if args.inline:
        sys.stdout.write(sshconfig.render_inline(boxes, proxy_args=backend.proxy_args))
    elif args.write:
        path, changed = sshconfig.write(
            boxes, backend.name, proxy_args=backend.proxy_args, unlisted=backend.unlisted()
        )
        note = (
            "added an Include to ~/.ssh/config" if changed else "~/.ssh/config already includes it"
        )
        print(f"wrote {path}; {note}", file=sys.stderr)
    else:
        sys.stdout.write(sshconfig.render(boxes, proxy_args=backend.proxy_args))
    return 0
