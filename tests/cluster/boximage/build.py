"""The build: the base (debootstrap and the base's instructions in a chroot, cached),
the code's instructions on an overlay of it, one build at a time per cache; and the pause
image around a static binary."""

from __future__ import annotations

import contextlib
import fcntl
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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.cluster.boximage.dockerfile import (
    DEFAULT_PATH,
    REPO,
    SUITE,
    BuildError,
    Instruction,
    Plan,
    State,
    base_key,
    configure,
    copy_args,
    from_env,
    image_config,
    parse_dockerfile,
    plan_of,
    source_tree,
    words_or_json,
)
from tests.cluster.boximage.layers import (
    file_sha256,
    is_overlay_opaque,
    is_overlay_whiteout,
    layer_entries,
    remove_path,
    tar_member,
    write_archive,
    write_layer,
)

BOX_TAG = "devbox/box:test"
PAUSE_TAG = "devbox.local/pause:test"
FALLBACK_MIRROR = "http://deb.debian.org/debian"
# Where RUN finds the host's CA bundle (pip behind the host's TLS proxy): a tmpfs that is
# mounted on /tmp during the build only, so the bundle never reaches a layer.
HOST_CA = "/etc/ssl/certs/ca-certificates.crt"
BUILD_CA = "/tmp/.devbox-build/ca-certificates.crt"
CA_VARS = ("SSL_CERT_FILE", "PIP_CERT", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE", "GIT_SSL_CAINFO")
TAIL_LINES = 30


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
    for path in source_tree(source):
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
        remove_path(target)
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
            tar.addfile(tar_member("pause", size=binary.stat().st_size, mode=0o755), data)
        diff_id = "sha256:" + file_sha256(work)
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
