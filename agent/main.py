"""`devbox agent`: start the box's SSH server.

Start-up order is chosen for claim latency: everything the launcher needs to
record the box (the bound port, the host key, the GPUs) is settled and reported
on the ready pipe first; only then is asyncssh imported (the slow part) and the
already-listening socket served. A client that connects meanwhile waits in the
listen backlog instead of being refused.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import fcntl
import functools
import gc
import logging
import os
import resource
import signal
import socket
import sys
import time
from pathlib import Path

from agent import gpus, hostkey, sessions
from agent.init import become_init_if_pid1
from devbox import gpulocks, hang, private, protocol, saves, sshlib
from devbox.boxes import Multiplexer
from devbox.errors import UsageError


class StartError(Exception):
    """Why the agent cannot start; `kind` tells the launcher whose fault it is."""

    def __init__(self, message: str, kind: str = "failure") -> None:
        super().__init__(message)
        self.kind = kind  # "usage" (bad input), "resource" (not available now), "failure"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="devbox agent", description="Run a box's agent (SSH server).")
    p.add_argument("--name", help="box name (in a pod: from its devbox.io/box label)")
    p.add_argument("--home", type=Path, help="the box's home folder")
    p.add_argument(
        "--authorized-key",
        type=Path,
        help="file with the owner's SSH public key (the only key accepted)",
    )
    p.add_argument("--host-key", required=True, type=Path, help="host key file (made if absent)")
    p.add_argument("--listen", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=0, help="port (0: any free one)")
    p.add_argument("--gpus", type=int, default=0, help="GPUs to claim exclusively")
    p.add_argument(
        "--gpu-namespace",
        default=gpulocks.DEFAULT_NAMESPACE,
        help="abstract socket namespace of the machine's GPU locks (tests keep apart with it)",
    )
    p.add_argument("--lock-file", type=Path, help="held while the agent lives (liveness)")
    p.add_argument("--activity-file", type=Path, help="where user activity is published")
    p.add_argument("--multiplexer", default="auto", choices=("auto", "screen", "tmux", "none"))
    p.add_argument(
        "--processes",
        choices=("box", "all"),
        help="processes telemetry shows: the box's sessions, or all visible "
        "(default: all in a pod, whose PID namespace is the box; box otherwise)",
    )
    p.add_argument("--telemetry-rate", type=float, default=1.0, help="samples/s when unwatched")
    p.add_argument(
        "--probe-socket",
        type=Path,
        help="Unix socket for devbox.probe in training processes (default: a private "
        "folder under /tmp; sessions get it as $DEVBOX_PROBE_SOCKET)",
    )
    p.add_argument("--alerts-file", type=Path, help="where the probe's model alerts are published")
    p.add_argument(
        "--release-file",
        type=Path,
        help="read as the box ends: how long its probed processes may take to save "
        "(devbox.saves; in a pod the deletion's grace period says it)",
    )
    p.add_argument("--saved-file", type=Path, help="where what they saved is published")
    hung = p.add_argument_group("hung, not busy (devbox.hang)")
    hung.add_argument("--hang-util", type=float, default=hang.Rule.util, help="GPU busy percent")
    hung.add_argument(
        "--hang-power", type=float, default=hang.Rule.power, help="under this percent of power"
    )
    hung.add_argument(
        "--hang-after", type=float, default=hang.Rule.after, help="for this many seconds"
    )
    p.add_argument("--ready-fd", type=int, help="pipe to report readiness on (one frame)")
    p.add_argument(
        "--keeper-fd",
        type=int,
        help="socket to the box's keeper, which takes the GPU locks (devbox.backends.local.keeper)",
    )
    p.add_argument("--log-level", default="INFO")
    k8s = p.add_argument_group("in a Kubernetes pod")
    k8s.add_argument("--pod", help="this pod's name: follow it for the owner, publish the host key")
    k8s.add_argument("--namespace", help="this pod's namespace")
    k8s.add_argument("--kubeconfig", help="API credentials (default: the pod's service account)")
    k8s.add_argument("--home-root", type=Path, help="where homes live; the owner's is ROOT/OWNER")
    k8s.add_argument(
        "--become-owner",
        action="store_true",
        help="started as root: make the owner's home and run as the owner's uid (agent/owner.py)",
    )
    k8s.add_argument("--heartbeat", type=float, default=10.0, help="Lease renewal period (s)")
    return p


def _check(args: argparse.Namespace) -> None:
    try:
        args.hang = hang.Rule(
            util=args.hang_util, power=args.hang_power, after=args.hang_after
        ).check("--hang-*")
    except UsageError as exc:
        raise StartError(exc.message, "usage") from None
    if args.pod:
        if not (args.namespace and args.home_root):
            raise StartError("--pod needs --namespace and --home-root", "usage")
        args.home = args.home or args.home_root
        args.name = args.name or args.pod
    elif not (args.name and args.home and args.authorized_key):
        raise StartError("--name, --home and --authorized-key are required", "usage")


def _hold_lock(path: Path) -> int:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise StartError(f"another agent is already running for this box ({path})") from None
    os.ftruncate(fd, 0)
    os.write(fd, str(os.getpid()).encode())
    return fd


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise StartError(f"port {host}:{port} is already in use", "usage") from None
        raise StartError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    sock.listen(128)
    return sock


# The agent's own descriptor limit is raised to the hard limit, up to this: enough for the
# capped unauthenticated connections and many sessions and forwards of the owner's, while
# what the sessions inherit stays modest (programs that close every descriptor up to the
# limit, or use select(), do badly with a limit of 2^20, a container's usual hard limit).
FD_LIMIT_CEILING = 65536


def _raise_fd_limit() -> None:
    """Raise RLIMIT_NOFILE's soft limit: 1024, the usual default, is little for a server
    that anyone who reaches its port can make hold descriptors."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = FD_LIMIT_CEILING if hard == resource.RLIM_INFINITY else min(hard, FD_LIMIT_CEILING)
    if soft != resource.RLIM_INFINITY and soft < want:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))


def _report(fd: int | None, frame: bytes) -> None:
    if fd is None:
        sys.stdout.buffer.write(frame)
        sys.stdout.flush()
        return
    with contextlib.suppress(OSError), os.fdopen(fd, "wb") as pipe:
        pipe.write(frame)


# glibc's mallopt parameter for the number of malloc arenas (malloc.h).
M_ARENA_MAX = -8


def _one_malloc_arena() -> None:
    """One malloc arena for all of the agent's threads, before any is started. glibc gives
    each thread that allocates an arena of its own (the sampler's held 200-350 KiB of an
    idle box's memory, bench_idle); the GIL serialises the agent's threads anyway, so they
    never contend for the one. ctypes is asyncssh's import already; without glibc: nothing."""
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).mallopt(M_ARENA_MAX, 1)


def main(argv: list[str] | None = None) -> int:
    become_init_if_pid1()  # a container's first process: fork an init that reaps (init.py)
    args = _parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    # asyncssh logs every connection (three lines, before any authentication: a flood wrote
    # 23 MB in 20 s) and, verbatim, every command line, user name and SFTP path, at INFO
    # and DEBUG; it logs nothing above INFO. The agent logs its own, bounded, lines instead.
    logging.getLogger("asyncssh").setLevel(logging.WARNING)
    _raise_fd_limit()
    if args.keeper_fd is not None:
        os.set_inheritable(args.keeper_fd, False)  # the keeper's alone: no session gets it
    try:
        _check(args)
        args.home.mkdir(mode=0o700, parents=True, exist_ok=True)  # the launcher's is 0700 too
        os.chdir(args.home)
        if args.lock_file:
            _hold_lock(args.lock_file)
        owner_line = ""
        if args.authorized_key:
            owner_line = args.authorized_key.read_text().strip()
            if not owner_line.startswith(("ssh-", "ecdsa-", "sk-")):
                raise StartError(f"{args.authorized_key} does not hold an SSH public key")
        try:
            namespace = gpulocks.check_namespace(args.gpu_namespace)
            claim = gpus.claim(args.gpus, namespace=namespace)
            if args.keeper_fd is not None:
                claim.hand_over(args.keeper_fd)
        except gpulocks.NamespaceError as exc:
            raise StartError(str(exc), "usage") from None
        except gpus.GpuUnavailable as exc:
            raise StartError(str(exc), "resource") from None
        sock = _bind(args.listen, args.port)
        host_line = hostkey.load_or_create(args.host_key)
        mux = sessions.choose(args.multiplexer)
    except (StartError, OSError) as exc:
        if isinstance(exc, StartError):
            message, kind = str(exc), exc.kind
        else:
            message, kind = f"{exc.strerror}: {exc.filename}", "failure"
        _report(args.ready_fd, protocol.encode(protocol.ERROR, message=message, kind=kind))
        logging.error("cannot start: %s", message)
        return 1

    _report(
        args.ready_fd,
        protocol.encode(
            protocol.READY,
            port=sock.getsockname()[1],
            host_key=host_line,
            host_key_fingerprint=hostkey.fingerprint(host_line),
            gpu_ids=[g.uuid for g in claim.gpus],
            pid=os.getpid(),
            multiplexer=mux.kind,
        ),
    )
    # The GPU claim and the lock file stay held (open) until this process ends.
    _one_malloc_arena()
    import asyncio  # after READY: the launcher need not wait for it

    return asyncio.run(
        _serve(
            args,
            sock=sock,
            owner_line=owner_line,
            host_line=host_line,
            mux=mux,
            gpu_env=claim.visible_devices if args.gpus else "",
            gpu_uuids=[g.uuid for g in claim.gpus],
        )
    )


async def _serve(
    args: argparse.Namespace,
    *,
    sock: socket.socket,
    owner_line: str,
    host_line: str,
    mux: Multiplexer,
    gpu_env: str,
    gpu_uuids: list[str],
) -> int:
    import asyncio

    with sshlib.importing(umac=True):  # the process's first: quiet, no liboqs search (~40 ms)
        import asyncssh

    from agent import notices, saving, services
    from agent.server import Agent, BoxIdentity, serve

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    in_pod = bool(args.pod)
    all_processes = (args.processes or ("all" if in_pod else "box")) == "all"
    box = BoxIdentity(
        name=args.name,
        home=args.home,
        owner_key=asyncssh.import_public_key(owner_line) if owner_line else None,
        multiplexer=mux,
        # A box without GPUs sees none, rather than every GPU of the machine. In a
        # pod the device plugin has already chosen what the container sees.
        gpu_env=None if in_pod else gpu_env,
        warn_without_multiplexer=args.multiplexer != "none",
        home_is_home=in_pod,
    )
    box_services = await services.build(
        box=args.name,
        home=args.home,
        gpu_uuids=None if in_pod else gpu_uuids,
        all_processes=all_processes,
        telemetry_rate=args.telemetry_rate,
        activity_file=args.activity_file,
        probe_socket=args.probe_socket,
        alerts_file=args.alerts_file,
        hang_rule=args.hang,
        runs_dir=lambda: box.runs_dir,
        # The keeper spawned this agent: it is the parent, as long as the box lives.
        keeper_pid=os.getppid() if args.keeper_fd is not None else None,
    )
    tasks = box_services.tasks
    # Telemetry starts a moment late: the first SSH connection after `devbox up` comes first.
    tasks.spawn("telemetry", box_services.telemetry.run(delay=0.5))
    # Once everything long-lived is imported and built (asyncssh, NVML, the sampler), move
    # it out of the cyclic GC's sight: each tick allocates hundreds of small objects, and
    # the collections they trigger otherwise re-scan all of asyncssh every time (a third
    # of the agent's idle CPU at 1 Hz, benchmarks/bench_telemetry.py).
    loop.call_later(3.0, gc.freeze)
    binding = None
    if in_pod:
        from agent.incluster import PodBinding, PodSettings

        binding = await PodBinding.start(
            settings=PodSettings(
                pod=args.pod,
                namespace=args.namespace,
                kubeconfig=args.kubeconfig,
                home_root=args.home_root,
                become_owner=args.become_owner,
                heartbeat=args.heartbeat,
                all_processes=all_processes,
            ),
            box=box,
            services=box_services,
            host_line=host_line,
        )
        if box_services.probe_hub is not None:
            box_services.probe_hub.on_alerts = binding.publish_alerts
    agent = Agent(
        box, box_services, refresh_owner=binding.refresh_owner if binding is not None else None
    )

    async def tell(text: str) -> None:
        await asyncio.to_thread(notices.tell, box, text, all_processes=all_processes)

    def on_hung(since: float) -> None:
        if since:  # the user hears it where they work; the record says it to the rest
            text = hang.describe(box.name, since=since, now=time.time(), rule=args.hang)
            tasks.spawn("tell: hung", tell(text))

    box_services.activity.on_hung = on_hung

    async def end_box() -> None:
        # The box is ending. First its probed processes save (as long as the release
        # allows), then its persistent sessions end, and what runs in them: while clients
        # are still attached, so they see "[screen is terminating]".
        if binding is not None:
            deadline, reason, publish = await binding.ending()
        else:
            deadline, reason = _local_release(args.release_file)
            publish = functools.partial(_publish_local, args.saved_file)
        await saving.save_before_release(
            box_services.probe_hub,
            box=box.name,
            deadline=deadline,
            reason=reason,
            tell=tell,
            publish=publish,
        )
        await asyncio.to_thread(mux.end, box.name)

    await serve(agent, sock=sock, host_key=args.host_key, stop=stop, before_disconnect=end_box)
    if binding is not None:
        binding.stop()
    await box_services.close()
    return 0


def _local_release(path: Path | None) -> tuple[float, str]:
    """(deadline, reason) of a local box's release, from the file its backend wrote before
    it signalled the keeper; (0, "") without one: nobody asked for a save."""
    if path is None:
        return 0.0, ""
    try:
        return saves.read_request(path.read_text())
    except OSError:
        return 0.0, ""


async def _publish_local(path: Path | None, results: list[protocol.SaveResult]) -> None:
    if path is not None:
        private.write_text(path, saves.encode(results))
