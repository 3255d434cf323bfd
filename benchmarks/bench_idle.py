"""What an idle box costs the machine: memory (PSS) and CPU with nobody attached or watching.

A local box in a sandbox gets its persistent session the way a user's first `ssh -tt` makes
one (`screen -dmS SESSION`: the multiplexer's server and the shell in it), then nothing is
attached and nothing subscribes to telemetry. Its processes are the keeper and all its
descendants (the keeper is their subreaper, so this is exactly the box): the keeper, the
agent, screen's server and the bash in it. The peer, in the same run: OpenSSH's sshd on
loopback, given one `ssh -tt HOST 'screen -dmS SESSION'` the same way; its processes are the
listening sshd, screen's server and its bash (the per-connection sshd is gone by then).

The box's agent reads bytecode where it is cached (`bytecode_cached` in the output: a `pip
install .` user has it; so has an editable checkout once anything wrote it) and may write
it. Once the agent has had no client for --settle seconds (past the 30 s after which a quiet
box's sampler slows down, agent.activity.QUIET_AFTER):

- PSS of each process (/proc/PID/smaps_rollup), --takes times, interleaved over the sets;
- over --windows windows of --seconds each, all sets at once: CPU time from the kernel's
  scheduler (/proc/PID/task/*/schedstat, nanoseconds; utime+stime clock ticks beside it)
  and wake-ups: voluntary context switches, summed over every thread (each is a thread
  that went to sleep, so had woken); involuntary ones (preempted by other work on a busy
  machine) beside them.

Beside them, PSS read with the box's: the floor of such a box, a bare `python -I -S` (the
keeper's interpreter) and a bare `python -c "import asyncssh"` (the agent's server library,
with asyncio, ssl and cryptography), with the box's own screen server and bash.

Targets (issue 22): an idle box <= 15 MiB PSS; 0% of a core, i.e. under one clock tick of
CPU per minute (<= 0.0167%), with its wake-ups per minute reported.

    python benchmarks/bench_idle.py [--seconds 60] [--windows 2] [--settle 45] [--takes 3]
                                    [--gpus N]  (N simulated GPUs at rest; default none)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

if not __package__:
    # Run as a file (python benchmarks/bench_x.py, from any folder), Python puts benchmarks/
    # first on the path: the repo's root takes its place, as under `python -m`, for the
    # benchmarks.* and tests.* imports (neither is an installed package).
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from benchmarks.harness import (
    Sandbox,
    bytecode_cached,
    bytecode_env,
    devbox_command,
    emit,
    interleaved,
    machine,
    met,
    sandbox,
    ssh_base,
)
from benchmarks.sshpeer import sshd_peer
from devbox.backends.local.keeper import descendants
from devbox.boxes import session_name
from tests import nvml_sim  # the simulator lives with the tests

TARGET_PSS_MIB = 15.0
BOX = "idle"
CLK_TCK = os.sysconf("SC_CLK_TCK")


@dataclass
class ProcessSet:
    """The processes of one idle box (or of the peer)."""

    name: str
    pids: list[int]

    def comms(self) -> dict[int, str]:
        return {pid: _comm(pid) for pid in self.pids}


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return "?"


def _rollup(pid: int) -> dict[str, int]:
    """smaps_rollup's figures in KiB: Pss, Rss, Private_* (USS)."""
    out: dict[str, int] = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
        key, _, rest = line.partition(":")
        fields = rest.split()
        if fields and fields[-1] == "kB":
            out[key] = int(fields[0])
    return out


def _tasks(pid: int) -> list[Path]:
    try:
        return [Path(e.path) for e in os.scandir(f"/proc/{pid}/task")]
    except OSError:
        return []


def _counters(pid: int) -> tuple[int, int, int, int]:
    """(scheduler ns on CPU, clock ticks user+system, voluntary and involuntary context
    switches), every thread."""
    ns = woke = preempted = 0
    for task in _tasks(pid):
        try:
            ns += int((task / "schedstat").read_text().split()[0])
            for line in (task / "status").read_text().splitlines():
                if line.startswith("voluntary_ctxt_switches:"):
                    woke += int(line.split()[1])
                elif line.startswith("nonvoluntary_ctxt_switches:"):
                    preempted += int(line.split()[1])
        except (OSError, ValueError, IndexError):
            continue  # a thread that ended between the listing and the read
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
        fields = stat[stat.rfind(b")") + 2 :].split()
        ticks = int(fields[11]) + int(fields[12])
    except (OSError, ValueError, IndexError):
        ticks = 0
    return ns, ticks, woke, preempted


def _pss(sets: list[ProcessSet], takes: int) -> dict[str, dict[int, dict[str, float]]]:
    """Per set, per pid: median Pss/Rss/Uss (KiB) over `takes` interleaved reads."""
    samples: dict[tuple[str, int, str], list[float]] = {}

    def take(s: ProcessSet) -> float:
        total = 0.0
        for pid in s.pids:
            r = _rollup(pid)
            uss = r.get("Private_Clean", 0) + r.get("Private_Dirty", 0)
            for key, value in (("pss", r["Pss"]), ("rss", r["Rss"]), ("uss", uss)):
                samples.setdefault((s.name, pid, key), []).append(value)
            total += r["Pss"]
        return total

    interleaved(takes, {s.name: (lambda s=s: take(s)) for s in sets})  # type: ignore[misc]
    out: dict[str, dict[int, dict[str, float]]] = {}
    for (name, pid, key), values in samples.items():
        out.setdefault(name, {}).setdefault(pid, {})[key] = statistics.median(values)
    return out


def _window(sets: list[ProcessSet], seconds: float) -> dict[str, dict[int, dict[str, float]]]:
    """Every set's counters over the same `seconds`: all idle at once, one load for all."""
    before = {(s.name, pid): _counters(pid) for s in sets for pid in s.pids}
    t0 = time.monotonic()
    time.sleep(seconds)  # the measurement: nothing to wait for but time itself
    wall = time.monotonic() - t0
    out: dict[str, dict[int, dict[str, float]]] = {}
    for s in sets:
        for pid in s.pids:
            ns0, ticks0, woke0, pre0 = before[(s.name, pid)]
            ns1, ticks1, woke1, pre1 = _counters(pid)
            out.setdefault(s.name, {})[pid] = {
                "cpu_pct": 100 * (ns1 - ns0) / 1e9 / wall,
                "ticks": ticks1 - ticks0,
                "wakeups_per_min": (woke1 - woke0) * 60 / wall,
                "preempted_per_min": (pre1 - pre0) * 60 / wall,
            }
    return out


def _screen_server(session: str) -> int:
    """The pid of the screen server that runs `session` (its cmdline holds the name)."""
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            try:
                argv = Path(entry.path, "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if argv[0].endswith(b"SCREEN") and session.encode() in argv:
                return int(entry.name)
        time.sleep(0.05)
    raise SystemExit(f"no screen server for {session}")


def _start_session(base: list[str], session: str, env: dict[str, str]) -> None:
    """One `ssh -tt HOST 'screen -dmS SESSION'`: the server and its shell, then it detaches.
    It waits until screen lists the session: a server still starting when the connection
    ends shares its hangup (either server's) and dies."""
    wait = f"until screen -ls {session} | grep -q Detached; do sleep 0.05; done"
    subprocess.run(
        [*base[:-1], "-tt", base[-1], f"screen -dmS {session}; {wait}"],
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        check=True,
        timeout=60,
    )


def _box(sb: Sandbox, name: str, gpus: int) -> ProcessSet:
    env = bytecode_env(sb.env, write=True)
    out = subprocess.run(
        [*devbox_command(), "up", name, "--no-attach", "--json", "--gpus", str(gpus)],
        env=env,
        capture_output=True,
        stdin=subprocess.DEVNULL,
        check=True,
    )
    record = json.loads(out.stdout)
    known = sb.root / "home/.local/state/devbox/known_hosts"
    base = ssh_base(sb.key, known, int(record["port"]), alias=f"{name}.devbox")
    _start_session(base, session_name(name), sb.env)
    screen = _screen_server(session_name(name))
    folder = sb.root / "home/.local/state/devbox/local/boxes" / name
    keeper = int((folder / "keeper.lock").read_text())
    return ProcessSet(name, [keeper, int(record["extra"]["pid"]), screen])


def _settled(sb: Sandbox, box: ProcessSet, listener: int, screen: int) -> bool:
    """The box has no client and no process but the idle ones (the keeper's descendants are
    the agent, screen's server and its shell), sshd's connection processes are gone, and
    each shell has done starting (a bashrc's commands are its children for a moment)."""
    keeper, agent, box_screen = box.pids
    path = sb.root / "home/.local/state/devbox/local/boxes" / box.name / "activity.json"
    try:
        clients = json.loads(path.read_text())["clients"]
    except (OSError, ValueError, KeyError):
        return False
    shells = descendants(box_screen)
    if clients or len(shells) != 1 or len(descendants(screen)) != 1:
        return False
    return descendants(keeper) == {agent, box_screen, *shells} and not descendants(listener)


def _wait_idle(check: Callable[[], bool], settle: float) -> None:
    """Until `check` has held for a second on end (a shell that is still starting forks
    and waits in bursts), then `settle` more."""
    deadline = time.monotonic() + 30
    held_since = None
    while held_since is None or time.monotonic() - held_since < 1.0:
        if not check():
            held_since = None
        elif held_since is None:
            held_since = time.monotonic()
        if time.monotonic() > deadline:
            raise SystemExit("the box or the peer still has a connection's processes")
        time.sleep(0.05)
    time.sleep(settle)  # what an idle box does from here on is what is measured


# The least an agent and a keeper can be, in the same interpreter: CPython with asyncssh
# (asyncio, ssl, cryptography) imported and nothing else, and `python -I -S` (the keeper's
# standard library only, without even that). Each says when it is ready, then waits.
FLOORS = {
    "floor_keeper": ["-I", "-S", "-c", "import sys; print(1, flush=True); sys.stdin.read()"],
    "floor_agent": ["-c", "import sys, asyncssh; print(1, flush=True); sys.stdin.read()"],
}


@contextlib.contextmanager
def _floors(env: dict[str, str]) -> Iterator[dict[str, int]]:
    procs = {
        name: subprocess.Popen(
            [sys.executable, *argv],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,  # cryptography's deprecation warnings
        )
        for name, argv in FLOORS.items()
    }
    try:
        for p in procs.values():
            assert p.stdout is not None
            p.stdout.readline()  # imported
        yield {name: p.pid for name, p in procs.items()}
    finally:
        for p in procs.values():
            p.kill()
            p.wait()


def _mib(kib: float) -> float:
    return round(kib / 1024, 2)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=60.0, help="length of one CPU window")
    parser.add_argument("--windows", type=int, default=2)
    parser.add_argument("--settle", type=float, default=45.0, help="idle this long first")
    parser.add_argument("--takes", type=int, default=3, help="PSS reads per process")
    parser.add_argument(
        "--gpus", type=int, default=0, help="simulated idle GPUs of the box (NVML simulator)"
    )
    args = parser.parse_args()
    if not shutil.which("screen"):
        raise SystemExit("benchmark needs screen: apt-get install screen")
    with sandbox() as sb:
        if args.gpus:
            # The project's NVML simulator (nvidia-ml-py's real code runs): GPUs at rest.
            nvml_dir = sb.root / "nvml"
            nvml_sim.build(nvml_dir)
            gpu_file = sb.root / "gpus.txt"
            nvml_sim.write(gpu_file, [nvml_sim.SimGpu(power_limit_mw=700_000)] * args.gpus)
            sb.env.update(LD_LIBRARY_PATH=str(nvml_dir), DEVBOX_NVML_SIM=str(gpu_file))
        sb.devbox("up", "warmup", "--no-attach")  # first use makes the user's key
        sb.devbox("down", "warmup", "--purge", "--yes")
        box = _box(sb, BOX, args.gpus)
        # The peer's sessions run as a throwaway user with an empty home (sshpeer): its
        # shell reads no ~/.bashrc, as the box's shell in its sandbox home reads none.
        with sshd_peer(sb.key.with_name("id_ed25519.pub")) as peer:
            peer_session = f"peer-{sb.root.name}"
            _start_session(peer.base(sb.key), peer_session, sb.env)
            screen = _screen_server(peer_session)
            listener = peer.pid
            _wait_idle(lambda: _settled(sb, box, listener, screen), args.settle)
            keeper, agent, box_screen = box.pids
            sets = [
                ProcessSet(box.name, [keeper, agent, box_screen, *descendants(box_screen)]),
                ProcessSet("sshd", [listener, screen, *sorted(descendants(screen))]),
            ]
            comms = {s.name: s.comms() for s in sets}
            with _floors(sb.env) as floors:
                shells = [box_screen, *descendants(box_screen)]
                floor = ProcessSet(
                    "floor", [floors["floor_keeper"], floors["floor_agent"], *shells]
                )
                pss = _pss([*sets, floor], args.takes)
            windows = [_window(sets, args.seconds) for _ in range(args.windows)]
            pss_after = _pss(sets, 1)  # a box that grows while idle shows here
            subprocess.run(
                ["screen", "-S", peer_session, "-X", "quit"], capture_output=True, check=False
            )
    result: dict[str, object] = {
        "benchmark": "idle",
        "machine": machine(),
        "bytecode_cached": bytecode_cached(),
        "gpus": args.gpus,
    }
    sets_out: dict[str, object] = {}
    totals: dict[str, dict[str, float]] = {}
    for s in sets:
        procs = []
        for pid in s.pids:
            cpu = [w[s.name][pid] for w in windows]
            procs.append(
                {
                    "pid": pid,
                    "comm": comms[s.name][pid],
                    "pss_mib": _mib(pss[s.name][pid]["pss"]),
                    "uss_mib": _mib(pss[s.name][pid]["uss"]),
                    "rss_mib": _mib(pss[s.name][pid]["rss"]),
                    "pss_mib_after_windows": _mib(pss_after[s.name][pid]["pss"]),
                    "cpu_pct_of_one_core": [round(c["cpu_pct"], 4) for c in cpu],
                    "clock_ticks": [int(c["ticks"]) for c in cpu],
                    "wakeups_per_min": [round(c["wakeups_per_min"], 1) for c in cpu],
                    "preempted_per_min": [round(c["preempted_per_min"], 1) for c in cpu],
                }
            )
        total_cpu = [sum(w[s.name][p]["cpu_pct"] for p in s.pids) for w in windows]
        total_wake = [sum(w[s.name][p]["wakeups_per_min"] for p in s.pids) for w in windows]
        totals[s.name] = {
            "pss_mib": _mib(sum(pss[s.name][p]["pss"] for p in s.pids)),
            "cpu_pct_of_one_core": round(max(total_cpu), 4),
            "wakeups_per_min": round(max(total_wake), 1),
        }
        sets_out[s.name] = {"processes": procs, "total": totals[s.name]}
    result.update(
        {
            "seconds_per_window": args.seconds,
            "windows": args.windows,
            "counted": "box: the keeper and every descendant (agent, screen's server, its "
            "bash); sshd: the listener, screen's server, its bash",
            "sets": sets_out,
            "box_over_sshd_pss": round(totals[BOX]["pss_mib"] / totals["sshd"]["pss_mib"], 2),
            # What the same box would be if its keeper and agent were the bare interpreters
            # above (screen's server and its bash are the box's own, measured with them).
            "floor": {
                "keeper_python_I_S_pss_mib": _mib(pss["floor"][floors["floor_keeper"]]["pss"]),
                "agent_import_asyncssh_pss_mib": _mib(pss["floor"][floors["floor_agent"]]["pss"]),
                "box_pss_mib": _mib(sum(v["pss"] for v in pss["floor"].values())),
            },
            # One clock tick in a minute, the least /proc's utime+stime can show.
            "met": {
                "idle_box_pss_mib": met(totals[BOX]["pss_mib"], "<=", TARGET_PSS_MIB),
                "idle_box_cpu_pct_of_one_core": met(
                    totals[BOX]["cpu_pct_of_one_core"],
                    "<=",
                    round(100 / CLK_TCK / 60, 4),
                ),
            },
        }
    )
    emit(result)


if __name__ == "__main__":
    main()
