"""Installs JAX, Flax NNX and Keras 3 for the probe tests (and TensorBoard's writer for the
benchmark), CPU only and the light way, like tests/torch_cpu does for torch.

devbox installs none of them (each framework is optional for the probe); the tests need
real ones. jax's CPU wheel (jaxlib) is the only large part. Flax pulls orbax-checkpoint and
tensorstore (another ~100 MB) for checkpointing the probe never uses, so flax goes in with
--no-deps plus the few pure-Python packages `import flax.nnx` needs.

Everything goes to one cache folder outside the repository, shared by every clone and venv on
the machine; a .pth file in the current interpreter's site-packages points at it. Idempotent:
does nothing when they already import. Measured on this project's 2-core machine: cold 27 s
(pip 24 s), 0.7 GB on disk; cached ~2 s (the import check).

Usage: `python -m tests.frameworks` (scripts/test runs it).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

PINS = ("jax==0.10.2", "jaxlib==0.10.2", "keras==3.15.1", "optax==0.2.8", "tensorboardX==2.6.5")
FLAX = "flax==0.12.8"
# What `import flax.nnx` needs beyond jax, numpy and optax (flax's own list minus orbax and
# tensorstore, which only its checkpointing imports).
FLAX_DEPS = ("msgpack", "treescope", "rich", "typing_extensions", "PyYAML")
CHECK = (
    "import os; os.environ.setdefault('KERAS_BACKEND', 'jax'); "
    "import jax, jax.numpy as jnp, optax, keras, tensorboardX; from flax import nnx; "
    "jax.grad(lambda x: (x * x).sum())(jnp.ones(2))"
)


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
    name = "-".join(p.replace("==", "") for p in (*PINS[:1], PINS[2], FLAX))
    return Path(os.environ.get("DEVBOX_FRAMEWORKS_CACHE", f"{base}/devbox/frameworks-{name}-{tag}"))


def importable(extra_path: Path | None = None) -> bool:
    env = dict(os.environ)
    if extra_path is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(extra_path), env.get("PYTHONPATH")]))
    result = subprocess.run(
        [sys.executable, "-c", CHECK], env=env, capture_output=True, timeout=300, check=False
    )
    return result.returncode == 0


def install(target: Path) -> None:
    tmp = target.with_name(target.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    pip = [sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    started = time.monotonic()
    subprocess.run([*pip, "--target", str(tmp), *PINS], check=True)
    subprocess.run([*pip, "--target", str(tmp), "--no-deps", FLAX, *FLAX_DEPS], check=True)
    installed = time.monotonic() - started
    if not importable(tmp):
        raise SystemExit(f"frameworks: {', '.join(PINS)} and {FLAX} do not import from {tmp}")
    tmp.rename(target)
    size = sum(f.stat().st_size for f in target.rglob("*") if f.is_file())
    print(
        f"frameworks: jax, flax, keras, optax, tensorboardX in {target}: pip {installed:.0f} s, "
        f"{size / 2**20:.0f} MiB",
        file=sys.stderr,
    )


def main() -> int:
    if importable():
        return 0
    target = cache_dir()
    if not (target / "jax").is_dir():
        target.parent.mkdir(parents=True, exist_ok=True)
        install(target)
    site = Path(sysconfig.get_paths()["purelib"])
    (site / "devbox-test-frameworks.pth").write_text(f"{target}\n")
    if not importable():
        print(f"frameworks: the frameworks in {target} do not import", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
