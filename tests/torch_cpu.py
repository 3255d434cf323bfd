"""Installs PyTorch for the probe tests on a machine without a GPU, the light way.

PyPI's only torch wheel for x86-64 Linux is the CUDA build (the CPU-only builds live on a
separate index this project's machines cannot reach), and its CUDA libraries are another
~2.3 GB of nvidia-* wheels (2.8 GB in all, about 5 GB installed). A CPU never calls them;
they are needed only because torch's shared objects name them (DT_NEEDED), so the dynamic
loader refuses to start without them. So, as tests/nvml_sim does for NVML:

  1. `pip install --no-deps torch==TORCH` plus the pure-Python packages `import torch`
     needs (0.5 GB download, 1.2 GB on disk; no nvidia-*, no triton);
  2. build a stub for each CUDA library torch names: a tiny .so with that soname that
     defines every symbol torch imports from it (with its symbol version), each returning
     cudaErrorNoDevice (100). torch then imports, finds no GPU, trains and compiles on the CPU.

Everything goes to a cache folder outside the repository, shared by every clone and venv on
the machine (CI's fresh clone pays ~0 s once it is there), and a .pth file in the current
interpreter's site-packages points at it. Idempotent: does nothing when torch already imports.

Usage: `python -m tests.torch_cpu` (scripts/test runs it).
"""

from __future__ import annotations

import collections
import os
import shutil
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

TORCH = "2.15.0"
# What `import torch` (and torch.compile on the CPU) needs besides torch itself; pip's
# --no-deps means listing transitive ones (mpmath, markupsafe) too.
PURE_DEPS = (
    "filelock",
    "typing-extensions>=4.13",
    "sympy>=1.13.3",
    "mpmath",
    "networkx>=2.5.1",
    "jinja2",
    "markupsafe",
    "fsspec>=0.8.5",
    # Not needed to import, but torch warns on every start without it.
    "numpy",
)
# Libraries torch's .so files import symbols from without a version tag, by symbol prefix.
UNVERSIONED = {
    "nccl": "libnccl.so.2",
    "cusparseLt": "libcusparseLt.so.0",
    "cuFile": "libcufile.so.0",
}
# The stub directory must be on the RPATH torch's libraries carry ($ORIGIN/../../nvidia/...).
STUB_DIR = Path("nvidia/cu13/lib")
NO_DEVICE = 100  # cudaErrorNoDevice: torch.cuda.is_available() is then simply False


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
    return Path(os.environ.get("DEVBOX_TORCH_CACHE", f"{base}/devbox/torch-cpu-{TORCH}-{tag}"))


def importable(extra_path: Path | None = None) -> bool:
    env = dict(os.environ)
    if extra_path is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(extra_path), env.get("PYTHONPATH")]))
    probe = "import torch; x = torch.ones(2, requires_grad=True); (x * x).sum().backward()"
    result = subprocess.run(
        [sys.executable, "-c", probe], env=env, capture_output=True, timeout=300, check=False
    )
    return result.returncode == 0


def _symbols(lib: Path) -> tuple[dict[str | None, set[str]], set[str]]:
    """(imported symbols by version tag, symbols defined) over torch's shared objects."""
    imported: dict[str | None, set[str]] = collections.defaultdict(set)
    defined: set[str] = set()
    for so in sorted(lib.glob("*.so*")):
        out = subprocess.run(["nm", "-D", str(so)], capture_output=True, text=True, check=True)
        for line in out.stdout.splitlines():
            parts = line.split()
            if len(parts) == 2 and parts[0] == "U":
                name, _, version = parts[1].partition("@")
                imported[version or None].add(name)
            elif len(parts) == 3:
                defined.add(parts[2].split("@")[0])
    return imported, defined


def build_stubs(site: Path, work: Path) -> list[str]:
    """Compile a stub for each CUDA library torch names; returns their sonames."""
    imported, defined = _symbols(site / "torch/lib")
    plan: dict[str, tuple[set[str], str | None]] = {}
    for version, names in imported.items():
        if version and version.startswith("lib") and ".so." in version:
            plan[version] = (names, version)
        elif version == "NVSHMEM":
            plan["libnvshmem_host.so.3"] = (names, version)
    for name in imported[None] - defined:
        for prefix, soname in UNVERSIONED.items():
            if name.startswith(prefix):
                plan.setdefault(soname, (set(), None))[0].add(name)
    out = site / STUB_DIR
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    for soname, (names, version) in sorted(plan.items()):
        lines = ['static const char no_cuda[] = "CUDA is not available (devbox test stub)";']
        for name in sorted(names):
            if "ErrorString" in name or "ErrorName" in name:
                lines.append(f"const char *{name}(void) {{ return no_cuda; }}")
            else:
                lines.append(f"int {name}(void) {{ return {NO_DEVICE}; }}")
        source = work / f"{soname}.c"
        source.write_text("\n".join(lines) + "\n")
        argv = ["gcc", "-shared", "-fPIC", "-o", str(out / soname), str(source)]
        argv.append(f"-Wl,-soname,{soname}")
        if version is not None:
            script = work / f"{soname}.map"
            script.write_text(f"{version} {{ global: *; }};\n")
            argv.append(f"-Wl,--version-script={script}")
        subprocess.run(argv, check=True)
    return sorted(plan)


def install(target: Path) -> None:
    tmp = target.with_name(target.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    pip = [sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    started = time.monotonic()
    subprocess.run(
        [*pip, "--no-deps", "--target", str(tmp), f"torch=={TORCH}", *PURE_DEPS], check=True
    )
    installed = time.monotonic() - started
    stubs = build_stubs(tmp, tmp / ".stub-sources")
    if not importable(tmp):
        raise SystemExit(f"torch_cpu: torch {TORCH} does not import with the stubs in {tmp}")
    tmp.rename(target)
    size = sum(f.stat().st_size for f in target.rglob("*") if f.is_file())
    print(
        f"torch_cpu: torch {TORCH} for the CPU in {target}: pip {installed:.0f} s, "
        f"{size / 2**30:.1f} GiB, {len(stubs)} CUDA stubs",
        file=sys.stderr,
    )


def main() -> int:
    if importable():
        return 0
    target = cache_dir()
    if not (target / "torch").is_dir():
        target.parent.mkdir(parents=True, exist_ok=True)
        install(target)
    site = Path(sysconfig.get_paths()["purelib"])
    (site / "devbox-test-torch.pth").write_text(f"{target}\n")
    if not importable():
        print(f"torch_cpu: torch in {target} does not import", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
