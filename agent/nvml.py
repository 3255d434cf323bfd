"""The agent's one door to NVML (nvidia-ml-py). A machine without the driver has no GPUs."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from devbox.protocol import GpuProcess, GpuSample


@dataclass(frozen=True)
class GpuInfo:
    index: int
    uuid: str
    name: str


def discover() -> list[GpuInfo]:
    """The GPUs NVML reports; [] where NVML is absent or fails to initialise."""
    try:
        import pynvml
    except ImportError:
        return []
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return []
    try:
        gpus = []
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            gpus.append(
                GpuInfo(
                    index=index,
                    uuid=_text(pynvml.nvmlDeviceGetUUID(handle)),
                    name=_text(pynvml.nvmlDeviceGetName(handle)),
                )
            )
        return gpus
    except pynvml.NVMLError:
        return []
    finally:
        with contextlib.suppress(pynvml.NVMLError):
            pynvml.nvmlShutdown()


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


@dataclass
class _Device:
    info: GpuInfo
    handle: Any
    mem_total: int | None
    # The newest per-process utilisation sample seen (NVML's microseconds): asking only
    # for newer ones keeps each read to one tick's samples.
    last_seen: int = 0


class GpuReader:
    """Opened once per agent; read() is one batched read of every GPU, once per tick."""

    def __init__(self, uuids: Sequence[str] | None = None) -> None:
        """nvmlInit once; uuids: only these GPUs (a local box owns some of the machine's
        GPUs), None: all. Without NVML, or when it fails to start, a reader of no GPUs."""
        self._nvml: Any = None
        self._devices: list[_Device] = []
        self._minors: dict[int, int | None] = {}
        if uuids is not None and not uuids:
            # A box of no GPUs reads none: pynvml (2 MiB once imported, for the agent's
            # life) and the driver's library stay out of its memory.
            return
        try:
            import pynvml
        except ImportError:
            return
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError:
            return
        self._nvml = pynvml
        # NVMLLibraryMismatchError is how the binding's versioned wrappers report a driver
        # without the function; it is not an NVMLError.
        self._errors = (pynvml.NVMLError, pynvml.NVMLLibraryMismatchError)
        self._lost_error = pynvml.NVMLError_GpuIsLost
        wanted = None if uuids is None else set(uuids)
        try:
            count = pynvml.nvmlDeviceGetCount()
        except pynvml.NVMLError:
            count = 0
        for index in range(count):
            try:
                handle = pynvml.nvmlDeviceGetHandleByIndex(index)
                uuid = _text(pynvml.nvmlDeviceGetUUID(handle))
                name = _text(pynvml.nvmlDeviceGetName(handle))
            except pynvml.NVMLError:
                continue  # a GPU NVML cannot even name (lost already) is no use to a box
            if wanted is not None and uuid not in wanted:
                continue
            memory = self._try(pynvml.nvmlDeviceGetMemoryInfo, handle)
            total = None if memory is None else int(memory.total)
            self._devices.append(_Device(GpuInfo(index, uuid, name), handle, total))
            self._minors[index] = self._try(pynvml.nvmlDeviceGetMinorNumber, handle)

    @property
    def gpus(self) -> list[GpuInfo]:
        return [d.info for d in self._devices]

    @property
    def minor_numbers(self) -> dict[int, int | None]:
        """GPU index -> its /dev/nvidiaN number; None where NVML does not say."""
        return dict(self._minors)

    def read(self, *, brief: bool = False) -> list[GpuSample]:
        """brief: what a quiet box's slow tick needs (utilisation, memory, power and its
        limit, temperature: the hang rule, the activity record, the charts' history); the
        clock, PCIe, ECC and the processes on the GPU (three calls of the thirteen, one of
        them NVML's slowest) read as missing."""
        return [self._sample(d, brief) for d in self._devices]

    def close(self) -> None:
        if self._nvml is not None:
            with contextlib.suppress(self._nvml.NVMLError):
                self._nvml.nvmlShutdown()
        self._nvml = None
        self._devices = []

    def __enter__(self) -> GpuReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _try(self, call: Callable[..., Any], *args: Any) -> Any:
        """One NVML call; None when it fails (the metric is missing), except that a lost
        GPU raises: the whole sample is void then."""
        try:
            return call(*args)
        except self._lost_error:
            raise
        except self._errors:
            return None

    def _sample(self, d: _Device, brief: bool) -> GpuSample:
        n, h, get, full = self._nvml, d.handle, self._try, not brief
        try:
            rates = get(n.nvmlDeviceGetUtilizationRates, h)
            memory = get(n.nvmlDeviceGetMemoryInfo, h)
            power = get(n.nvmlDeviceGetPowerUsage, h)
            limit = get(n.nvmlDeviceGetEnforcedPowerLimit, h)
            temp = get(n.nvmlDeviceGetTemperature, h, n.NVML_TEMPERATURE_GPU)
            sample: GpuSample = {
                "index": d.info.index,
                "uuid": d.info.uuid,
                "name": d.info.name,
                "lost": False,
                "util": None if rates is None else float(rates.gpu),
                "mem_util": None if rates is None else float(rates.memory),
                "mem_used": None if memory is None else int(memory.used),
                "mem_total": d.mem_total,
                "power_w": None if power is None else power / 1000,
                "power_limit_w": None if limit is None else limit / 1000,
                "temp_c": None if temp is None else float(temp),
                "sm_clock_mhz": get(n.nvmlDeviceGetClockInfo, h, n.NVML_CLOCK_SM) if full else None,
                "pcie_tx_kbs": (
                    get(n.nvmlDeviceGetPcieThroughput, h, n.NVML_PCIE_UTIL_TX_BYTES)
                    if full
                    else None
                ),
                "pcie_rx_kbs": (
                    get(n.nvmlDeviceGetPcieThroughput, h, n.NVML_PCIE_UTIL_RX_BYTES)
                    if full
                    else None
                ),
                "ecc_corrected": (
                    get(
                        n.nvmlDeviceGetTotalEccErrors,
                        h,
                        n.NVML_MEMORY_ERROR_TYPE_CORRECTED,
                        n.NVML_VOLATILE_ECC,
                    )
                    if full
                    else None
                ),
                "ecc_uncorrected": (
                    get(
                        n.nvmlDeviceGetTotalEccErrors,
                        h,
                        n.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                        n.NVML_VOLATILE_ECC,
                    )
                    if full
                    else None
                ),
                "processes": self._processes(d) if full else [],
            }
        except self._lost_error:
            return _lost(d.info)
        return sample

    def _processes(self, d: _Device) -> list[GpuProcess]:
        n, get = self._nvml, self._try
        # The _v3 wrappers directly: the unversioned names only forward to them.
        compute = get(n.nvmlDeviceGetComputeRunningProcesses_v3, d.handle)
        graphics = get(n.nvmlDeviceGetGraphicsRunningProcesses_v3, d.handle)
        if not compute and not graphics:
            return []
        by_pid: dict[int, GpuProcess] = {}
        for kind, infos in (("compute", compute), ("graphics", graphics)):
            for info in infos or ():
                # A process with both contexts is listed once, as compute.
                if info.pid not in by_pid:
                    by_pid[info.pid] = {
                        "pid": info.pid,
                        "box_pid": None,
                        "kind": kind,
                        "mem_used": info.usedGpuMemory,  # the binding maps "not available" to None
                        "sm_util": None,
                        "mem_util": None,
                    }
        # NOT_FOUND (None here): no sample newer than last_seen, so no utilisation this tick.
        samples = get(n.nvmlDeviceGetProcessUtilization, d.handle, d.last_seen)
        if samples:
            newest_of: dict[int, int] = {}
            for s in samples:
                pid, stamp = s.pid, s.timeStamp
                d.last_seen = max(d.last_seen, stamp)
                process = by_pid.get(pid)
                if process is not None and stamp >= newest_of.get(pid, 0):
                    newest_of[pid] = stamp
                    process["sm_util"] = float(s.smUtil)
                    process["mem_util"] = float(s.memUtil)
        return list(by_pid.values())


def _lost(info: GpuInfo) -> GpuSample:
    return {
        "index": info.index,
        "uuid": info.uuid,
        "name": info.name,
        "lost": True,
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
        "processes": [],
    }
