"""`devbox up`, `ls`, `down`, `keep`, `pool` and `profiles`: claiming, listing and releasing
boxes."""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from collections.abc import Callable

from devbox import config as config_mod
from devbox import saves
from devbox.backends.base import Backend
from devbox.boxes import Box, BoxState, hung_note, session_warning
from devbox.commands import print_table, say
from devbox.connect import backend_for, prefetch_client, refresh_ssh_config, session
from devbox.errors import EXIT_FAILURE, DevboxError, UsageError
from devbox.names import validate_name
from devbox.units import age


def up(args: argparse.Namespace) -> int:
    if args.name is not None:
        validate_name(args.name)
    backend = backend_for(args)
    attach = not (args.no_attach or args.json) and sys.stdin.isatty() and sys.stdout.isatty()
    if attach:
        prefetch_client(backend)
    spec = backend.resolve(args.profile, gpus=args.gpus)
    box = backend.claim(spec, name=args.name)
    # On Kubernetes the refresh lists the boxes (an API request, 40 ms): beside the
    # session's start, not before it. Joined before the command ends either way.
    refresh = threading.Thread(target=_refresh_ssh_config_or_warn, args=(backend,))
    refresh.start()
    try:
        if args.json:
            print(json.dumps(box.to_json()))
        else:
            gpus = f", GPUs {','.join(box.gpu_ids)}" if box.gpu_ids else ""
            say(f"box {box.name} is up ({box.backend}{gpus}); `devbox ssh {box.name}` to enter")
        if warning := session_warning(box, preference=config_mod.load().multiplexer):
            say(warning)
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
        say(f"devbox: warning: ssh config not refreshed: {message}")


def ls(args: argparse.Namespace) -> int:
    backend = backend_for(args)
    boxes = backend.list()
    now = time.time()
    if args.json:
        print(json.dumps([b.to_json() for b in boxes]))
    else:
        # Which cluster, where the user has several (config.toml's [clusters.NAME]).
        where = any(b.cluster for b in boxes)
        second = "CLUSTER" if where else "BACKEND"
        rows = [("NAME", second, "STATE", "GPUS", "AGE", "IDLE", "RELEASE", "KEPT", "ALERTS")]
        for b in boxes:
            rows.append(
                (
                    b.name,
                    b.cluster if where else b.backend,
                    # Running, but stuck (devbox.hang): what the user must see first.
                    "hung" if b.hung_since and b.state is BoxState.RUNNING else b.state.value,
                    str(b.spec.gpus),
                    age(now - b.created_at),
                    age(b.idle_seconds(now)),
                    _release_cell(b, now),
                    age(b.kept_for(now)),
                    # devbox.probe's model alerts (NaN, exploding gradients...): `devbox probe`
                    b.alerts or "-",
                )
            )
        print_table(rows)
        for b in boxes:
            if b.reason:
                print(f"{b.name}: {b.reason}", file=sys.stderr)
            if b.hung_since and b.state is BoxState.RUNNING:
                print(f"{b.name}: {hung_note(b, b.hung_since, now)}", file=sys.stderr)
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
        return "in " + age(max(0.0, box.release_at - now))
    return "unhealthy" if box.unhealthy_since else "-"


def down(args: argparse.Namespace) -> int:
    validate_name(args.name)
    backend = backend_for(args)
    # Training code that registered probe.on_release saves first (devbox.saves).
    within = 0.0 if args.now else config_mod.load().save_timeout
    save = saves.Ask(within=within, reason="down") if within else None
    released = backend.release(
        args.name, purge=args.purge, confirm=_destroy_question(args.yes), save=save
    )
    for result in save.results if save is not None else []:
        say(f"box {args.name}: {saves.line(result)}")
    refresh_ssh_config(backend)
    if not released:
        say(f"box {args.name}'s kept home is deleted")
    else:
        say(
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
    print_table(
        [("POD", "PROFILE", "GPUS", "STATE", "AGE")]
        + [
            (
                b.place or b.name,
                b.spec.profile,
                str(b.spec.gpus),
                b.state.value,
                age(now - b.created_at),
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
    print_table(rows)
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
