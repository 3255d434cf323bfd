"""map_gpu_pids against real processes holding a stand-in for a GPU's device file."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import agent.pidmap
from agent.pidmap import map_gpu_pids
from devbox.protocol import GpuProcess, GpuSample

# Host PIDs as NVML reports them from inside a container: above the kernel's PID_MAX_LIMIT
# (2**22), so no process here can have them.
FOREIGN = 5_000_000
OTHER_FOREIGN = 5_000_001

Hold = Callable[..., int]


def gpu(index: int, *pids: int, kind: str = "compute") -> GpuSample:
    processes: list[GpuProcess] = [
        {
            "pid": pid,
            "box_pid": None,
            "kind": kind,
            "mem_used": None,
            "sm_util": None,
            "mem_util": None,
        }
        for pid in pids
    ]
    return {
        "index": index,
        "uuid": f"GPU-{index}",
        "name": "sim",
        "lost": False,
        "util": None,
        "mem_util": None,
        "mem_used": None,
        "mem_total": None,
        "power_w": None,
        "power_limit_w": None,
        "temp_c": None,
        "sm_clock_mhz": None,
        "pcie_tx_kbs": None,
        "pcie_rx_kbs": None,
        "ecc_corrected": None,
        "ecc_uncorrected": None,
        "processes": processes,
    }


def box_pids_of(sample: GpuSample) -> list[int | None]:
    return [p["box_pid"] for p in sample["processes"]]


@pytest.fixture
def devices(tmp_path: Path) -> Path:
    for minor in (0, 3, 30):
        (tmp_path / f"nvidia{minor}").touch()
    return tmp_path


@pytest.fixture
def holders(devices: Path) -> Iterator[Hold]:
    """hold(minor) starts a process that keeps {devices}/nvidia{minor} open, as a CUDA
    process keeps /dev/nvidia{minor}; every one is killed afterwards."""
    started: list[subprocess.Popen[bytes]] = []

    def hold(*minors: int) -> int:
        opens = " ".join(f'{3 + i}<"{devices}/nvidia{m}"' for i, m in enumerate(minors))
        proc = subprocess.Popen(["sh", "-c", f"exec sleep 3600 {opens}"])
        started.append(proc)
        wanted = {f"{devices}/nvidia{m}" for m in minors}
        deadline = time.monotonic() + 10
        while not wanted <= _open_files(proc.pid):
            assert time.monotonic() < deadline, "the holder never opened its device"
            time.sleep(0.02)
        return proc.pid

    yield hold
    for proc in started:
        proc.kill()
        proc.wait()


def _open_files(pid: int) -> set[str]:
    found = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                found.add(os.readlink(f"/proc/{pid}/fd/{fd}"))
    except OSError:
        pass
    return found


@pytest.fixture(autouse=True)
def fresh_cache() -> None:
    agent.pidmap._cache.clear()


def test_box_pids_map_to_themselves_without_touching_proc(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def forbidden(*args: object) -> None:
        raise AssertionError("(b) ran although (a) mapped everything")

    monkeypatch.setattr(agent.pidmap, "_holders", forbidden)
    monkeypatch.setattr(agent.pidmap, "_exists", forbidden)
    gpus = [gpu(0, 100, 200), gpu(1, 300)]
    map_gpu_pids(gpus, box_pids={100, 200, 300, 400}, minor_numbers={0: 0, 1: 1})
    assert [box_pids_of(g) for g in gpus] == [[100, 200], [300]]


def test_one_foreign_process_and_one_holder_map(holders: Hold, devices: Path) -> None:
    user = holders(3)
    bystander = holders(0)  # another GPU's: not a candidate for 3
    gpus = [gpu(0), gpu(1, FOREIGN)]
    map_gpu_pids(
        gpus,
        box_pids={os.getpid(), user, bystander},
        minor_numbers={0: 0, 1: 3},
        dev_prefix=f"{devices}/nvidia",
    )
    assert box_pids_of(gpus[1]) == [user]


def test_two_holders_cannot_be_told_apart(holders: Hold, devices: Path) -> None:
    first, second = holders(3), holders(3)
    gpus = [gpu(0, FOREIGN)]
    map_gpu_pids(
        gpus,
        box_pids={first, second},
        minor_numbers={0: 3},
        dev_prefix=f"{devices}/nvidia",
    )
    assert box_pids_of(gpus[0]) == [None]


def test_two_foreign_processes_on_one_gpu_stay_unmapped(holders: Hold, devices: Path) -> None:
    user = holders(3)
    gpus = [gpu(0, FOREIGN, OTHER_FOREIGN)]
    map_gpu_pids(gpus, box_pids={user}, minor_numbers={0: 3}, dev_prefix=f"{devices}/nvidia")
    assert box_pids_of(gpus[0]) == [None, None]


def test_a_process_mapped_by_pid_is_not_a_candidate(holders: Hold, devices: Path) -> None:
    # Shared GPU, shared namespace for one of them: the known one is taken by (a), so the
    # other holder is the only candidate left for the foreign PID.
    known, other = holders(3), holders(3)
    gpus = [gpu(0, known, FOREIGN)]
    map_gpu_pids(
        gpus, box_pids={known, other}, minor_numbers={0: 3}, dev_prefix=f"{devices}/nvidia"
    )
    assert box_pids_of(gpus[0]) == [known, other]


def test_compute_and_graphics_entries_of_one_process_both_map(holders: Hold, devices: Path) -> None:
    user = holders(30)
    sample = gpu(0, FOREIGN)
    sample["processes"] += gpu(0, FOREIGN, kind="graphics")["processes"]
    map_gpu_pids([sample], box_pids={user}, minor_numbers={0: 30}, dev_prefix=f"{devices}/nvidia")
    assert box_pids_of(sample) == [user, user]


def test_a_process_holding_several_gpus_maps_on_each(holders: Hold, devices: Path) -> None:
    user = holders(0, 3)
    gpus = [gpu(0, FOREIGN), gpu(1, FOREIGN)]
    map_gpu_pids(gpus, box_pids={user}, minor_numbers={0: 0, 1: 3}, dev_prefix=f"{devices}/nvidia")
    assert [box_pids_of(g) for g in gpus] == [[user], [user]]


def test_unknowns_stay_unmapped(holders: Hold, devices: Path) -> None:
    user = holders(3)
    prefix = f"{devices}/nvidia"
    # The GPU's minor number is unknown.
    gpus = [gpu(0, FOREIGN)]
    map_gpu_pids(gpus, box_pids={user}, minor_numbers={0: None}, dev_prefix=prefix)
    assert box_pids_of(gpus[0]) == [None]
    # The PID names a live process here that is not the box's: with a shared namespace
    # it is someone else's job on the GPU, never the box's one holder.
    gpus = [gpu(0, os.getppid())]
    map_gpu_pids(gpus, box_pids={user}, minor_numbers={0: 3}, dev_prefix=prefix)
    assert box_pids_of(gpus[0]) == [None]
    # No box process holds the device.
    gpus = [gpu(0, FOREIGN)]
    map_gpu_pids(gpus, box_pids={os.getpid()}, minor_numbers={0: 3}, dev_prefix=prefix)
    assert box_pids_of(gpus[0]) == [None]


def test_a_cached_holder_that_exited_is_not_mapped(holders: Hold, devices: Path) -> None:
    user = holders(0, 3)
    prefix = f"{devices}/nvidia"
    gpus = [gpu(0, FOREIGN), gpu(1, FOREIGN)]
    map_gpu_pids(gpus, box_pids={user}, minor_numbers={0: 0, 1: 3}, dev_prefix=prefix)
    assert [box_pids_of(g) for g in gpus] == [[user], [user]]
    os.kill(user, signal.SIGKILL)
    os.waitpid(user, 0)
    # The caller's listing is a tick behind and the open files are cached: still no map.
    gpus = [gpu(0, FOREIGN), gpu(1, FOREIGN)]
    map_gpu_pids(gpus, box_pids={user}, minor_numbers={0: 0, 1: 3}, dev_prefix=prefix)
    assert [box_pids_of(g) for g in gpus] == [[None], [None]]
