"""Proof that the test cluster leaves the host as it found it: a snapshot of what the real
node could change (processes, mounts, iptables, links, cgroups, kernel settings, the
folders the kubelet and containerd write to by default), taken before `up` and compared
after `down`. scripts/test fails the run on any difference.

    python -m tests.cluster.hostcheck save FILE
    python -m tests.cluster.hostcheck compare FILE
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from tests.cluster.realnode.host import sysctls

# Folders whose top level the kubelet, containerd, runc or CNI would write to by default.
FOLDERS = ("/run", "/var/lib", "/var/log", "/opt", "/etc/cni", "/etc/containerd", "/dev")
# What a fresh machine gains on first use of its own tools, not a leak of the cluster's:
# util-linux's mount table (/run/mount/utab, on the first mount) and OpenSSH's privilege
# separation folder (/run/sshd, made for the benchmarks' sshd peer). The suite's own lock
# files are named dbxt-* (tests/e2e/test_local_isolation.py) and stay for the next run.
FIRST_USE = ("/run/mount", "/run/sshd")
SUITE_PREFIX = "dbxt-"
NODE_PROGRAMS = ("containerd", "containerd-shim", "kubelet", "gpuplugin", "pause", "runc")


def _lines(*argv: str) -> list[str]:
    if shutil.which(argv[0]) is None:
        return []
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    return sorted(done.stdout.splitlines()) if done.returncode == 0 else []


def _processes() -> list[str]:
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            comm = (entry / "comm").read_text().strip()
        except OSError:
            continue
        if comm.startswith(NODE_PROGRAMS):
            found.append(comm)
    return sorted(found)


def _mounts() -> list[str]:
    # Mount point and type, as IDs and options change with every mount.
    out = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        left, _, right = line.partition(" - ")
        out.append(f"{left.split()[4]} {right.split()[0]}")
    return sorted(out)


def _cgroups() -> list[str]:
    base = Path("/sys/fs/cgroup")
    return sorted(
        str(d.relative_to(base))
        for hierarchy in base.iterdir()
        if hierarchy.is_dir()
        for d in hierarchy.iterdir()
        if d.is_dir()
    )


def _rules(save: str) -> list[str]:
    """The rules only (`-A ...`): a fresh host has no tables at all until the first iptables
    command, after which the empty ones print their headers; that is no change to traffic."""
    return [line for line in _lines(save) if line.startswith("-")]


def snapshot() -> dict[str, list[str]]:
    return {
        "processes": _processes(),
        "mounts": _mounts(),
        "iptables": _rules("iptables-save"),
        "ip6tables": _rules("ip6tables-save"),
        "links": _lines("ip", "-o", "link", "show"),
        "addresses": _lines("ip", "-o", "addr", "show"),
        "cgroups": _cgroups(),
        "sysctls": sorted(f"{k}={v}" for k, v in sysctls().items()),
        "folders": sorted(
            f"{folder}/{name}"
            for folder in FOLDERS
            if os.path.isdir(folder)
            for name in os.listdir(folder)
            if f"{folder}/{name}" not in FIRST_USE and not name.startswith(SUITE_PREFIX)
        ),
    }


def _normalise(lines: list[str]) -> list[str]:
    # Link and address lines carry counters and ids that change on their own.
    return [line.split(" link/")[0] if " link/" in line else line for line in lines]


def compare(before: dict[str, list[str]], after: dict[str, list[str]]) -> list[str]:
    problems = []
    for key in before:
        old, new = set(_normalise(before[key])), set(_normalise(after.get(key, [])))
        for line in sorted(new - old):
            problems.append(f"{key}: added {line}")
        for line in sorted(old - new):
            problems.append(f"{key}: removed {line}")
    return problems


def main() -> int:
    command, path = sys.argv[1], Path(sys.argv[2])
    if command == "save":
        path.write_text(json.dumps(snapshot()))
        return 0
    problems = compare(json.loads(path.read_text()), snapshot())
    for line in problems:
        print(f"hostcheck: {line}", file=sys.stderr)
    if problems:
        print("hostcheck: the test cluster changed the host (see above)", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
