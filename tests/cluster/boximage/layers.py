"""Layer tars (overlay whiteouts included), the docker-archive that holds them, and
unpacking an archive as a runtime would."""

from __future__ import annotations

import hashlib
import io
import json
import os
import posixpath
import shutil
import stat
import tarfile
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import IO, Any

from tests.cluster.boximage.dockerfile import BuildError

# Not image content: the runtime mounts /proc, /sys, /dev and /tmp; apt's caches are rebuilt.
EMPTIED = ("proc/", "sys/", "dev/", "tmp/")
FILES_DROPPED = ("var/cache/apt/", "var/lib/apt/lists/")


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
                tar.addfile(tar_member(name, size=0, mode=0o644))
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
    return "sha256:" + file_sha256(out)


def tar_member(name: str, *, size: int, mode: int) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.mtime = size, mode, int(time.time())
    return info


def file_sha256(path: Path) -> str:
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
            info = tar_member(folder, size=0, mode=0o755)
            info.type = tarfile.DIRTYPE
            tar.addfile(info)
        _add_bytes(tar, config_name, blob)
        for name, path in zip(layer_names, layers, strict=True):
            with path.open("rb") as data:
                tar.addfile(tar_member(name, size=path.stat().st_size, mode=0o644), data)
        _add_bytes(tar, "manifest.json", json.dumps(manifest).encode())
    partial.replace(out)


def _add_bytes(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    tar.addfile(tar_member(name, size=len(data), mode=0o644), io.BytesIO(data))


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
                    remove_path(child)
        elif base.startswith(".wh."):
            remove_path(dest / parent / base[4:])
    content = [m for m in members if not posixpath.basename(m.name).startswith(".wh.")]
    for member in content:
        if member.name.startswith("/") or ".." in member.name.split("/"):
            raise BuildError(f"unsafe name in a layer: {member.name}")
        target = dest / member.name
        if target.is_symlink() or (target.exists() and not (member.isdir() and target.is_dir())):
            remove_path(target)
    trusted = {"filter": "fully_trusted"} if hasattr(tarfile, "fully_trusted_filter") else {}
    layer.extractall(dest, members=content, numeric_owner=True, **trusted)  # type: ignore[arg-type]


def remove_path(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.is_symlink() or path.exists():
        path.unlink()
