"""`devbox run` on an already claimed local box, against OpenSSH to the same box.

Taken in turns (a round of every figure, repeated), in the start-up modes of
bench_startup.py (harness.MODES: `installed` is what a `pip install .` user runs), with the
load printed:

- First line: from starting `devbox run --box B --sync TREE -- echo first` (a small git tree
  that has not changed since the last sync: the usual case) to the first line of its output
  on the laptop, against `ssh host 'echo first'` (OpenSSH's client straight to the same
  agent); also with --no-sync. Target: the synced run <= 3x the ssh.
- Re-sync: a 5,000-file tree synced once, then one file changed: `devbox sync B TREE`
  against plain rsync with the same filter over the same ssh command. DEVBOX_SYNC=sftp
  (the fallback when rsync is missing) is timed too.

    python benchmarks/bench_run.py [--runs 10] [--files 5000]
        [--modes all|both|bytecode|no-bytecode|installed]
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

if not __package__:
    # Run as a file (python benchmarks/bench_x.py, from any folder), Python puts benchmarks/
    # first on the path: the repo's root takes its place, as under `python -m`, for the
    # benchmarks.* and tests.* imports (neither is an installed package).
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from benchmarks.harness import (
    MODE_CHOICES,
    MODES,
    REPO,
    Sandbox,
    bytecode_env,
    devbox_command,
    emit,
    interleaved,
    machine,
    met,
    mode_setup,
    sandbox,
    ssh_base,
    summary,
    uncompiled_source,
    wall,
)
from devbox.ssh.openssh import KEX_ALGORITHMS


def first_line(argv: list[str], env: dict[str, str]) -> float:
    """Seconds from start to the first line on stdout; the command then runs to its end."""
    start = time.perf_counter()
    proc = subprocess.Popen(
        argv, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    assert proc.stdout is not None and proc.stderr is not None
    line = proc.stdout.readline()
    took = time.perf_counter() - start
    proc.stdout.read()
    err = proc.stderr.read().decode()  # a few lines at most: no pipe fills up
    if proc.wait() != 0 or not line.strip():
        raise SystemExit(f"{argv} failed or printed nothing: {err}")
    return took


def make_tree(root: Path, files: int) -> None:
    for i in range(files):
        folder = root / f"d{i // 100:02d}"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"f{i}.py").write_text(f"# file {i}\n" * 20)
    (root / ".gitignore").write_text("outputs/\n")
    subprocess.run(["git", "-C", str(root), "init", "-q"], check=True)


def _first_lines(
    sb: Sandbox, env: dict[str, str], box: str, runs: int, devbox: list[str]
) -> dict[str, object]:
    record = next(b for b in _boxes(sb, env) if b["name"] == box)
    known = sb.root / "home/.local/state/devbox/known_hosts"
    plain = ssh_base(sb.key, known, int(str(record["port"])), alias=f"{box}.devbox")
    # Like for like: the key exchanges devbox's own ssh runs take.
    openssh = [*plain[:-1], "-o", f"KexAlgorithms={KEX_ALGORITHMS}", plain[-1]]
    small = sb.root / f"small-{box}"
    make_tree(small, 20)
    wall([*devbox, "sync", box, str(small)], env)
    run_cmd = [*devbox, "run", "--box", box]
    samples = interleaved(
        runs,
        {
            "run_sync_unchanged": lambda: first_line(
                [*run_cmd, "--sync", str(small), "--", "echo first"], env
            ),
            "run_no_sync": lambda: first_line([*run_cmd, "--no-sync", "--", "echo first"], env),
            "openssh_cmd": lambda: first_line([*openssh, "echo first"], env),
        },
    )
    s = {name: summary(values) for name, values in samples.items()}
    synced = s["run_sync_unchanged"]["median"] / s["openssh_cmd"]["median"]
    return {
        "first_line_s": s,
        "run_sync_unchanged_over_ssh": round(synced, 3),
        "run_no_sync_over_ssh": round(s["run_no_sync"]["median"] / s["openssh_cmd"]["median"], 3),
        "met": {"run_sync_unchanged_first_line_over_ssh": met(synced, "<=", 3.0)},
    }


def _boxes(sb: Sandbox, env: dict[str, str]) -> list[dict[str, object]]:
    done = subprocess.run(
        [*devbox_command(), "ls", "--json"], env=env, capture_output=True, check=True
    )
    boxes: list[dict[str, object]] = json.loads(done.stdout)
    return boxes


def _resync(sb: Sandbox, env: dict[str, str], box: str, runs: int, files: int) -> dict[str, object]:
    devbox = devbox_command()
    record = next(b for b in _boxes(sb, env) if b["name"] == box)
    known = sb.root / "home/.local/state/devbox/known_hosts"
    openssh = ssh_base(sb.key, known, int(str(record["port"])), alias=f"{box}.devbox")
    tree = sb.root / "tree"
    make_tree(tree, files)
    initial = wall([*devbox, "sync", box, str(tree)], env)
    sftp_env = dict(env, DEVBOX_SYNC="sftp")
    wall([*devbox, "sync", box, str(tree)], sftp_env)  # the sftp copy's own first pass
    rsh = shlex.join(openssh[:-1])
    plain = ["rsync", "-rlpt", "--filter=:- .gitignore", "--exclude=.git", "-e", rsh,
             f"{tree}/", f"{openssh[-1]}:tree/"]  # fmt: skip
    wall(plain, env)
    changes = iter(range(10**6))

    def changed_then(argv: list[str], take_env: dict[str, str]) -> float:
        n = next(changes) * 97 % files
        path = tree / f"d{n // 100:02d}" / f"f{n}.py"
        path.write_text(f"changed {time.time()}\n")
        os.utime(path)
        return wall(argv, take_env)

    samples = interleaved(
        runs,
        {
            "devbox_sync": lambda: changed_then([*devbox, "sync", box, str(tree)], env),
            "plain_rsync": lambda: changed_then(plain, env),
            "devbox_sftp_sync": lambda: changed_then([*devbox, "sync", box, str(tree)], sftp_env),
        },
    )
    s = {name: summary(values) for name, values in samples.items()}
    return {
        "files": files,
        "initial_sync_s": initial,
        "one_changed_s": s,
        "resync_over_plain_rsync": round(
            s["devbox_sync"]["median"] / s["plain_rsync"]["median"], 3
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--files", type=int, default=5000)
    parser.add_argument("--modes", choices=tuple(MODE_CHOICES), default="all")
    args = parser.parse_args()
    before = machine()
    results: dict[str, object] = {}
    with sandbox() as sb, uncompiled_source() as copy:
        for mode in MODE_CHOICES[args.modes]:
            write, source, devbox = mode_setup(mode, sb, REPO, copy)
            env = dict(bytecode_env(sb.env, write=write), PYTHONPATH=str(source))
            box = mode.replace("_", "")
            wall([*devbox, "up", box, "--no-attach"], env)
            results[mode] = {
                "devbox_source": MODES[mode],
                **_first_lines(sb, env, box, args.runs, devbox),
            }
        resync = _resync(sb, bytecode_env(sb.env, write=True), box, args.runs, args.files)
    emit(
        {
            "benchmark": "run",
            "runs": args.runs,
            "machine_before": before,
            "machine_after": machine(),
            "modes": results,
            "resync": resync,
        }
    )


if __name__ == "__main__":
    main()
