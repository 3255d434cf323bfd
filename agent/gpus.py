"""Exclusive GPUs for a box: one lock file per GPU, held by the agent for its life.

flock locks belong to the open file, so the kernel drops them the moment the
agent dies, however it dies: a crashed box never keeps its GPUs. The lock
folder is machine-wide and shared by all users (mode 1777), so two users'
boxes never share a GPU either.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from agent.nvml import GpuInfo, discover


class GpuUnavailable(Exception):
    pass


@dataclass
class GpuClaim:
    gpus: list[GpuInfo]
    _fds: list[int]

    @property
    def visible_devices(self) -> str:
        # UUIDs, not indices: indices can differ between NVML and CUDA's ordering.
        return ",".join(g.uuid for g in self.gpus)

    def release(self) -> None:
        for fd in self._fds:
            os.close(fd)
        self._fds.clear()


def _ensure_dir(lock_dir: Path) -> None:
    if not lock_dir.exists():
        with contextlib.suppress(FileExistsError):
            lock_dir.mkdir(parents=True)
            os.chmod(lock_dir, 0o1777)


def _open_lock(path: Path) -> int:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    with contextlib.suppress(PermissionError):
        os.fchmod(fd, 0o666)  # the umask must not lock other users out
    return fd


@contextlib.contextmanager
def _allocation_lock(lock_dir: Path) -> Iterator[None]:
    # Serialises choosing GPUs, so two claims racing for the last ones cannot
    # each take half and both fail.
    fd = _open_lock(lock_dir / "alloc.lock")
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def claim(count: int, *, lock_dir: Path, owner: str) -> GpuClaim:
    """Take `count` free GPUs or raise GpuUnavailable saying how many are free."""
    if count == 0:
        return GpuClaim([], [])
    available = discover()
    if count > len(available):
        raise GpuUnavailable(f"asked for {count} GPU(s) but this machine has {len(available)}")
    _ensure_dir(lock_dir)
    taken: list[GpuInfo] = []
    fds: list[int] = []
    with _allocation_lock(lock_dir):
        for gpu in available:
            fd = _open_lock(lock_dir / f"gpu-{gpu.uuid}.lock")
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            os.ftruncate(fd, 0)
            os.write(fd, f"{owner}\n".encode())
            taken.append(gpu)
            fds.append(fd)
            if len(taken) == count:
                return GpuClaim(taken, fds)
    free = len(taken)
    GpuClaim(taken, fds).release()
    raise GpuUnavailable(f"asked for {count} GPU(s) but only {free} of {len(available)} are free")
