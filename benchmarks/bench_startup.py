"""Claim latency on the local backend and the CLI's start-up, each beside its peer.

Taken in turns (a round of every figure, repeated), in three modes (harness.MODES): this
checkout's editable install with Python allowed to write bytecode; an uncompiled copy under
PYTHONDONTWRITEBYTECODE=1 (compiled by every command); and `installed`, as `pip install .`
leaves it (harness.installed_devbox: no editable hook, bytecode cached), what a user runs:

- `devbox up NAME --no-attach` then `devbox ssh NAME -- true` (target: median <= 0.3 s);
- `devbox ssh NAME -- true` on a running box against OpenSSH's own `ssh` straight to the
  same agent (target: <= 2x); and the floor of any Python front end to OpenSSH: a script
  that reads the box's record and spawns the same ssh, nothing else. All three take the
  key exchanges devbox's own ssh runs take (devbox.ssh.openssh.KEX_ALGORITHMS); OpenSSH
  with its defaults is timed too (9.0-9.8 then take sntrup761x25519, tens of milliseconds
  more); devbox's own share (devbox ssh minus OpenSSH's) is printed beside the floor's;
- `devbox --help` against a bare `python -c pass`.

    python benchmarks/bench_startup.py [--runs 15] [--modes all|both|bytecode|no-bytecode|installed]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
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

# The least a Python program must do to put OpenSSH on a box: start, read the box's record,
# spawn ssh with devbox's options and wait. What devbox's own start-up is measured against.
FLOOR = """
import json, os, sys
state = os.path.expanduser("~/.local/state/devbox")
with open(f"{state}/local/boxes/{sys.argv[1]}/box.json") as f:
    box = json.load(f)
argv = ["ssh", "-F", "/dev/null", "-i", os.path.expanduser("~/.config/devbox/id_ed25519"),
        "-o", "IdentitiesOnly=yes", "-o", f"UserKnownHostsFile={state}/known_hosts",
        "-o", "StrictHostKeyChecking=yes", "-o", f"HostKeyAlias={sys.argv[1]}.devbox",
        "-o", "BatchMode=yes", "-o", f"KexAlgorithms={sys.argv[2]}", "-p", str(box["port"]),
        box["host"], *sys.argv[3:]]
pid = os.posix_spawnp("ssh", argv, os.environ)
sys.exit(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
"""


def _mode(
    sb: Sandbox, runs: int, *, write: bool, source: Path, devbox: list[str]
) -> dict[str, object]:
    env = dict(bytecode_env(sb.env, write=write), PYTHONPATH=str(source))
    # The Python that runs devbox (and, through the launcher, the agent and its helpers).
    python = str(Path(devbox[0]).with_name("python")) if len(devbox) == 1 else devbox[0]
    counter = iter(range(10**6))
    # First use makes the user's key (and, allowed to, writes devbox's bytecode).
    wall([*devbox, "up", "warmup", "--no-attach"], env)
    wall([*devbox, "ssh", "warmup", "--", "true"], env)
    wall([*devbox, "down", "warmup", "--purge", "--yes"], env)
    wall([*devbox, "up", "steady", "--no-attach"], env)
    box = json.loads(sb.devbox("ls", "--json").stdout)[0]
    known = sb.root / "home/.local/state/devbox/known_hosts"
    plain = ssh_base(sb.key, known, int(box["port"]), alias="steady.devbox")
    # Like for like: the key exchanges devbox's own ssh runs take.
    openssh = [*plain[:-1], "-o", f"KexAlgorithms={KEX_ALGORITHMS}", plain[-1]]
    floor = [python, "-c", FLOOR, "steady", KEX_ALGORITHMS, "true"]

    def up_then_ssh() -> float:
        name = f"b{next(counter)}"
        took = wall([*devbox, "up", name, "--no-attach"], env)
        took += wall([*devbox, "ssh", name, "--", "true"], env)
        wall([*devbox, "down", name, "--purge", "--yes", "--now"], env)
        return took

    samples = interleaved(
        runs,
        {
            "up_then_ssh_true": up_then_ssh,
            "devbox_ssh_true": lambda: wall([*devbox, "ssh", "steady", "--", "true"], env),
            "openssh_ssh_true": lambda: wall([*openssh, "true"], env),
            # What a bare client negotiates: OpenSSH 9.0-9.8 take sntrup761x25519 from the
            # agent, whose key pair they make in tens of milliseconds (KEX_ALGORITHMS).
            "openssh_ssh_true_default_kex": lambda: wall([*plain, "true"], env),
            "python_floor_ssh_true": lambda: wall(floor, env),
            "devbox_help": lambda: wall([*devbox, "--help"], env),
            "python_pass": lambda: wall([python, "-c", "pass"], env),
        },
    )
    wall([*devbox, "down", "steady", "--purge", "--yes", "--now"], env)
    s = {name: summary(values) for name, values in samples.items()}
    ssh_ratio = s["devbox_ssh_true"]["median"] / s["openssh_ssh_true"]["median"]
    peer = s["openssh_ssh_true"]["median"]
    return {
        "seconds": s,
        "devbox_ssh_over_openssh": round(ssh_ratio, 3),
        "python_floor_over_openssh": round(
            s["python_floor_ssh_true"]["median"] / s["openssh_ssh_true"]["median"], 3
        ),
        # devbox's own share (its Python, before and around the same ssh) and the least
        # any Python front end has: these hold whatever key exchange OpenSSH takes.
        "devbox_own_s": round(s["devbox_ssh_true"]["median"] - peer, 4),
        "python_floor_own_s": round(s["python_floor_ssh_true"]["median"] - peer, 4),
        "help_over_python_pass": round(s["devbox_help"]["median"] / s["python_pass"]["median"], 3),
        "met": {
            "up_then_ssh_true_median_s": met(s["up_then_ssh_true"]["median"], "<=", 0.3),
            "devbox_ssh_over_openssh": met(ssh_ratio, "<=", 2.0),
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=15)
    parser.add_argument("--modes", choices=tuple(MODE_CHOICES), default="all")
    parser.add_argument(
        "--source",
        type=Path,
        default=REPO,
        help="run devbox from this tree (an older commit's `git archive`, say) in the "
        "bytecode mode; default: this checkout",
    )
    args = parser.parse_args()
    if shutil.which("ssh") is None:
        raise SystemExit("benchmark needs OpenSSH's client: apt-get install openssh-client")
    before = machine()
    results = {}
    with sandbox() as sb, uncompiled_source() as copy:
        for mode in MODE_CHOICES[args.modes]:
            write, source, devbox = mode_setup(mode, sb, args.source.resolve(), copy)
            results[mode] = {
                "devbox_source": MODES[mode],
                **_mode(sb, args.runs, write=write, source=source, devbox=devbox),
            }
    emit(
        {
            "benchmark": "startup",
            "runs": args.runs,
            "machine_before": before,
            "machine_after": machine(),
            "source": str(args.source.resolve()),
            "modes": results,
        }
    )


if __name__ == "__main__":
    main()
