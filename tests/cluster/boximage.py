"""Builds the test node's images without Docker: the box image from images/box/Dockerfile
itself, and the kubelet's sandbox (pause) image around a static binary.

The test node's containerd can reach no registry (only Debian's mirror, PyPI and the Go
proxy are reachable), so neither the Dockerfile's base image nor a pause image can be
pulled. This reads the Dockerfile's instructions and carries them out, so the test image
cannot drift from the real one:

- FROM is stood in for by `debootstrap --variant=minbase bookworm` (the mirror the host's
  apt uses). The CUDA runtime the real base brings is irrelevant: the test pods' GPUs are
  the simulated NVML, which the fake device plugin mounts. What FROM brings besides files,
  its environment, is copied from the real base (`FROM_ENV`).
- ARG and ENV set the environment of RUN; RUN runs `/bin/sh -c` in a chroot of the root;
  COPY copies from the repository; USER, WORKDIR, EXPOSE, CMD and ENV go into the image
  config. Any other instruction is an error, not something to skip quietly.

Everything before the first COPY of the code (the `devbox` folder) is the base: debootstrap,
apt and pip take minutes, so its root and layer are cached under
~/.cache/devbox/box-image/ (or $DEVBOX_BOX_IMAGE_CACHE), keyed by those instructions, the
files they COPY, the suite and `BASE_VERSION`. The rest runs on every build on an overlay
of the cached root; the overlay's upper folder becomes the second layer. The output is a
docker-archive that `ctr -n k8s.io images import FILE` accepts.

    python -m tests.cluster.boximage box --out FILE [--tag devbox/box:test]   (as root)
    python -m tests.cluster.boximage pause --binary BIN --out FILE [--tag devbox.local/pause:test]

The output path is the last line on stdout; timings go to stderr. All chroot work runs in
private mount and PID namespaces (the command re-executes itself under `unshare`), so a
killed build leaves no mount and no process behind on the host.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import io
import json
import os
import posixpath
import re
import shlex
import shutil
import signal
import stat
import subprocess
import sys
import tarfile
import textwrap
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import IO, Any

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "images/box/Dockerfile"
BOX_TAG = "devbox/box:test"
PAUSE_TAG = "devbox.local/pause:test"
SUITE = "bookworm"
FALLBACK_MIRROR = "http://deb.debian.org/debian"
# Part of the base's cache key: bump it when this file changes how the base is made.
BASE_VERSION = "1"
# The first COPY of this folder ends the cached base.
CODE_DIR = "devbox"
SUPPORTED = {"ARG", "ENV", "RUN", "COPY", "USER", "WORKDIR", "EXPOSE", "CMD"}
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# The environment nvidia/cuda's Dockerfiles declare (PATH and the driver's library path,
# where GKE's device plugin mounts the driver): the test pod sees what a real one does.
CUDA_ENV = {
    "PATH": f"/usr/local/nvidia/bin:/usr/local/cuda/bin:{DEFAULT_PATH}",
    "LD_LIBRARY_PATH": "/usr/local/nvidia/lib:/usr/local/nvidia/lib64",
    "NVIDIA_VISIBLE_DEVICES": "all",
    "NVIDIA_DRIVER_CAPABILITIES": "compute,utility",
}
# Where RUN finds the host's CA bundle (pip behind the host's TLS proxy): a tmpfs that is
# mounted on /tmp during the build only, so the bundle never reaches a layer.
HOST_CA = "/etc/ssl/certs/ca-certificates.crt"
BUILD_CA = "/tmp/.devbox-build/ca-certificates.crt"
CA_VARS = ("SSL_CERT_FILE", "PIP_CERT", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE", "GIT_SSL_CAINFO")
# Not image content: the runtime mounts /proc, /sys, /dev and /tmp; apt's caches are rebuilt.
EMPTIED = ("proc/", "sys/", "dev/", "tmp/")
FILES_DROPPED = ("var/cache/apt/", "var/lib/apt/lists/")
NAMESPACE_MARK = "DEVBOX_BOXIMAGE_IN_NAMESPACE"
TAIL_LINES = 30


class BuildError(Exception):
    """A failure worth one line; `tail` is the failing step's last output."""

    def __init__(self, message: str, *, tail: str = "") -> None:
        super().__init__(message)
        self.tail = tail


# --- the Dockerfile ------------------------------------------------------------------


@dataclass(frozen=True)
class Instruction:
    keyword: str
    args: str
    line: int

    def __str__(self) -> str:
        return f"{self.keyword} {self.args}"


def parse_dockerfile(text: str) -> list[Instruction]:
    """Instructions with their continuation lines joined as Docker joins them (the
    backslash and newline go; comment lines inside a continuation are dropped)."""
    instructions: list[Instruction] = []
    pieces: list[str] = []
    start = 0
    for number, raw in enumerate(text.splitlines(), 1):
        stripped = raw.strip()
        if stripped.startswith("#") or not stripped:
            continue
        if not pieces:
            start = number
        line = raw.rstrip()
        if line.endswith("\\"):
            pieces.append(line[:-1])
            continue
        pieces.append(line)
        keyword, _, args = "".join(pieces).strip().partition(" ")
        instructions.append(Instruction(keyword.upper(), args.strip(), start))
        pieces = []
    if pieces:
        raise BuildError(f"Dockerfile line {start}: the last instruction ends with a backslash")
    return instructions


@dataclass(frozen=True)
class Plan:
    base_image: str
    base: tuple[Instruction, ...]  # after FROM, up to the code's first COPY
    top: tuple[Instruction, ...]  # from that COPY on


def plan_of(instructions: list[Instruction]) -> Plan:
    if not instructions or instructions[0].keyword != "FROM":
        raise BuildError("the Dockerfile must start with FROM")
    rest = instructions[1:]
    for inst in rest:
        if inst.keyword not in SUPPORTED:
            raise BuildError(f"Dockerfile line {inst.line}: {inst.keyword} is not supported")
        if "$" in inst.args and inst.keyword not in ("RUN", "CMD"):
            raise BuildError(f"Dockerfile line {inst.line}: variables are not supported here")
    split = next(
        (i for i, inst in enumerate(rest) if inst.keyword == "COPY" and _copies_code(inst)),
        None,
    )
    if split is None:
        raise BuildError(f"the Dockerfile never copies the {CODE_DIR}/ folder")
    return Plan(instructions[0].args.split()[0], tuple(rest[:split]), tuple(rest[split:]))


def _copies_code(inst: Instruction) -> bool:
    sources, _ = copy_args(inst)
    return any(posixpath.normpath(s) == CODE_DIR for s in sources)


def words_or_json(args: str) -> tuple[list[str], bool]:
    """The exec (JSON) form's words and True, or the shell form's words and False."""
    if args.startswith("["):
        with contextlib.suppress(ValueError):
            value = json.loads(args)
            if isinstance(value, list) and all(isinstance(w, str) for w in value):
                return value, True
    return shlex.split(args), False


def copy_args(inst: Instruction) -> tuple[list[str], str]:
    words, _ = words_or_json(inst.args)
    if any(w.startswith("--") for w in words) or len(words) < 2:
        raise BuildError(f"Dockerfile line {inst.line}: only COPY SRC... DEST is supported")
    if any(c in w for w in words for c in "*?["):
        raise BuildError(f"Dockerfile line {inst.line}: COPY patterns are not supported")
    return words[:-1], words[-1]


def from_env(image: str) -> dict[str, str]:
    if not image.startswith("nvidia/cuda:"):
        return {"PATH": DEFAULT_PATH}
    return {**CUDA_ENV, "CUDA_VERSION": image.partition(":")[2].partition("-")[0]}


@dataclass
class State:
    """What the instructions so far set: the image config, and the environment of RUN."""

    env: dict[str, str]
    args: dict[str, str] = field(default_factory=dict)
    user: str = ""
    workdir: str = "/"
    cmd: list[str] | None = None
    exposed: list[str] = field(default_factory=list)


def configure(state: State, inst: Instruction) -> None:
    """Applies an instruction's effect on the config; RUN and COPY have none."""
    if inst.keyword == "ENV":
        state.env.update(env_pairs(inst.args))
    elif inst.keyword == "ARG":
        for word in shlex.split(inst.args):
            name, eq, value = word.partition("=")
            if eq:  # an ARG without a default stays unset: no --build-arg here
                state.args[name] = value
    elif inst.keyword == "USER":
        state.user = inst.args
    elif inst.keyword == "WORKDIR":
        state.workdir = posixpath.normpath(posixpath.join(state.workdir, inst.args))
    elif inst.keyword == "EXPOSE":
        state.exposed += [p if "/" in p else f"{p}/tcp" for p in inst.args.split()]
    elif inst.keyword == "CMD":
        words, exec_form = words_or_json(inst.args)
        state.cmd = words if exec_form else ["/bin/sh", "-c", inst.args]


def env_pairs(args: str) -> list[tuple[str, str]]:
    words = shlex.split(args)
    if words and "=" not in words[0]:  # the legacy `ENV KEY VALUE...` form
        key, _, value = args.partition(" ")
        return [(key, value.strip())]
    return [(w.partition("=")[0], w.partition("=")[2]) for w in words]


def image_config(state: State, diff_ids: list[str], history: list[str]) -> dict[str, Any]:
    now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    config: dict[str, Any] = {
        "Env": [f"{k}={v}" for k, v in state.env.items()],
        "WorkingDir": state.workdir,
        "Cmd": state.cmd,
    }
    if state.user:
        config["User"] = state.user
    if state.exposed:
        config["ExposedPorts"] = {p: {} for p in state.exposed}
    return {
        "architecture": "amd64",
        "os": "linux",
        "created": now,
        "config": config,
        "rootfs": {"type": "layers", "diff_ids": diff_ids},
        "history": [{"created": now, "created_by": h} for h in history],
    }


def base_key(plan: Plan, context: Path) -> str:
    """Changes when anything that shapes the base does; the code's files do not."""
    digest = hashlib.sha256()
    for part in (BASE_VERSION, SUITE, plan.base_image):
        _feed(digest, part)
    for inst in plan.base:
        _feed(digest, str(inst))
        if inst.keyword == "COPY":
            for source in copy_args(inst)[0]:
                for path in _tree(context / source):
                    _feed(digest, path.relative_to(context).as_posix())
                    _feed(digest, oct(path.lstat().st_mode))
                    if path.is_symlink():
                        _feed(digest, os.readlink(path))
                    elif path.is_file():
                        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def _feed(digest: Any, text: str) -> None:
    data = text.encode()
    digest.update(b"%d:" % len(data) + data)


def _tree(path: Path) -> Iterator[Path]:
    """A COPY source and, for a folder, everything below it but Python's byte-code caches
    (what a .dockerignore would leave out: the image compiles its own)."""
    yield path
    if path.is_dir() and not path.is_symlink():
        for child in sorted(path.iterdir()):
            if child.name != "__pycache__":
                yield from _tree(child)


# --- layers and the archive ----------------------------------------------------------


def is_overlay_whiteout(path: Path, st: os.stat_result) -> bool:
    return stat.S_ISCHR(st.st_mode) and st.st_rdev == 0


def is_overlay_opaque(path: Path) -> bool:
    try:
        return os.getxattr(path, "trusted.overlay.opaque", follow_symlinks=False) in (b"y", b"x")
    except OSError:
        return False


def not_whiteout(path: Path, st: os.stat_result) -> bool:
    return False


def not_opaque(path: Path) -> bool:
    return False


def is_content(name: str, is_dir: bool) -> bool:
    """Whether a path (relative, posix) belongs in a layer."""
    if any(name.startswith(prefix) for prefix in EMPTIED):
        return False
    return is_dir or not any(name.startswith(prefix) for prefix in FILES_DROPPED)


def layer_entries(
    root: Path,
    *,
    whiteout: Callable[[Path, os.stat_result], bool] = not_whiteout,
    opaque: Callable[[Path], bool] = not_opaque,
    _folder: Path | None = None,
) -> Iterator[tuple[str, Path | None]]:
    """(name in the layer, file) for a folder's tree, sorted, parents first; an overlay
    whiteout becomes an empty `.wh.NAME` and an opaque folder gains `.wh..wh..opq`
    (their file is None)."""
    for entry in sorted(os.scandir(_folder or root), key=lambda e: e.name):
        path = Path(entry.path)
        name = path.relative_to(root).as_posix()
        st = entry.stat(follow_symlinks=False)
        is_dir = stat.S_ISDIR(st.st_mode)
        if not is_content(name, is_dir):
            continue
        if whiteout(path, st):
            yield posixpath.join(posixpath.dirname(name), ".wh." + entry.name), None
            continue
        yield name, path
        if is_dir:
            if opaque(path):
                yield f"{name}/.wh..wh..opq", None
            yield from layer_entries(root, whiteout=whiteout, opaque=opaque, _folder=path)


def write_layer(entries: Iterable[tuple[str, Path | None]], out: Path) -> str:
    """Writes a layer tar with numeric owners and modes kept; returns its diff_id."""
    with tarfile.open(out, "w", format=tarfile.PAX_FORMAT) as tar:
        for name, path in entries:
            if path is None:
                tar.addfile(_member(name, size=0, mode=0o644))
                continue
            info = tar.gettarinfo(str(path), arcname=name)
            if info is None:  # a socket: nothing a layer can hold
                continue
            info.uname = info.gname = ""
            info.mtime = int(info.mtime)  # a float mtime costs a PAX header per file
            if info.isreg():
                with path.open("rb") as data:
                    tar.addfile(info, data)
            else:
                tar.addfile(info)
    return "sha256:" + _sha256(out)


def _member(name: str, *, size: int, mode: int) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.mtime = size, mode, int(time.time())
    return info


def _sha256(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def write_archive(out: Path, *, tag: str, config: dict[str, Any], layers: list[Path]) -> None:
    """A docker-archive (as `docker save` writes): manifest.json, the config and the layer
    tars as blobs named by digest."""
    blob = json.dumps(config, indent=1).encode()
    config_name = f"blobs/sha256/{hashlib.sha256(blob).hexdigest()}"
    layer_names = [f"blobs/sha256/{d.partition(':')[2]}" for d in config["rootfs"]["diff_ids"]]
    manifest = [{"Config": config_name, "RepoTags": [tag], "Layers": layer_names}]
    partial = out.with_name(out.name + ".partial")
    with tarfile.open(partial, "w", format=tarfile.PAX_FORMAT) as tar:
        for folder in ("blobs", "blobs/sha256"):
            info = _member(folder, size=0, mode=0o755)
            info.type = tarfile.DIRTYPE
            tar.addfile(info)
        _add_bytes(tar, config_name, blob)
        for name, path in zip(layer_names, layers, strict=True):
            with path.open("rb") as data:
                tar.addfile(_member(name, size=path.stat().st_size, mode=0o644), data)
        _add_bytes(tar, "manifest.json", json.dumps(manifest).encode())
    partial.replace(out)


def _add_bytes(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    tar.addfile(_member(name, size=len(data), mode=0o644), io.BytesIO(data))


def unpack(archive: Path, dest: Path) -> dict[str, Any]:
    """Applies an archive's layers in order into `dest` (whiteouts included), as a runtime
    would; returns the image config. For checks, not for untrusted archives."""
    with tarfile.open(archive) as outer:
        manifest = json.load(_open(outer, "manifest.json"))[0]
        config: dict[str, Any] = json.load(_open(outer, manifest["Config"]))
        for name in manifest["Layers"]:
            with tarfile.open(fileobj=_open(outer, name)) as layer:
                apply_layer(layer, dest)
    return config


def _open(tar: tarfile.TarFile, name: str) -> IO[bytes]:
    member = tar.extractfile(name)
    if member is None:
        raise BuildError(f"{name} is not a file in the archive")
    return member


def apply_layer(layer: tarfile.TarFile, dest: Path) -> None:
    members = layer.getmembers()
    for member in members:
        parent, _, base = member.name.rpartition("/")
        if base == ".wh..wh..opq":
            if (dest / parent).is_dir():
                for child in (dest / parent).iterdir():
                    _remove(child)
        elif base.startswith(".wh."):
            _remove(dest / parent / base[4:])
    content = [m for m in members if not posixpath.basename(m.name).startswith(".wh.")]
    for member in content:
        if member.name.startswith("/") or ".." in member.name.split("/"):
            raise BuildError(f"unsafe name in a layer: {member.name}")
        target = dest / member.name
        if target.is_symlink() or (target.exists() and not (member.isdir() and target.is_dir())):
            _remove(target)
    trusted = {"filter": "fully_trusted"} if hasattr(tarfile, "fully_trusted_filter") else {}
    layer.extractall(dest, members=content, numeric_owner=True, **trusted)  # type: ignore[arg-type]


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.is_symlink() or path.exists():
        path.unlink()


# --- the build -----------------------------------------------------------------------


def cache_dir() -> Path:
    default = Path.home() / ".cache/devbox/box-image"
    return Path(os.environ.get("DEVBOX_BOX_IMAGE_CACHE", default))


def mirror_from_sources(texts: Iterable[str], suite: str = SUITE) -> str | None:
    """The first apt source (one-line or deb822 form) that serves `suite` main."""
    for text in texts:
        for stanza in re.split(r"\n\s*\n", text):
            fields: dict[str, list[str]] = {}
            for line in stanza.splitlines():
                line = re.sub(r"\[[^\]]*\]", "", line.split("#", 1)[0])  # [options]
                words = line.split()
                if words[:1] == ["deb"] and len(words) >= 4:
                    if words[2] == suite and "main" in words[3:]:
                        return words[1]
                elif re.match(r"[A-Za-z-]+:", line):
                    key, _, value = line.partition(":")
                    fields[key.lower()] = value.split()
            enabled = fields.get("enabled", ["yes"]) != ["no"]
            serves = suite in fields.get("suites", []) and "main" in fields.get("components", [])
            if enabled and serves and "deb" in fields.get("types", []) and fields.get("uris"):
                return fields["uris"][0]
    return None


def host_mirror() -> str:
    apt = Path("/etc/apt")
    files = [apt / "sources.list", *sorted((apt / "sources.list.d").glob("*"))]
    texts = (f.read_text(errors="replace") for f in files if f.is_file())
    return mirror_from_sources(texts) or FALLBACK_MIRROR


class Steps:
    """Runs commands with their output in a log, shown (its tail) if one fails."""

    def __init__(self, log: Path, *, verbose: bool) -> None:
        self.log, self.verbose = log, verbose

    def run(self, argv: list[str], what: str, **kwargs: Any) -> None:
        with self.log.open("ab") as log:
            log.write(f"\n### {what}\n".encode())
            log.flush()
            sink = sys.stderr if self.verbose else log
            try:
                done = subprocess.run(
                    argv, stdin=subprocess.DEVNULL, stdout=sink, stderr=subprocess.STDOUT, **kwargs
                )
            except (OSError, subprocess.SubprocessError) as error:  # chroot, chdir, exec
                raise BuildError(f"{what}: {error}") from None
        if done.returncode != 0:
            raise BuildError(f"{what} failed (exit {done.returncode})", tail=self.tail())

    def tail(self) -> str:
        if self.verbose:
            return ""
        lines = self.log.read_text(errors="replace").splitlines()
        return "\n".join(lines[-TAIL_LINES:])


def sh(*argv: str) -> None:
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0:
        raise BuildError(f"{shlex.join(argv)}: {done.stderr.strip() or done.returncode}")


@contextlib.contextmanager
def build_mounts(root: Path) -> Iterator[None]:
    """What RUN needs besides the root: /proc, a small /dev, a fresh /tmp holding the
    host's CA bundle, and the host's resolv.conf; none of it lands in a layer."""
    mounted: list[Path] = []

    def mount(target: Path, *argv: str) -> None:
        sh("mount", *argv, str(target))
        mounted.append(target)

    try:
        mount(root / "proc", "-t", "proc", "proc")
        mount(root / "dev", "-t", "tmpfs", "-o", "mode=755,nosuid", "tmpfs")
        for name in ("null", "zero", "full", "random", "urandom", "tty"):
            os.mknod(root / "dev" / name, 0o666 | stat.S_IFCHR, os.stat(f"/dev/{name}").st_rdev)
        for name, target in (("fd", "/proc/self/fd"), ("ptmx", "pts/ptmx")):
            os.symlink(target, root / "dev" / name)
        for number, name in enumerate(("stdin", "stdout", "stderr")):
            os.symlink(f"/proc/self/fd/{number}", root / "dev" / name)
        for name in ("pts", "shm"):
            (root / "dev" / name).mkdir()
        mount(root / "dev/pts", "-t", "devpts", "-o", "newinstance,ptmxmode=0666", "devpts")
        mount(root / "dev/shm", "-t", "tmpfs", "-o", "mode=1777,nosuid,nodev", "tmpfs")
        mount(root / "tmp", "-t", "tmpfs", "-o", "mode=1777,nosuid,nodev", "tmpfs")
        ca = root / BUILD_CA.lstrip("/")
        ca.parent.mkdir()
        if Path(HOST_CA).is_file():
            shutil.copyfile(HOST_CA, ca)
        resolv = root / "etc/resolv.conf"
        if not resolv.exists() and not resolv.is_symlink():
            resolv.touch()
        mount(resolv, "--bind", os.path.realpath("/etc/resolv.conf"))
        yield
    finally:
        kill_strays(root)
        for mountpoint in reversed(mounted):
            sh("umount", "--lazy", str(mountpoint))


def kill_strays(root: Path) -> None:
    """A daemon that a RUN started would pin the mounts; Docker ends it with the step too.
    As PID 1 of our own PID namespace, any other process there is the build's."""
    proc = root / "proc"
    if os.getpid() != 1 or not (proc / "self").exists():
        return
    for entry in proc.iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(entry.name), signal.SIGKILL)


def passwd_ids(root: Path, user: str) -> tuple[int, int, str]:
    """uid, gid and home of USER's `name[:group]` or `uid[:gid]`, looked up in the root."""
    name, _, group = user.partition(":")
    users = [line.split(":") for line in (root / "etc/passwd").read_text().splitlines()]
    match = next((u for u in users if name in (u[0], u[2])), None)
    if match is None and not name.isdigit():
        raise BuildError(f"USER {user}: no such user in the image")
    uid = int(match[2]) if match else int(name)
    gid = int(match[3]) if match else uid
    if group:
        groups = [line.split(":") for line in (root / "etc/group").read_text().splitlines()]
        found = next((g for g in groups if group in (g[0], g[2])), None)
        gid = int(found[2]) if found else int(group)
    return uid, gid, match[5] if match else "/"


def run_instruction(inst: Instruction, state: State, root: Path, steps: Steps) -> None:
    words, exec_form = words_or_json(inst.args)
    argv = words if exec_form else ["/bin/sh", "-c", inst.args]
    uid, gid, home = passwd_ids(root, state.user or "0")
    env = {"HOME": home, **state.args, **state.env}
    if (root / BUILD_CA.lstrip("/")).is_file():
        env |= dict.fromkeys(CA_VARS, BUILD_CA)

    def enter() -> None:
        os.chroot(root)
        os.chdir(state.workdir)
        os.setgroups([gid])
        os.setgid(gid)
        os.setuid(uid)

    what = f"Dockerfile line {inst.line}: RUN {textwrap.shorten(inst.args, 72)}"
    steps.run(argv, what, env=env, preexec_fn=enter)
    kill_strays(root)


def copy_instruction(inst: Instruction, state: State, root: Path, context: Path) -> None:
    sources, dest = copy_args(inst)
    dest = posixpath.join(state.workdir, dest)
    into_folder = dest.endswith("/") or len(sources) > 1
    target_dir = root / dest.strip("/")
    for source in sources:
        path = (context / source).resolve()
        if not path.is_relative_to(context) or not path.exists():
            raise BuildError(f"Dockerfile line {inst.line}: no {source} in {context}")
        if path.is_dir():
            _copy_tree(path, target_dir, root)
        else:
            target = target_dir / path.name if into_folder or target_dir.is_dir() else target_dir
            _make_parents(target.parent, root)
            _copy_one(path, target)


def _make_parents(folder: Path, root: Path) -> None:
    missing = [p for p in (folder, *folder.parents) if p.is_relative_to(root) and not p.exists()]
    for parent in reversed(missing):
        parent.mkdir(mode=0o755)
        os.chown(parent, 0, 0)


def _copy_tree(source: Path, target: Path, root: Path) -> None:
    for path in _tree(source):
        dest = target / path.relative_to(source)
        if path.is_dir() and not path.is_symlink():
            if not dest.is_dir():
                _make_parents(dest, root)
            shutil.copystat(path, dest)
            os.chown(dest, 0, 0)
        else:
            _copy_one(path, dest)


def _copy_one(source: Path, target: Path) -> None:
    """As COPY does: contents, mode and mtime from the context, owned by root."""
    if target.is_symlink() or target.exists():
        _remove(target)
    if source.is_symlink():
        os.symlink(os.readlink(source), target)
    else:
        shutil.copy2(source, target)
    os.chown(target, 0, 0, follow_symlinks=False)


def carry_out(inst: Instruction, state: State, root: Path, steps: Steps, context: Path) -> None:
    if inst.keyword == "RUN":
        run_instruction(inst, state, root, steps)
    elif inst.keyword == "COPY":
        copy_instruction(inst, state, root, context)
    else:
        configure(state, inst)
        if inst.keyword == "WORKDIR":  # Docker creates it, owned by root
            _make_parents(root / state.workdir.lstrip("/"), root)


@dataclass(frozen=True)
class Base:
    root: Path
    layer: Path
    diff_id: str


def remove_tree(path: Path) -> None:
    """Never crosses into a mount, should one be left over in this namespace."""
    if path.exists():
        sh("rm", "-rf", "--one-file-system", str(path))


def ensure_base(plan: Plan, cache: Path, *, verbose: bool, say: Callable[[str], None]) -> Base:
    key = base_key(plan, REPO)
    final = cache / f"base-{key}"
    if (final / "diff_id").is_file():
        say(f"base {key}: cached")
        return Base(final / "root", final / "layer.tar", (final / "diff_id").read_text().strip())
    for stale in cache.glob("base-*"):  # one base at a time: each is about a gigabyte
        remove_tree(stale)
    partial = cache / f"base-{key}.partial"
    partial.mkdir()
    root = partial / "root"
    steps = Steps(partial / "build.log", verbose=verbose)
    started = time.monotonic()
    mirror = host_mirror()
    steps.run(
        ["debootstrap", "--variant=minbase", SUITE, str(root), mirror],
        f"debootstrap --variant=minbase {SUITE} {mirror}",
    )
    for name in ("etc/resolv.conf", "etc/hostname"):  # debootstrap copied the host's
        (root / name).write_text("")  # the runtime mounts its own on both
        (root / name).chmod(0o644)
    bootstrapped = time.monotonic()
    state = State(from_env(plan.base_image))
    with build_mounts(root):
        for inst in plan.base:
            carry_out(inst, state, root, steps, REPO)
    ran = time.monotonic()
    diff_id = write_layer(layer_entries(root), partial / "layer.tar")
    (partial / "diff_id").write_text(diff_id + "\n")
    partial.rename(final)
    say(
        f"base {key}: built in {time.monotonic() - started:.1f} s (debootstrap "
        f"{bootstrapped - started:.1f} s, steps {ran - bootstrapped:.1f} s, layer "
        f"{time.monotonic() - ran:.1f} s)"
    )
    return Base(final / "root", final / "layer.tar", diff_id)


def build_top(plan: Plan, base: Base, state: State, work: Path, *, verbose: bool) -> str:
    """Runs the code's instructions on an overlay of the base; returns the layer's diff_id."""
    upper, scratch, merged = work / "upper", work / "work", work / "merged"
    for folder in (upper, scratch, merged):
        folder.mkdir(parents=True)
    # Off: a redirect or metacopy upper would point into the lower and not stand alone.
    options = f"lowerdir={base.root},upperdir={upper},workdir={scratch}"
    options += ",redirect_dir=off,metacopy=off,index=off"
    sh("mount", "-t", "overlay", "overlay", "-o", options, str(merged))
    try:
        steps = Steps(work / "build.log", verbose=verbose)
        with build_mounts(merged):
            for inst in plan.top:
                carry_out(inst, state, merged, steps, REPO)
    finally:
        sh("umount", str(merged))
    entries = layer_entries(upper, whiteout=is_overlay_whiteout, opaque=is_overlay_opaque)
    return write_layer(entries, work / "layer.tar")


@contextlib.contextmanager
def locked(cache: Path) -> Iterator[None]:
    """One build at a time per cache (parallel test workers share the base)."""
    cache.mkdir(parents=True, exist_ok=True)
    with (cache / "lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def build_box(out: Path, *, tag: str, dockerfile: Path, verbose: bool) -> None:
    if os.getpid() != 1:
        raise BuildError("build_box runs in its own namespaces: call main()")
    started = time.monotonic()

    def say(text: str) -> None:
        print(f"boximage: {text}", file=sys.stderr, flush=True)

    plan = plan_of(parse_dockerfile(dockerfile.read_text()))
    cache = cache_dir()
    with locked(cache):
        for leftover in [*cache.glob("work-*"), *cache.glob("base-*.partial")]:
            remove_tree(leftover)  # from a build that was killed
        base = ensure_base(plan, cache, verbose=verbose, say=say)
        state = State(from_env(plan.base_image))
        for inst in plan.base:
            configure(state, inst)
        work = cache / f"work-{os.getpid()}"
        try:
            top_started = time.monotonic()
            top_id = build_top(plan, base, state, work, verbose=verbose)
            say(f"code layer: {time.monotonic() - top_started:.1f} s")
            archive_started = time.monotonic()
            history = [
                f"debootstrap --variant=minbase {SUITE} (for FROM {plan.base_image}), "
                + "; ".join(str(i) for i in plan.base),
                "; ".join(str(i) for i in plan.top),
            ]
            config = image_config(state, [base.diff_id, top_id], history)
            out.parent.mkdir(parents=True, exist_ok=True)
            write_archive(out, tag=tag, config=config, layers=[base.layer, work / "layer.tar"])
            size = out.stat().st_size / 1e6
            say(f"archive: {time.monotonic() - archive_started:.1f} s, {size:.0f} MB")
        finally:
            remove_tree(work)
    say(f"total: {time.monotonic() - started:.1f} s")


def build_pause(binary: Path, out: Path, *, tag: str) -> None:
    if not binary.is_file():
        raise BuildError(f"no pause binary at {binary}")
    if not is_static_elf(binary.read_bytes()[:4096]):
        raise BuildError(f"{binary} is not a static ELF binary: the image has no libc")
    work = out.with_name(out.name + ".layer")
    try:
        with tarfile.open(work, "w", format=tarfile.PAX_FORMAT) as tar, binary.open("rb") as data:
            tar.addfile(_member("pause", size=binary.stat().st_size, mode=0o755), data)
        diff_id = "sha256:" + _sha256(work)
        state = State({"PATH": DEFAULT_PATH}, cmd=["/pause"])
        config = image_config(state, [diff_id], [f"/pause from {binary.name}"])
        out.parent.mkdir(parents=True, exist_ok=True)
        write_archive(out, tag=tag, config=config, layers=[work])
    finally:
        work.unlink(missing_ok=True)


def is_static_elf(head: bytes) -> bool:
    """A 64-bit little-endian ELF without an interpreter (PT_INTERP) program header."""
    if head[:6] != b"\x7fELF\x02\x01":
        return False
    phoff = int.from_bytes(head[0x20:0x28], "little")
    size, count = (
        int.from_bytes(head[0x36:0x38], "little"),
        int.from_bytes(head[0x38:0x3A], "little"),
    )
    types = [
        int.from_bytes(head[phoff + i * size : phoff + i * size + 4], "little")
        for i in range(count)
    ]
    return 3 not in types


# --- the command line ----------------------------------------------------------------


def in_namespace(argv: list[str]) -> None:
    """Re-executes this command in private mount and PID namespaces: every mount and
    process of the build goes when it ends, however it ends (--kill-child: even if
    unshare itself is killed)."""
    if os.environ.get(NAMESPACE_MARK) == "1":
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # PID 1 ignores it otherwise
        return
    for tool in ("debootstrap", "unshare", "mount", "umount"):
        if shutil.which(tool) is None:
            hint = " (apt-get install debootstrap)" if tool == "debootstrap" else ""
            raise BuildError(f"{tool} is missing{hint}")
    command = ["unshare", "--mount", "--propagation", "private", "--pid", "--fork"]
    # -P: this file's folder on sys.path could shadow a standard module.
    command += ["--kill-child", sys.executable, "-P", str(Path(__file__).resolve()), *argv]
    os.environ[NAMESPACE_MARK] = "1"
    os.execvp("unshare", command)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m tests.cluster.boximage", description=__doc__)
    sub = parser.add_subparsers(dest="image", required=True)
    box = sub.add_parser("box", help="the box image, from images/box/Dockerfile (as root)")
    box.add_argument("--out", type=Path, required=True)
    box.add_argument("--tag", default=BOX_TAG)
    # Another Dockerfile (a variant, a failing step); COPY still reads the repository.
    box.add_argument("--dockerfile", type=Path, default=DOCKERFILE)
    box.add_argument("--verbose", action="store_true", help="steps' output to stderr")
    pause = sub.add_parser("pause", help="a sandbox image holding BIN as /pause")
    pause.add_argument("--binary", type=Path, required=True)
    pause.add_argument("--out", type=Path, required=True)
    pause.add_argument("--tag", default=PAUSE_TAG)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    out = args.out.absolute()
    try:
        if args.image == "pause":
            build_pause(args.binary, out, tag=args.tag)
        else:
            if os.geteuid() != 0:
                raise BuildError("the box image needs root (debootstrap, chroot, mounts)")
            in_namespace(argv)
            build_box(out, tag=args.tag, dockerfile=args.dockerfile, verbose=args.verbose)
    except BuildError as error:
        if error.tail:
            print(error.tail, file=sys.stderr)
        print(f"boximage: error: {error}", file=sys.stderr)
        return 1
    except OSError as error:  # a full disk, a missing file: still one line
        print(f"boximage: error: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("boximage: error: interrupted", file=sys.stderr)
        return 130
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
