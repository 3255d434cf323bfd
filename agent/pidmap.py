"""Which of the box's processes is each process NVML lists on a GPU.

NVML reports the PIDs the driver knows: host PIDs. Where the agent shares the host's PID
namespace (a local box, a hostPID pod) those are the box's own PIDs; inside a container
with its own PID namespace they name nothing the box can see, so the box's PID is found
another way. Per GPU process, in order:

(a) a PID in box_pids is the box's own process. This alone serves local boxes and hostPID
    pods, and when it maps every process nothing else runs: no file system access at all.
(b) otherwise, the box's processes that hold the GPU's device file (/dev/nvidia<minor>)
    open are its candidates. When exactly one NVML process on that GPU is unmapped and
    exactly one candidate is unmapped, they are the same process.
(c) anything else stays unmapped (box_pid None): a wrong PID would be worse than none.

What works: one training process per GPU in a container (the common case), any number of
processes per GPU with a shared PID namespace, and a process spanning several GPUs (each
GPU is matched on its own).

What does not:
- Two or more processes on one GPU inside a container (DDP workers sharing a GPU, a
  training run plus a notebook) cannot be told apart: all hold the same device file and
  NVML gives no other link. /proc/PID/status NSpid would give the host PID, but it lists
  only the namespaces at or below the one the /proc mount belongs to, so from inside the
  container it shows the container PID alone; /proc/PID/sched's first line shows the
  host PID on some kernels but not on current ones. Neither is relied on.
- An NVML PID that names a live process in the agent's own namespace is never matched
  by (b): with a shared namespace such a process is simply not the box's (another user's
  job on the GPU), and it must not be pinned on the one box process that uses the GPU.
  Inside a container a host PID that happens to equal a live container PID is therefore
  missed by (b), and if it equals one of the box's PIDs (a) wrongly trusts it; container
  PIDs are small and long-running GPU jobs' host PIDs rarely are.
- A process that opened the device but holds no GPU context (nvidia-smi, a CUDA process
  still initialising) is a candidate too, so (b) then sees two and maps nothing.
- MIG instances: the driver's device files for the GPU instance live under
  /dev/nvidia-caps; the parent GPU's minor is still opened and used here.
- Another user's processes: their /proc/PID/fd cannot be read, so they are never
  candidates (they are not the box's anyway, and a box's processes share its user).

Reading a process's open files (a readlink per descriptor) is the costly part, so the
devices each box process holds are cached for HOLDERS_TTL seconds: CUDA opens the device
at initialisation and keeps it, and a process that just started is new to the cache and
is read at once. Before a cached entry is trusted to map a PID, its start time is checked,
so a reused PID can delay a mapping but never make a wrong one.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

from devbox.protocol import GpuSample

HOLDERS_TTL = 5.0


@dataclass(frozen=True, slots=True)
class _Held:
    start: bytes | None  # /proc/PID/stat's start time field; None if unreadable
    prefix: str
    devices: frozenset[str]  # the open files whose path starts with prefix
    t: float


# Module state, as the agent has one sampler; it only ever holds the current box's PIDs.
_cache: dict[int, _Held] = {}


def map_gpu_pids(
    gpus: list[GpuSample],
    *,
    box_pids: set[int],
    minor_numbers: dict[int, int | None],
    dev_prefix: str = "/dev/nvidia",
) -> None:
    """Set each GpuProcess's box_pid in place (see the module docstring for the rules)."""
    unmapped: dict[int, set[int]] = {}  # GPU index -> NVML PIDs (a) did not map
    for gpu in gpus:
        for proc in gpu["processes"]:
            if proc["pid"] in box_pids:
                proc["box_pid"] = proc["pid"]
            else:
                proc["box_pid"] = None
                unmapped.setdefault(gpu["index"], set()).add(proc["pid"])
    if not unmapped:
        return
    now = time.monotonic()
    for pid in _cache.keys() - box_pids:
        del _cache[pid]
    holders: dict[str, set[int]] | None = None
    for gpu in gpus:
        foreign = unmapped.get(gpu["index"])
        minor = minor_numbers.get(gpu["index"])
        # A graphics and a compute entry may name one process: sets, not lists.
        if not foreign or minor is None or len(foreign) != 1:
            continue
        (pid,) = foreign
        if _exists(pid):
            continue
        if holders is None:
            holders = _holders(box_pids, dev_prefix, now)
        device = f"{dev_prefix}{minor}"
        taken = {p["box_pid"] for p in gpu["processes"]}
        candidates = holders.get(device, set()) - taken
        if len(candidates) != 1:
            continue
        (box_pid,) = candidates
        start, held = _start(box_pid), _cache.get(box_pid)
        if start is None or held is None or start != held.start:
            _cache.pop(box_pid, None)  # gone, or reused since it was cached: next tick
            continue
        for proc in gpu["processes"]:
            if proc["pid"] == pid:
                proc["box_pid"] = box_pid


def _holders(box_pids: set[int], prefix: str, now: float) -> dict[str, set[int]]:
    """Device path -> the box PIDs that hold it open."""
    by_device: dict[str, set[int]] = {}
    for pid in box_pids:
        held = _cache.get(pid)
        if held is None or held.prefix != prefix or now - held.t >= HOLDERS_TTL:
            held = _cache[pid] = _Held(_start(pid), prefix, _open_files(pid, prefix), now)
        for device in held.devices:
            by_device.setdefault(device, set()).add(pid)
    return by_device


def _open_files(pid: int, prefix: str) -> frozenset[str]:
    fd_dir = f"/proc/{pid}/fd"
    try:
        fds = os.listdir(fd_dir)
    except OSError:  # gone, or another user's
        return frozenset()
    found = set()
    for fd in fds:
        try:
            target = os.readlink(f"{fd_dir}/{fd}")
        except OSError:  # closed meanwhile
            continue
        if target.startswith(prefix):
            found.add(target)
    return frozenset(found)


def _start(pid: int) -> bytes | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    fields = data[data.rfind(b")") + 2 :].split()
    return fields[19] if len(fields) > 19 else None


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's: it exists
        return True
    except OverflowError:
        return False
    return True
