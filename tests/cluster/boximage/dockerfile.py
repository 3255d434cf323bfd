"""Reading images/box/Dockerfile: its instructions, the plan (the cached base and the code's
top), the image config they set, and the base's cache key."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import posixpath
import shlex
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[3]
DOCKERFILE = REPO / "images/box/Dockerfile"
SUITE = "bookworm"
# Part of the base's cache key: bump it when this package changes how the base is made.
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


class BuildError(Exception):
    """A failure worth one line; `tail` is the failing step's last output."""

    def __init__(self, message: str, *, tail: str = "") -> None:
        super().__init__(message)
        self.tail = tail


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
                for path in source_tree(context / source):
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


def source_tree(path: Path) -> Iterator[Path]:
    """A COPY source and, for a folder, everything below it but Python's byte-code caches
    (what a .dockerignore would leave out: the image compiles its own)."""
    yield path
    if path.is_dir() and not path.is_symlink():
        for child in sorted(path.iterdir()):
            if child.name != "__pycache__":
                yield from source_tree(child)
