"""Exclusive GPUs for a box: one abstract Unix socket name per GPU, bound by the agent and,
on a local box, handed to the box's keeper, which lives while any process of the box does
(devbox.gpulocks says why sockets, not files).

The kernel drops the names the moment their last holder dies, however it dies: a crashed
box never keeps its GPUs, and nobody can deny a GPU by leaving something behind. There is no
machine-wide allocation lock, so no one can hold one either; two claims racing for the
last GPUs each give back what they got and try again after a random pause.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field

from agent.nvml import GpuInfo, discover
from devbox import gpulocks

RACE_RETRIES = 20


class GpuUnavailable(Exception):
    pass


@dataclass
class GpuClaim:
    gpus: list[GpuInfo]
    _hold: gpulocks.Hold = field(default_factory=lambda: gpulocks.Hold([]))

    @property
    def visible_devices(self) -> str:
        # UUIDs, not indices: indices can differ between NVML and CUDA's ordering.
        return ",".join(g.uuid for g in self.gpus)

    def hand_over(self, channel: int) -> None:
        """The names to the box's keeper too (gpulocks.Hold.hand_over): the box's processes
        that outlive this agent (a multiplexer's server, a nohup job) keep their GPUs."""
        self._hold.hand_over(channel)

    def release(self) -> None:
        self._hold.release()


def claim(count: int, *, namespace: str) -> GpuClaim:
    """Take `count` free GPUs or raise GpuUnavailable saying which are held, and by whom."""
    if count == 0:
        return GpuClaim([])
    available = discover()
    if count > len(available):
        raise GpuUnavailable(f"asked for {count} GPU(s) but this machine has {len(available)}")
    for _ in range(RACE_RETRIES):
        taken = _take(available, count, namespace)
        if taken is not None:
            return taken
        if _free_count(available, namespace) < count:
            break  # not a race: the GPUs are in use
        time.sleep(random.uniform(0.005, 0.05))  # a rival claim: let one of us win
    raise GpuUnavailable(_refusal(available, count, namespace))


def _take(available: list[GpuInfo], count: int, namespace: str) -> GpuClaim | None:
    """Bind free GPUs' names in order until `count` are ours; None (all given back) if not."""
    gpus, sockets = [], []
    for gpu in available:
        sock = gpulocks.try_hold(namespace, gpu.uuid)
        if sock is None:
            continue
        gpus.append(gpu)
        sockets.append(sock)
        if len(gpus) == count:
            hold = gpulocks.Hold(sockets)
            hold.answer()
            return GpuClaim(gpus, hold)
    gpulocks.Hold(sockets).release()
    return None


def _free_count(available: list[GpuInfo], namespace: str) -> int:
    return len(available) - len(gpulocks.held_names(namespace, [g.uuid for g in available]))


def _refusal(available: list[GpuInfo], count: int, namespace: str) -> str:
    """One line: how many are free, and who holds each of the others."""
    held = []
    for gpu in available:
        who = gpulocks.holder(namespace, gpu.uuid)
        if who is not None:
            held.append(f"GPU {gpu.index} ({gpu.uuid}) is held by {who.describe()}")
    free = len(available) - len(held)
    line = f"asked for {count} GPU(s) but only {free} of {len(available)} are free"
    return f"{line}: {'; '.join(held)}" if held else line
