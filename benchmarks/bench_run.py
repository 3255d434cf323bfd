"""`devbox run` on an already claimed local box, against OpenSSH to the same box.

- First line: from starting `devbox run --box B --no-sync -- echo first` to the first line
  of its output on the laptop, against `ssh host 'echo first'` (OpenSSH's client straight
  to the same agent). Also with `--sync` of a small unchanged git tree, the usual case.
- Re-sync: a 5,000-file tree synced once, then one file changed: `devbox sync B TREE`
  against plain rsync with the same filter over the same ssh command. DEVBOX_SYNC=sftp
  (the fallback when rsync is missing) is timed too.

    python benchmarks/bench_run.py [--runs 10] [--files 5000]
"""

from __future__ import annotations

import argparse
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

from benchmarks.harness import devbox_command, emit, sandbox, ssh_base, summary, wall


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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--files", type=int, default=5000)
    args = parser.parse_args()
    devbox = devbox_command()
    with sandbox() as sb:
        sb.devbox("up", "bench", "--no-attach")
        box = sb.box("bench")
        known = sb.root / "home/.local/state/devbox/known_hosts"
        openssh = ssh_base(sb.key, known, int(str(box["port"])), alias="bench.devbox")
        small = sb.root / "small"
        make_tree(small, 20)
        sb.devbox("sync", "bench", str(small))
        run_cmd = [*devbox, "run", "--box", "bench"]
        devbox_first, synced_first, ssh_first = [], [], []
        for _ in range(args.runs):
            devbox_first.append(first_line([*run_cmd, "--no-sync", "--", "echo first"], sb.env))
            synced_first.append(
                first_line([*run_cmd, "--sync", str(small), "--", "echo first"], sb.env)
            )
            ssh_first.append(first_line([*openssh, "echo first"], sb.env))

        tree = sb.root / "tree"
        make_tree(tree, args.files)
        initial = wall([*devbox, "sync", "bench", str(tree)], sb.env)
        sftp_env = dict(sb.env, DEVBOX_SYNC="sftp")
        wall([*devbox, "sync", "bench", str(tree)], sftp_env)  # the sftp copy's own first pass
        rsh = shlex.join(openssh[:-1])
        plain = ["rsync", "-rlpt", "--filter=:- .gitignore", "--exclude=.git", "-e", rsh,
                 f"{tree}/", f"{openssh[-1]}:tree/"]  # fmt: skip
        wall(plain, sb.env)
        devbox_resync: list[float] = []
        rsync_resync: list[float] = []
        sftp_resync: list[float] = []
        for i in range(args.runs):
            for times, argv, env in (
                (devbox_resync, [*devbox, "sync", "bench", str(tree)], sb.env),
                (rsync_resync, plain, sb.env),
                (sftp_resync, [*devbox, "sync", "bench", str(tree)], sftp_env),
            ):
                n = (i * 97 + len(times)) % args.files
                changed = tree / f"d{n // 100:02d}" / f"f{n}.py"
                changed.write_text(f"changed {time.time()} {len(times)}\n")
                os.utime(changed)
                times.append(wall(argv, env))
    ratio_first = summary(devbox_first)["median"] / summary(ssh_first)["median"]
    emit(
        {
            "benchmark": "run",
            "runs": args.runs,
            "files": args.files,
            "devbox_run_no_sync_first_line_s": summary(devbox_first),
            "devbox_run_sync_unchanged_first_line_s": summary(synced_first),
            "peer_openssh_ssh_cmd_first_line_s": summary(ssh_first),
            "run_no_sync_over_ssh": ratio_first,
            "run_sync_over_ssh": summary(synced_first)["median"] / summary(ssh_first)["median"],
            "initial_sync_s": initial,
            "devbox_resync_one_changed_s": summary(devbox_resync),
            "peer_plain_rsync_one_changed_s": summary(rsync_resync),
            "devbox_sftp_resync_one_changed_s": summary(sftp_resync),
            "resync_over_plain_rsync": summary(devbox_resync)["median"]
            / summary(rsync_resync)["median"],
        }
    )


if __name__ == "__main__":
    main()
