"""Builds the simulated NVML library (nvml_sim.c) for tests and writes the GPU file it
reads ($DEVBOX_NVML_SIM); see that file for the format."""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import subprocess
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

SOURCE = Path(__file__).with_name("nvml_sim.c")
GIB = 1 << 30


_NUMBERS = (
    "mem_total",
    "mem_used",
    "util",
    "mem_util",
    "power_mw",
    "power_limit_mw",
    "temp",
    "sm_clock",
    "pcie_tx",
    "pcie_rx",
    "ecc_corrected",
    "ecc_uncorrected",
)


@dataclass(frozen=True)
class SimGpu:
    """One simulated GPU; the fields are the file's keys, in NVML's units."""

    uuid: str | None = None  # None: GPU-sim-NNNN from its index
    name: str = "Simulated H100"
    mem_total: int = 80 * GIB
    mem_used: int = 0
    util: int = 0
    mem_util: int = 0
    power_mw: int = 0
    power_limit_mw: int = 0
    temp: int = 0
    sm_clock: int = 0
    pcie_tx: int = 0  # KB/s
    pcie_rx: int = 0
    ecc_corrected: int = 0
    ecc_uncorrected: int = 0
    minor: int | None = None  # None: the index
    # Calls answering NOT_SUPPORTED: util, mem, power, power_limit, temp, sm_clock, pcie,
    # ecc, minor, compute, graphics, proc_util.
    unsupported: frozenset[str] = frozenset()
    lost: bool = False

    def line(self) -> str:
        words = ["gpu"]
        if self.uuid is not None:
            words.append(f"uuid={self.uuid}")
        words.append(f"name={self.name.replace(' ', '_')}")
        for key in _NUMBERS:
            words.append(f"{key}={getattr(self, key)}")
        if self.minor is not None:
            words.append(f"minor={self.minor}")
        if self.unsupported:
            words.append(f"unsupported={','.join(sorted(self.unsupported))}")
        if self.lost:
            words.append("lost=1")
        return " ".join(words)


@dataclass(frozen=True)
class SimProcess:
    """A process on GPU `gpu`, and its latest utilisation sample (none when ts is 0)."""

    gpu: int
    pid: int
    mem: int | None = None  # bytes; None: NVML's "not available"
    kind: Literal["compute", "graphics"] = "compute"
    sm: int = 0
    memutil: int = 0
    ts: int = 0  # microseconds

    def line(self) -> str:
        mem = "" if self.mem is None else f" mem={self.mem}"
        return (
            f"proc gpu={self.gpu} pid={self.pid}{mem} kind={self.kind}"
            f" sm={self.sm} memutil={self.memutil} ts={self.ts}"
        )


def build(out_dir: Path, *, without: Iterable[str] = ()) -> Path:
    """Compile the simulator as `out_dir/libnvidia-ml.so.1`; put out_dir on LD_LIBRARY_PATH.
    without: NVML functions to leave out, as a driver too old to have them."""
    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        raise RuntimeError("the simulated NVML needs a C compiler (gcc)")
    out_dir.mkdir(parents=True, exist_ok=True)
    lib = out_dir / "libnvidia-ml.so.1"
    argv = [cc, "-shared", "-fPIC", "-O2", "-Wall", "-Werror", "-o", str(lib), str(SOURCE)]
    hidden = sorted(without)
    if hidden:
        script = out_dir / "exports.map"
        script.write_text(f"{{ global: *; local: {'; '.join(hidden)}; }};\n")
        argv.append(f"-Wl,--version-script={script}")
    subprocess.run(argv, check=True)
    return lib


@contextlib.contextmanager
def loaded_in_process(lib: Path) -> Iterator[None]:
    """Makes the pynvml imported by this process use `lib` (LD_LIBRARY_PATH only counts
    at process start). Test-only: it sets the binding's private library handle."""
    import pynvml

    saved = pynvml.nvmlLib
    with pynvml.libLoadLock:
        pynvml.nvmlLib = ctypes.CDLL(str(lib))
        pynvml._nvmlGetFunctionPointer_cache.clear()  # pointers into the previous library
    try:
        yield
    finally:
        with pynvml.libLoadLock:
            pynvml.nvmlLib = saved
            pynvml._nvmlGetFunctionPointer_cache.clear()


def write(path: Path, gpus: Sequence[SimGpu], processes: Iterable[SimProcess] = ()) -> Path:
    """Replace the file in one step: a running simulator reloads it on its next call and
    must never see half of it."""
    lines = [g.line() for g in gpus] + [p.line() for p in processes]
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text("".join(line + "\n" for line in lines))
    os.replace(tmp, path)
    return path


def write_gpus(path: Path, count: int, *, name: str = "Simulated_H100") -> Path:
    return write(path, [SimGpu(name=name) for _ in range(count)])
