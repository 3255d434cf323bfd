"""What each `devbox` command does, given parsed arguments."""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from collections.abc import Callable, Sequence

from devbox import config as config_mod
from devbox import statsview
from devbox.backends.base import Backend
from devbox.boxes import Box, session_warning

# backend_for is re-exported while devbox.cli still asks this module for it.
from devbox.connect import backend_for as backend_for
from devbox.connect import open_socket, prefetch_client, refresh_ssh_config, session
from devbox.errors import EXIT_FAILURE, DevboxError, UsageError
from devbox.names import validate_name


def up(args: argparse.Namespace) -> int:
    if args.name is not None:
        validate_name(args.name)
    backend = backend_for(args)
    attach = not (args.no_attach or args.json) and sys.stdin.isatty() and sys.stdout.isatty()
    if attach:
        prefetch_client(backend)
    spec = backend.resolve(args.profile, gpus=args.gpus)
    box = backend.claim(spec, name=args.name, port=args.port)
    # On Kubernetes the refresh lists the boxes (an API request, 40 ms): beside the
    # session's start, not before it. Joined before the command ends either way.
    refresh = threading.Thread(target=_refresh_ssh_config_or_warn, args=(backend,))
    refresh.start()
    try:
        if args.json:
            print(json.dumps(box.to_json()))
        else:
            gpus = f", GPUs {','.join(box.gpu_ids)}" if box.gpu_ids else ""
            _line(f"box {box.name} is up ({box.backend}{gpus}); `devbox ssh {box.name}` to enter")
        if warning := session_warning(box, preference=config_mod.load().multiplexer):
            _line(warning)
        if not attach:
            return 0
        return session(backend, box, None, interactive=True)
    finally:
        refresh.join()


def _refresh_ssh_config_or_warn(backend: Backend) -> None:
    try:
        refresh_ssh_config(backend)
    except (DevboxError, OSError) as exc:  # the box is up; only its ssh-config entry waits
        message = exc.message if isinstance(exc, DevboxError) else str(exc)
        _line(f"devbox: warning: ssh config not refreshed: {message}")


def _line(text: str) -> None:
    """One line to stderr in one write: print() writes the text and its newline apart, so
    `up`'s line and the ssh-config thread's warning could run together."""
    sys.stderr.write(text + "\n")
    sys.stderr.flush()


def ls(args: argparse.Namespace) -> int:
    backend = backend_for(args)
    boxes = backend.list()
    now = time.time()
    if args.json:
        print(json.dumps([b.to_json() for b in boxes]))
    else:
        rows = [("NAME", "BACKEND", "STATE", "GPUS", "AGE", "IDLE", "RELEASE", "KEPT", "ALERTS")]
        for b in boxes:
            rows.append(
                (
                    b.name,
                    b.backend,
                    b.state.value,
                    str(b.spec.gpus),
                    statsview.age(now - b.created_at),
                    statsview.age(b.idle_seconds(now)),
                    _release_cell(b, now),
                    statsview.age(b.kept_for(now)),
                    # devbox.probe's model alerts (NaN, exploding gradients...): `devbox probe`
                    b.extra.get("alerts", "-"),
                )
            )
        _table(rows)
        for b in boxes:
            if b.reason:
                print(f"{b.name}: {b.reason}", file=sys.stderr)
            note = b.autoscaler_note(now)
            if b.release_at:  # the clock too: "in 4m" is stale once read
                note += f"; at {time.strftime('%H:%M:%S', time.localtime(b.release_at))}"
            if note:
                print(f"{b.name}: {note}", file=sys.stderr)
    problems = backend.problems()
    for problem in problems:
        print(f"devbox: error: {problem}", file=sys.stderr)
    return EXIT_FAILURE if problems else 0


def _release_cell(box: Box, now: float) -> str:
    """The autoscaler's word on the box: when it goes unless used, or that it is unhealthy."""
    if box.release_at:
        return "in " + statsview.age(max(0.0, box.release_at - now))
    return "unhealthy" if box.unhealthy_since else "-"


def down(args: argparse.Namespace) -> int:
    validate_name(args.name)
    backend = backend_for(args)
    released = backend.release(args.name, purge=args.purge, confirm=_destroy_question(args.yes))
    refresh_ssh_config(backend)
    if not released:
        _line(f"box {args.name}'s kept home is deleted")
    else:
        _line(
            f"box {args.name} released"
            + ("; its home is deleted" if args.purge else " (its home is kept)")
        )
    return 0


def _destroy_question(yes: bool) -> Callable[[str], None]:
    """What `release` calls before it deletes a home: a question on a terminal (y/N), and
    --yes anywhere else; it raises, and nothing is changed, without a yes."""

    def confirm(what: str) -> None:
        if yes:
            return
        if not (sys.stdin.isatty() and sys.stderr.isatty()):
            raise UsageError(f"--purge deletes {what}: add --yes to confirm (no terminal to ask)")
        sys.stderr.write(f"delete {what} and everything in it? This cannot be undone [y/N] ")
        sys.stderr.flush()
        if sys.stdin.readline().strip().lower() not in ("y", "yes"):
            raise DevboxError("not confirmed: nothing was changed")

    return confirm


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
                _line(
                    f"devbox: warning: box {box.name}'s pinned host key is now {new_fp}, was {was}"
                )
    if args.inline:
        sys.stdout.write(sshconfig.render_inline(boxes, proxy_args=backend.proxy_args))
    elif args.write:
        path, changed = sshconfig.write(boxes, backend.name, proxy_args=backend.proxy_args)
        note = (
            "added an Include to ~/.ssh/config" if changed else "~/.ssh/config already includes it"
        )
        print(f"wrote {path}; {note}", file=sys.stderr)
    else:
        sys.stdout.write(sshconfig.render(boxes, proxy_args=backend.proxy_args))
    return 0


def pool(args: argparse.Namespace) -> int:
    backend = backend_for(args)
    warm = backend.warm_pool()  # a one-line UsageError where the backend has none
    if args.pool_command == "warm":
        spec = backend.resolve(args.profile, gpus=args.gpus)
        boxes = warm.warm(spec, size=args.size, wait=not args.no_wait)
    else:
        boxes = warm.pool()
    if getattr(args, "json", False):
        print(json.dumps([b.to_json() for b in boxes]))
        return 0
    now = time.time()
    _table(
        [("POD", "PROFILE", "GPUS", "STATE", "AGE")]
        + [
            (
                b.extra.get("pod", b.name),
                b.spec.profile,
                str(b.spec.gpus),
                b.state.value,
                statsview.age(now - b.created_at),
            )
            for b in boxes
        ]
    )
    return 0


def profiles(args: argparse.Namespace) -> int:
    found = backend_for(args).profiles()
    if args.json:
        print(json.dumps([prof.to_json() for prof in found]))
        return 0
    rows = [("NAME", "GPUS", "CPU", "MEMORY", "IMAGE", "NODES", "SOURCE")]
    for prof in sorted(found, key=lambda x: x.name):
        nodes = ",".join(f"{k}={v}" for k, v in prof.node_selector) or "-"
        if prof.tolerations:
            nodes += f" (+{len(prof.tolerations)} toleration(s))"
        image = prof.image or "(config image)"
        rows.append((prof.name, str(prof.gpus), prof.cpu, prof.memory, image, nodes, prof.source))
    _table(rows)
    return 0


def keep(args: argparse.Namespace) -> int:
    until = 0.0 if args.off else time.time() + args.duration
    if args.name is None:  # in a box's terminal: the box it runs in
        from devbox.backends.local.autoscaling import box_here

        backend: Backend
        backend, name = box_here()
    else:
        backend, name = backend_for(args), args.name
    box = backend.keep(name, until=until)
    if args.off:
        print(f"box {box.name} is no longer kept", file=sys.stderr)
    else:
        clock = time.strftime("%a %H:%M", time.localtime(until))
        print(f"box {box.name} is kept until {clock} (idle release waits)", file=sys.stderr)
    return 0


def stats(args: argparse.Namespace) -> int:
    from devbox import protocol
    from devbox.ssh import telemetry

    if args.history and not args.json:
        raise UsageError("--history needs --json (a terminal shows the newest sample only)")
    backend = backend_for(args)
    box = backend.get(args.name)
    if box.state.value not in ("running", "idle"):
        raise UsageError(f"box {box.name} is {box.state.value}: {box.reason or 'not reachable'}")
    watch = args.watch or args.count is not None
    limit = args.count if args.count is not None else (None if watch else 1)
    shown = 0
    clear = not args.json and sys.stdout.isatty()

    def show(frame: protocol.Frame) -> bool:
        nonlocal shown
        if frame.type == protocol.HISTORY:
            for old in frame.body.get("samples", []):
                print(json.dumps(old), flush=False)
            return True
        if args.json:
            print(json.dumps(frame.body), flush=True)
        else:
            # A terminal gets the newest sample in place of the last, as `watch` does.
            text = statsview.render(box.name, protocol.sample(frame))
            sys.stdout.write(("\x1b[H\x1b[2J" if clear and watch else "") + text)
            sys.stdout.flush()
        shown += 1
        return limit is None or shown < limit

    try:
        telemetry.stream(
            box,
            open_socket(backend, box),
            rate=args.rate,
            history=args.history,
            on_frame=show,
        )
    except KeyboardInterrupt:
        return 0  # ctrl-c is how a watch ends
    except BrokenPipeError:
        return 0  # `devbox stats --watch --json | head`
    return 0


def probe(args: argparse.Namespace) -> int:
    from devbox.probecmd import run

    backend = backend_for(args)
    return run(args, backend=backend, open_socket=lambda box: open_socket(backend, box))


def _table(rows: Sequence[tuple[str, ...]]) -> None:
    print("\n".join(statsview.table(rows)))


def autoscaler(args: argparse.Namespace) -> int:
    from devbox.autoscaler import service

    return service.run(args, backend_for(args))


def explain(args: argparse.Namespace) -> int:
    from devbox.autoscaler import service

    if args.name is not None:
        validate_name(args.name)
    return service.explain(args, backend_for(args))


def dispatch(args: argparse.Namespace) -> int:
    handlers = {
        "autoscaler": autoscaler,
        "explain": explain,
        "pool": pool,
        "profiles": profiles,
        "up": up,
        "ls": ls,
        "down": down,
        "ssh": ssh,
        "proxy": proxy,
        "ssh-config": ssh_config,
        "stats": stats,
        "keep": keep,
        "probe": probe,
    }
    return handlers[args.command](args)
