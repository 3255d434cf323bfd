"""`python -m tests.cluster.boximage box|pause`: the command line, which runs the box's
build in private mount and PID namespaces of its own."""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
from pathlib import Path

from tests.cluster import boximage
from tests.cluster.boximage.build import BOX_TAG, PAUSE_TAG, build_box, build_pause
from tests.cluster.boximage.dockerfile import DOCKERFILE, REPO, BuildError

NAMESPACE_MARK = "DEVBOX_BOXIMAGE_IN_NAMESPACE"
# What the command re-executed in the namespaces runs: this command, from the repository
# whatever the working folder (relative paths in its arguments are to that folder).
RE_EXEC = (
    "import sys; sys.path.insert(0, {repo!r}); "
    "from tests.cluster.boximage.__main__ import main; sys.exit(main())"
)


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
    # -P: no working folder on sys.path, where a name could shadow a standard module; the
    # repository goes first, as it does for `python -m` run there.
    command += ["--kill-child", sys.executable, "-P", "-c", RE_EXEC.format(repo=str(REPO))]
    command += argv
    os.environ[NAMESPACE_MARK] = "1"
    os.execvp("unshare", command)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m tests.cluster.boximage", description=boximage.__doc__
    )
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
