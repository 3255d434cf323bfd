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
