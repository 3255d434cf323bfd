"""`devbox run`, `runs`, `logs`, `attach`, `kill` and `sync`, given parsed arguments."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from devbox import offers
from devbox.backends.base import Backend
from devbox.boxes import Box
from devbox.connect import backend_for, refresh_ssh_config
from devbox.errors import EXIT_FAILURE, DevboxError, UsageError
from devbox.names import validate_name
from devbox.runs import record, remote, sync
from devbox.runs.boxside import encode_spec
from devbox.units import age, table


def _run_id(text: str) -> str:
    if not record.valid_id(text):
        raise UsageError(f"{text!r} is not a run id (see `devbox runs`)")
    return text


def _words(cmd: list[str]) -> list[str]:
    return cmd[1:] if cmd[:1] == ["--"] else cmd


def _box_for_run(backend: Backend, args: argparse.Namespace) -> Box:
    if args.box is not None:
        return remote.live(backend, args.box)
    box = backend.claim(backend.resolve("default", gpus=args.gpus))
    refresh_ssh_config(backend)
    gpus = f", GPUs {','.join(box.gpu_ids)}" if box.gpu_ids else ""
    print(f"claimed box {box.name} ({box.backend}{gpus})", file=sys.stderr)
    return box


def _say_synced(box: Box, synced: sync.Synced) -> None:
    sent = synced.sent
    names = ", ".join(sent[:5]) + (f" and {len(sent) - 5} more" if len(sent) > 5 else "")
    what = f"{len(sent)} changed file{'s' if len(sent) != 1 else ''}" + (
        f" ({names})" if sent else ""
    )
    print(f"synced {what} to {box.name}:{synced.dest} ({synced.method})", file=sys.stderr)


def run(args: argparse.Namespace) -> int:
    words = _words(args.cmd)
    if not words:
        raise UsageError("nothing to run: devbox run [--box NAME | --gpus N] -- CMD ...")
    if args.box is not None and args.gpus is not None:
        raise UsageError("--box uses a box you have; --gpus claims a new one: pick one")
    if args.box is not None:
        validate_name(args.box)
    src = None if args.no_sync else sync.check_readable(Path(args.sync or "."))
    backend = backend_for(args)
    box = _box_for_run(backend, args)
    spec: dict[str, object] = {"id": record.new_id(), "command": " ".join(words)}
    # A followed run's helper starts in the box while the tree syncs (remote.GatedStart).
    gated = remote.GatedStart.open(backend, box) if src is not None and not args.detach else None
    if src is not None:
        try:
            tree = sync.inspect(src)
            synced = sync.push(backend, box, src)
        except BaseException:
            if gated is not None:
                gated.cancel()
            raise
        _say_synced(box, synced)
        spec.update(cwd=synced.dest, source=str(src), git_commit=tree.commit, git_dirty=tree.dirty)
    run_id = str(spec["id"])
    offers.remember_runs(box.name, [run_id])
    hint = (
        f"`devbox logs {box.name} {run_id} -f` follows it, "
        f"`devbox attach {box.name} {run_id}` joins its window"
    )
    if args.detach:
        remote.start_detached(backend, box, encode_spec(spec))
        print(run_id)
        print(f"run {run_id} started on box {box.name}; {hint}", file=sys.stderr)
        return 0
    print(f"run {run_id} on box {box.name} (ctrl-c detaches; the run goes on)", file=sys.stderr)
    try:
        if gated is not None and gated.ready():
            status = gated.go(encode_spec(spec))
        else:
            status = remote.session(backend, box, "start", encode_spec(spec), "--follow")
    except KeyboardInterrupt:
        print(f"\ndetached from run {run_id}; it goes on: {hint}", file=sys.stderr)
        return 0
    if status != 255:
        _notify(box.name, run_id, status)
    return status


def _notify(box: str, run_id: str, status: int) -> None:
    """A desktop notification: the user who left `devbox run` following may be elsewhere."""
    from devbox import desktop

    how = "finished" if status == 0 else f"ended with status {status}"
    desktop.notify(f"devbox: run {run_id} {how}", f"on box {box}")


def _row(run: record.Run, now: float) -> tuple[str, ...]:
    took = run.duration(now)
    commit = run.git_commit[:10] if run.git_commit else "-"
    if run.git_commit and run.git_dirty:
        commit += "+"
    return (
        run.box,
        run.id,
        run.state,
        run.outcome(),
        time.strftime("%m-%d %H:%M", time.localtime(run.created_at)),
        age(took) if took is not None else "-",
        "-" if run.gpus is None else (run.gpus or "none"),
        commit,
        run.command[:60],
    )


def runs(args: argparse.Namespace) -> int:
    backend = backend_for(args)
    if args.name is not None:
        boxes = [remote.live(backend, args.name)]
    else:
        boxes = [b for b in backend.list() if b.state.value in ("running", "idle")]
    found: list[record.Run] = []
    problems: list[str] = []

    def one(box: Box) -> list[record.Run] | str:
        try:
            return remote.list_runs(backend, box)
        except DevboxError as exc:
            if args.name is not None:
                raise
            return f"box {box.name}: {exc.message}"

    from concurrent.futures import ThreadPoolExecutor  # only here: 20 ms of `devbox run`

    with ThreadPoolExecutor(max_workers=8) as pool:
        for box, result in zip(boxes, pool.map(one, boxes), strict=True):
            if isinstance(result, str):
                problems.append(result)
                continue
            found.extend(result)
            offers.remember_runs(box.name, [r.id for r in result], replace=True)
    if args.json:
        print(json.dumps([r.to_json() for r in found]))
    else:
        now = time.time()
        rows = [("BOX", "RUN", "STATE", "EXIT", "STARTED", "TOOK", "GPUS", "COMMIT", "COMMAND")]
        print("\n".join(table(rows + [_row(r, now) for r in found])))
    for problem in problems:
        print(f"devbox: error: {problem}", file=sys.stderr)
    return EXIT_FAILURE if problems else 0


def logs(args: argparse.Namespace) -> int:
    backend = backend_for(args)
    box = remote.live(backend, args.name)
    words = ["log", _run_id(args.run)] + (["--follow"] if args.follow else [])
    try:
        return remote.session(backend, box, *words)
    except KeyboardInterrupt:
        return 0  # ctrl-c is how following ends; the run goes on
    except BrokenPipeError:
        return 0


def attach(args: argparse.Namespace) -> int:
    run_id = _run_id(args.run)
    if not (sys.stdin.isatty() and sys.stdout.isatty()):
        raise UsageError(
            f"attach needs a terminal; `devbox logs {args.name} {run_id} -f` follows the log"
        )
    backend = backend_for(args)
    box = remote.live(backend, args.name)
    return remote.session(backend, box, "attach", run_id, interactive=True)


def kill(args: argparse.Namespace) -> int:
    run_id = _run_id(args.run)
    backend = backend_for(args)
    return remote.session(backend, remote.live(backend, args.name), "kill", run_id)


def sync_(args: argparse.Namespace) -> int:
    src = sync.check_readable(Path(args.dir))
    backend = backend_for(args)
    box = remote.live(backend, args.name)
    _say_synced(box, sync.push(backend, box, src))
    return 0
