"""Builds the simulated NVML library (nvml_sim.c) for tests; see that file."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

SOURCE = Path(__file__).with_name("nvml_sim.c")


def build(out_dir: Path) -> Path:
    """Compile the simulator as `out_dir/libnvidia-ml.so.1`; put out_dir on LD_LIBRARY_PATH."""
    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        raise RuntimeError("the simulated NVML needs a C compiler (gcc)")
    out_dir.mkdir(parents=True, exist_ok=True)
    lib = out_dir / "libnvidia-ml.so.1"
    subprocess.run(
        [cc, "-shared", "-fPIC", "-O2", "-Wall", "-Werror", "-o", str(lib), str(SOURCE)], check=True
    )
    return lib


def write_gpus(path: Path, count: int, *, name: str = "Simulated_H100") -> Path:
    lines = [f"gpu uuid=GPU-sim-{i:04d} name={name} mem_total=85899345920" for i in range(count)]
    path.write_text("".join(line + "\n" for line in lines))
    return path
