"""What one telemetry tick reads in a box: its GPUs (NVML), the host and the box's
processes (psutil), with the PIDs NVML reports mapped to the box's own."""

from __future__ import annotations

from collections.abc import Sequence

from agent.host import HostSampler
from agent.nvml import GpuReader
from agent.pidmap import map_gpu_pids
from devbox.protocol import BoxProcess, GpuSample, HostSample


class BoxSources:
    def __init__(
        self,
        *,
        gpu_uuids: Sequence[str] | None,
        root_pid: int,
        box_marker: tuple[str, str] | None,
        all_processes: bool,
        tree: bool = False,
    ) -> None:
        """tree: every process of the box descends from root_pid (agent.host)."""
        self._gpus = GpuReader(gpu_uuids)
        self._host = HostSampler(
            root_pid=root_pid, box_marker=box_marker, all_processes=all_processes, tree=tree
        )

    def read(self, *, brief: bool = False) -> tuple[list[GpuSample], HostSample, list[BoxProcess]]:
        """brief: a quiet box's slow tick (agent.nvml's GpuReader.read)."""
        gpus = self._gpus.read(brief=brief)
        host, processes = self._host.read()
        if any(g["processes"] for g in gpus):
            map_gpu_pids(
                gpus,
                box_pids={p["pid"] for p in processes},
                minor_numbers=self._gpus.minor_numbers,
            )
        return gpus, host, processes

    def close(self) -> None:
        self._gpus.close()
