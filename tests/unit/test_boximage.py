"""The pure parts of the test image builder (tests/cluster/boximage/): reading the
Dockerfile, what goes into a layer (whiteouts included) and the archive's layout. The full
build needs root and the network; the real node's tests run it."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import subprocess
import tarfile
from pathlib import Path

import pytest

from tests.cluster.boximage.__main__ import main
from tests.cluster.boximage.build import PAUSE_TAG, build_pause, mirror_from_sources
from tests.cluster.boximage.dockerfile import (
    DOCKERFILE,
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
)
from tests.cluster.boximage.layers import (
    is_overlay_opaque,
    is_overlay_whiteout,
    layer_entries,
    unpack,
    write_archive,
    write_layer,
)
from tests.conftest import REPO


def instructions(text: str) -> list[Instruction]:
    return parse_dockerfile(text)


def final_state(plan: Plan) -> State:
    state = State(from_env(plan.base_image))
    for inst in (*plan.base, *plan.top):
        configure(state, inst)
    return state


def test_continuations_join_as_docker_joins_them_and_comments_go() -> None:
    parsed = instructions(
        "# syntax=docker/dockerfile:1\n"
        "FROM debian:12\n"
        "\n"
        "run apt-get update \\\n"
        "# a comment inside the continuation\n"
        " && apt-get install -y \\\n"
        "      tmux\n"
        'CMD ["devbox", "--help"]\n'
    )
    assert [(i.keyword, i.line) for i in parsed] == [("FROM", 2), ("RUN", 4), ("CMD", 8)]
    assert parsed[1].args == "apt-get update  && apt-get install -y       tmux"


def test_the_box_dockerfile_is_its_setup_steps_and_splits_at_the_code() -> None:
    plan = plan_of(instructions(DOCKERFILE.read_text()))
    runs = [i.args for i in (*plan.base, *plan.top) if i.keyword == "RUN"]
    # The drift guard: the Dockerfile's build is setup.sh's steps, in the cache's order.
    assert runs == [f"sh /opt/devbox/setup.sh {step}" for step in ("system", "python", "devbox")]
    assert plan.top[0].keyword == "COPY" and plan.top[0].args.startswith("devbox ")
    copied = [copy_args(i)[0] for i in plan.base if i.keyword == "COPY"]
    assert copied == [["images/box/setup.sh"], ["pyproject.toml"]]
    state = final_state(plan)
    config = image_config(state, ["sha256:" + "0" * 64], ["x"])["config"]
    assert config["User"] == "0:0" and config["WorkingDir"] == "/homes"
    assert config["Cmd"] == ["devbox", "--help"]
    assert config["ExposedPorts"] == {"2222/tcp": {}}
    env = dict(e.split("=", 1) for e in config["Env"])
    assert env["LANG"] == "en_US.UTF-8" and env["SHELL"] == "/bin/bash"
    # What the CUDA base declares, so the test pod sees the same PATH and library path.
    assert env["LD_LIBRARY_PATH"] == "/usr/local/nvidia/lib:/usr/local/nvidia/lib64"
    assert env["PATH"].startswith("/usr/local/nvidia/bin:/usr/local/cuda/bin:")
    assert "DEBIAN_FRONTEND" not in env  # an ARG: RUN's environment only
    assert state.args == {"DEBIAN_FRONTEND": "noninteractive"}


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("RUN true\n", "must start with FROM"),
        ("FROM a\nENTRYPOINT x\nCOPY devbox /x\n", "ENTRYPOINT is not supported"),
        ("FROM a\nADD devbox /x\n", "ADD is not supported"),
        ("FROM a\nFROM b\nCOPY devbox /x\n", "FROM is not supported"),
        ("FROM a\nCOPY --chown=1 devbox /x\n", "only COPY SRC... DEST"),
        ("FROM a\nCOPY dev* /x\n", "patterns are not supported"),
        ("FROM a\nENV A=$B\nCOPY devbox /x\n", "variables are not supported"),
        ("FROM a\nCOPY agent /x\n", "never copies the devbox/ folder"),
        ("FROM a\nRUN x \\\n", "ends with a backslash"),
    ],
)
def test_what_it_cannot_carry_out_is_an_error(text: str, message: str) -> None:
    with pytest.raises(BuildError, match=message.replace(".", r"\.").replace("$", r"\$")):
        plan_of(instructions(text))


def test_config_instructions_in_their_forms() -> None:
    state = State({"PATH": "/bin"})
    for line in (
        'ENV A=1 B="two words" PATH=/x',
        "ENV LEGACY a value",
        "ARG UNSET",
        "ARG WITH=default",
        "EXPOSE 2222 53/udp",
        "WORKDIR /homes",
        "WORKDIR sub/../dir",
        "USER dev:dev",
        "CMD echo hi",
    ):
        configure(state, instructions(line)[0])
    assert state.env == {"PATH": "/x", "A": "1", "B": "two words", "LEGACY": "a value"}
    assert list(state.env) == ["PATH", "A", "B", "LEGACY"]  # an override keeps its place
    assert state.args == {"WITH": "default"}
    assert state.exposed == ["2222/tcp", "53/udp"]
    assert state.workdir == "/homes/dir" and state.user == "dev:dev"
    assert state.cmd == ["/bin/sh", "-c", "echo hi"]


def test_the_base_key_follows_what_the_base_copies_and_not_the_code(tmp_path: Path) -> None:
    for name in ("images/box/setup.sh", "pyproject.toml", "README.md", "devbox/cli.py"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(name)
    plan = plan_of(instructions(DOCKERFILE.read_text()))
    key = base_key(plan, tmp_path)
    (tmp_path / "devbox/cli.py").write_text("changed")
    (tmp_path / "README.md").write_text("changed")
    assert base_key(plan, tmp_path) == key
    (tmp_path / "pyproject.toml").write_text("changed")
    assert base_key(plan, tmp_path) != key
    changed = Plan(plan.base_image, plan.base[:-1], plan.top)
    assert base_key(changed, tmp_path) != base_key(plan, tmp_path)


def make_tree(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if name.endswith("/"):
            path.mkdir(exist_ok=True)
        else:
            path.write_text(text)


def test_a_layer_holds_the_image_but_not_runtime_folders_or_apt_caches(tmp_path: Path) -> None:
    make_tree(
        tmp_path,
        {
            "etc/passwd": "root",
            "proc/1/status": "",
            "dev/null": "",
            "tmp/build.log": "",
            "sys/": "",
            "var/cache/apt/pkgcache.bin": "",
            "var/cache/apt/archives/tmux.deb": "",
            "var/cache/apt/archives/partial/": "",
            "var/lib/apt/lists/deb.debian.org_Packages": "",
            "var/tmp/kept": "",
        },
    )
    (tmp_path / "etc/link").symlink_to("passwd")
    names = [name for name, _ in layer_entries(tmp_path)]
    assert names == [
        "dev",
        "etc",
        "etc/link",
        "etc/passwd",
        "proc",
        "sys",
        "tmp",
        "var",
        "var/cache",
        "var/cache/apt",
        "var/cache/apt/archives",
        "var/cache/apt/archives/partial",
        "var/lib",
        "var/lib/apt",
        "var/lib/apt/lists",
        "var/tmp",
        "var/tmp/kept",
    ]


def test_overlay_whiteouts_become_wh_entries(tmp_path: Path) -> None:
    # Stand-ins for the overlay's marks, which need root: the conversion is the same.
    make_tree(tmp_path, {"etc/gone": "", "etc/kept": "", "opt/fresh/new": ""})
    entries = layer_entries(
        tmp_path,
        whiteout=lambda path, st: path.name == "gone",
        opaque=lambda path: path.name == "fresh",
    )
    assert [(name, path is None) for name, path in entries] == [
        ("etc", False),
        ("etc/.wh.gone", True),
        ("etc/kept", False),
        ("opt", False),
        ("opt/fresh", False),
        ("opt/fresh/.wh..wh..opq", True),
        ("opt/fresh/new", False),
    ]


@pytest.mark.skipif(os.geteuid() != 0, reason="a char device 0:0 and trusted.* need root")
def test_real_overlay_marks_are_recognised(tmp_path: Path) -> None:
    os.mknod(tmp_path / "gone", 0o600 | stat.S_IFCHR, os.makedev(0, 0))
    (tmp_path / "fresh").mkdir()
    os.setxattr(tmp_path / "fresh", "trusted.overlay.opaque", b"y")
    (tmp_path / "plain").mkdir()
    entries = layer_entries(tmp_path, whiteout=is_overlay_whiteout, opaque=is_overlay_opaque)
    assert [name for name, _ in entries] == ["fresh", "fresh/.wh..wh..opq", ".wh.gone", "plain"]


def test_the_archive_is_docker_save_layout_and_unpacks_with_whiteouts(tmp_path: Path) -> None:
    lower, upper = tmp_path / "lower", tmp_path / "upper"
    make_tree(lower, {"etc/gone": "x", "etc/kept": "k", "opt/old/file": "o", "bin/tool": "t"})
    (lower / "bin/tool").chmod(0o4751)
    os.link(lower / "etc/kept", lower / "etc/hardlink")
    make_tree(upper, {"etc/gone": "", "opt/old/new": "n", "etc/kept": "changed"})
    layers = [tmp_path / "one.tar", tmp_path / "two.tar"]
    diff_ids = [
        write_layer(layer_entries(lower), layers[0]),
        write_layer(
            layer_entries(
                upper,
                whiteout=lambda path, st: path.name == "gone",
                opaque=lambda path: path.name == "old",
            ),
            layers[1],
        ),
    ]
    state = State({"PATH": "/bin"}, user="1000:1000", cmd=["tool"])
    config = image_config(state, diff_ids, ["one", "two"])
    archive = tmp_path / "image.tar"
    write_archive(archive, tag="devbox/box:test", config=config, layers=layers)

    with tarfile.open(archive) as tar:
        manifest = json.load(tar.extractfile("manifest.json"))  # type: ignore[arg-type]
        [entry] = manifest
        assert entry["RepoTags"] == ["devbox/box:test"]
        blob = tar.extractfile(entry["Config"]).read()  # type: ignore[union-attr]
        assert entry["Config"] == "blobs/sha256/" + hashlib.sha256(blob).hexdigest()
        stored = json.loads(blob)
        assert (stored["architecture"], stored["os"]) == ("amd64", "linux")
        assert stored["config"]["User"] == "1000:1000" and stored["config"]["Cmd"] == ["tool"]
        assert stored["rootfs"] == {"type": "layers", "diff_ids": diff_ids}
        for name, diff_id in zip(entry["Layers"], diff_ids, strict=True):
            data = tar.extractfile(name).read()  # type: ignore[union-attr]
            assert "sha256:" + hashlib.sha256(data).hexdigest() == diff_id
            assert name == "blobs/sha256/" + diff_id.partition(":")[2]
    with tarfile.open(layers[0]) as layer:
        members = {m.name: m for m in layer.getmembers()}
    assert members["bin/tool"].mode == 0o4751
    assert members["bin/tool"].uname == "" and members["bin/tool"].uid == os.getuid()
    assert members["etc/hardlink"].islnk() or members["etc/kept"].islnk()

    root = tmp_path / "root"
    root.mkdir()
    assert unpack(archive, root)["config"]["Cmd"] == ["tool"]
    assert not (root / "etc/gone").exists()
    assert (root / "etc/kept").read_text() == "changed"
    assert sorted(p.name for p in (root / "opt/old").iterdir()) == ["new"]
    assert (root / "bin/tool").stat().st_mode & 0o7777 == 0o4751


def elf(program_types: list[int]) -> bytes:
    header = bytearray(64)
    header[:7] = b"\x7fELF\x02\x01\x01"
    header[0x20:0x28] = (64).to_bytes(8, "little")
    header[0x36:0x38] = (56).to_bytes(2, "little")
    header[0x38:0x3A] = len(program_types).to_bytes(2, "little")
    return bytes(header) + b"".join(t.to_bytes(4, "little") + bytes(52) for t in program_types)


def test_the_pause_image_holds_only_the_static_binary(tmp_path: Path) -> None:
    binary, out = tmp_path / "pause-bin", tmp_path / "pause.tar"
    binary.write_bytes(elf([1, 1]))  # two PT_LOAD, no PT_INTERP
    build_pause(binary, out, tag=PAUSE_TAG)
    with tarfile.open(out) as tar:
        [entry] = json.load(tar.extractfile("manifest.json"))  # type: ignore[arg-type]
        config = json.load(tar.extractfile(entry["Config"]))  # type: ignore[arg-type]
        with tarfile.open(fileobj=tar.extractfile(entry["Layers"][0])) as layer:
            [member] = layer.getmembers()
    assert entry["RepoTags"] == ["devbox.local/pause:test"]
    assert config["config"]["Cmd"] == ["/pause"]
    assert (member.name, member.mode, member.uid, member.gid) == ("pause", 0o755, 0, 0)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pause-bin", "pause.tar"]

    binary.write_bytes(elf([1, 3, 1]))  # PT_INTERP: it needs a libc the image lacks
    with pytest.raises(BuildError, match="not a static ELF"):
        build_pause(binary, out, tag=PAUSE_TAG)


def test_the_mirror_comes_from_the_hosts_apt_sources() -> None:
    deb822 = (
        "Types: deb\n# http://snapshot.debian.org/archive/debian/20250520T000000Z\n"
        "URIs: http://mirror.example/debian\nSuites: bookworm bookworm-updates\n"
        "Components: main\nSigned-By: /usr/share/keyrings/debian-archive-keyring.gpg\n\n"
        "Types: deb\nURIs: http://security.example/debian-security\n"
        "Suites: bookworm-security\nComponents: main\n"
    )
    disabled = "Types: deb\nURIs: http://off.example/debian\nSuites: bookworm\n"
    disabled += "Components: main\nEnabled: no\n"
    one_line = "deb [arch=amd64 signed-by=/k.gpg] http://line.example/debian bookworm main\n"
    assert mirror_from_sources([disabled, deb822]) == "http://mirror.example/debian"
    assert mirror_from_sources(["# deb http://x/ bookworm main\n", one_line]) == (
        "http://line.example/debian"
    )
    assert mirror_from_sources(["deb http://x/debian bullseye main\n"]) is None


def test_the_box_image_without_root_is_one_line_and_exit_1(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert main(["box", "--out", str(tmp_path / "x.tar")]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1 and captured.err.startswith("boximage: error: ")


@pytest.mark.skipif(shutil.which("sh") is None, reason="needs a POSIX sh")
def test_setup_sh_parses_and_names_its_steps() -> None:
    script = REPO / "images/box/setup.sh"
    subprocess.run(["sh", "-n", str(script)], check=True)
    done = subprocess.run(["sh", str(script), "bogus"], capture_output=True, text=True)
    assert done.returncode == 2 and "system|python|devbox" in done.stderr
